"""The replay's reference re-implementation of sglang-router's cache_aware rule."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from loadtests.replay.sglang_rule import SglangCacheAware
from policies.base import Decision, RouteContext, WorkerView


def _ctx(loads: list[int], chars: int = 640) -> RouteContext:
    views = [WorkerView(id=f"w{i}", in_flight=n) for i, n in enumerate(loads)]
    return RouteContext(
        prompt_tokens=chars // 4, candidates=views, rng=random.Random(0), prompt_chars=chars
    )


def _select(
    policy: SglangCacheAware, ctx: RouteContext, hashes: Sequence[int], block_chars: int
) -> Decision:
    return policy.select(replace(ctx, block_hashes=hashes, block_chars=block_chars))


def test_cold_ties_go_to_the_first_worker() -> None:
    policy = SglangCacheAware()
    picks = [_select(policy, _ctx([0, 0, 0]), [100 + i], 64).worker_id for i in range(5)]
    assert picks == ["w0"] * 5


def test_match_above_threshold_follows_the_first_inserter() -> None:
    policy = SglangCacheAware(cache_threshold=0.3)
    _select(policy, _ctx([1, 0]), [1, 2, 3, 4], 64)  # cold: least loaded w1
    # 4 of 10 blocks match (0.4 > 0.3): back to w1 although it is now busier.
    d = _select(policy, _ctx([0, 3]), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 64)
    assert (d.worker_id, d.reason) == ("w1", "prefix_hit")
    # 2 of 10 (0.2): below the threshold, least loaded.
    d = _select(policy, _ctx([0, 3]), [1, 2, 30, 40, 50, 60, 70, 80, 90, 99], 64)
    assert (d.worker_id, d.reason) == ("w0", "miss")


def test_imbalance_ignores_the_cache() -> None:
    policy = SglangCacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    _select(policy, _ctx([0, 1]), [1, 2, 3], 64)  # w0
    d = _select(policy, _ctx([10, 2]), [1, 2, 3], 64)
    assert (d.worker_id, d.reason) == ("w1", "imbalance")
    # Not imbalanced when the relative rule fails (20 <= 14 * 1.5): the first inserter.
    d = _select(policy, _ctx([20, 14], chars=192), [1, 2, 3], 64)
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")


def test_tree_size_bound_evicts_least_recent_blocks() -> None:
    policy = SglangCacheAware(max_tree_size=3 * 64)
    _select(policy, _ctx([0, 1]), [1, 2, 3], 64)
    _select(policy, _ctx([1, 0]), [7, 8, 9], 64)  # w1 (cold)
    _select(policy, _ctx([0, 1]), [4, 5], 64)  # w0: evicts its deepest old blocks
    assert policy._match([1, 2, 3], {"w0", "w1"}) == (1, "w0")
    d = _select(policy, _ctx([0, 0], chars=3 * 64), [1, 2, 3], 64)
    assert d.reason == "prefix_hit" and d.worker_id == "w0"
