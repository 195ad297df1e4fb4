"""cache_aware: sglang-router semantics minus its faults."""

import random
from collections import Counter

import pytest

from policies.base import (
    REASON_IMBALANCE,
    REASON_MISS,
    REASON_PREFIX_HIT,
    RouteContext,
    WorkerView,
)
from policies.registry import create_policy


def ctx(workers: list[WorkerView], prompt: int = 1000, seed: int = 0) -> RouteContext:
    return RouteContext(prompt_tokens=prompt, candidates=workers, rng=random.Random(seed))


def test_defaults_are_sglang_cli_defaults() -> None:
    assert create_policy("cache_aware").describe() == {
        "name": "cache_aware",
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
    }
    assert create_policy("cache_aware").uses_prefix_match


def test_prefix_hit_goes_to_holder() -> None:
    policy = create_policy("cache_aware")
    workers = [WorkerView("a", matched_tokens=0), WorkerView("b", matched_tokens=500)]
    decision = policy.select(ctx(workers))
    assert (decision.worker_id, decision.reason) == ("b", REASON_PREFIX_HIT)
    assert decision.scores == {"a": 0.0, "b": 0.5}


def test_least_loaded_among_longest_match_holders() -> None:
    policy = create_policy("cache_aware")
    workers = [
        WorkerView("h1", in_flight=5, matched_tokens=800),
        WorkerView("h2", in_flight=2, matched_tokens=800),
        WorkerView("short", in_flight=0, matched_tokens=400),
        WorkerView("cold", in_flight=0),
    ]
    for seed in range(10):
        assert policy.select(ctx(workers, seed=seed)).worker_id == "h2"


def test_holder_ties_at_random() -> None:
    policy = create_policy("cache_aware")
    workers = [WorkerView("h1", matched_tokens=800), WorkerView("h2", matched_tokens=800)]
    seen = Counter(policy.select(ctx(workers, seed=s)).worker_id for s in range(100))
    assert set(seen) == {"h1", "h2"}


def test_below_threshold_is_a_miss_to_least_loaded_random_ties() -> None:
    policy = create_policy("cache_aware")
    workers = [
        WorkerView("a", in_flight=3, matched_tokens=300),  # 0.3 is not > 0.3
        WorkerView("b", in_flight=1),
        WorkerView("c", in_flight=1),
    ]
    seen: Counter[str] = Counter()
    for s in range(100):
        decision = policy.select(ctx(workers, seed=s))
        assert decision.reason == REASON_MISS
        seen[decision.worker_id] += 1
    assert set(seen) == {"b", "c"}  # sglang-router would always pick the first


def test_imbalance_mode_ignores_cache() -> None:
    policy = create_policy("cache_aware")
    workers = [
        WorkerView("hot", in_flight=100, matched_tokens=1000),
        WorkerView("cold", in_flight=10),
    ]
    decision = policy.select(ctx(workers))
    assert (decision.worker_id, decision.reason) == ("cold", REASON_IMBALANCE)


def test_imbalance_needs_both_thresholds() -> None:
    policy = create_policy("cache_aware")
    # abs difference 70 > 64 and 180 > 110 * 1.5 = 165: imbalanced
    workers = [WorkerView("hot", in_flight=180, matched_tokens=900), WorkerView("x", in_flight=110)]
    assert policy.select(ctx(workers)).reason == REASON_IMBALANCE
    # abs difference 70 but relative 1.4 < 1.5: balanced, the holder wins
    workers = [WorkerView("hot", in_flight=245, matched_tokens=900), WorkerView("x", in_flight=175)]
    assert policy.select(ctx(workers)).worker_id == "hot"
    # relative 3x but abs 20 <= 64: balanced
    workers = [WorkerView("hot", in_flight=30, matched_tokens=900), WorkerView("x", in_flight=10)]
    assert policy.select(ctx(workers)).worker_id == "hot"


def test_custom_thresholds() -> None:
    policy = create_policy(
        "cache_aware", cache_threshold=0.5, balance_abs_threshold=2, balance_rel_threshold=1.1
    )
    workers = [WorkerView("a", in_flight=1, matched_tokens=400), WorkerView("b", in_flight=0)]
    assert policy.select(ctx(workers)).reason == REASON_MISS
    workers = [WorkerView("a", in_flight=5, matched_tokens=900), WorkerView("b", in_flight=2)]
    assert policy.select(ctx(workers)).reason == REASON_IMBALANCE


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        create_policy("cache_aware", cache_threshold=2.0)
    with pytest.raises(ValueError):
        create_policy("cache_aware", balance_rel_threshold=0.5)
