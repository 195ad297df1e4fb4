"""Bounds against hand-worked cases and exhaustive search on small random cases."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from functools import cache

import pytest

from loadtests.replay.bounds import (
    BlockRequest,
    compute_bounds,
    infinite_cache,
    lru_pooled,
    opt_pooled,
)


def _req(ids: Sequence[int], sizes: Sequence[int] | None = None) -> BlockRequest:
    return BlockRequest(tuple(ids), tuple(sizes) if sizes is not None else (1,) * len(ids))


def _random_case(rng: random.Random, unit: bool) -> tuple[list[BlockRequest], int]:
    """Requests as root-to-node paths of a small random trie (chained ids)."""
    children: dict[int, list[int]] = {0: []}
    sizes: dict[int, int] = {0: 1 if unit else rng.randint(1, 3)}
    next_id = 1
    paths: list[list[int]] = []
    for _ in range(rng.randint(3, 8)):
        path = [0]
        for _depth in range(rng.randint(0, 2)):
            kids = children[path[-1]]
            if kids and rng.random() < 0.6:
                node = rng.choice(kids)
            elif next_id < 7:
                node = next_id
                next_id += 1
                kids.append(node)
                children[node] = []
                sizes[node] = 1 if unit else rng.randint(1, 3)
            else:
                break
            path.append(node)
        paths.append(path)
    reqs = [_req(p, [sizes[b] for b in p]) for p in paths]
    return reqs, rng.randint(1, 5)


def _brute_force(requests: Sequence[BlockRequest], capacity: int) -> int:
    """The best total hit tokens over every choice of resident set after each request."""
    size = {b: s for r in requests for b, s in zip(r.ids, r.tokens, strict=True)}

    @cache
    def best(i: int, state: frozenset[Hashable]) -> int:
        if i == len(requests):
            return 0
        req = requests[i]
        hit = 0
        for b, s in zip(req.ids, req.tokens, strict=True):
            if b not in state:
                break
            hit += s
        pool = sorted(state | set(req.ids), key=repr)
        outcome = 0
        for mask in range(1 << len(pool)):
            chosen = frozenset(pool[k] for k in range(len(pool)) if mask >> k & 1)
            if sum(size[b] for b in chosen) <= capacity:
                outcome = max(outcome, best(i + 1, chosen))
        return hit + outcome

    return best(0, frozenset())


def test_infinite_cache_counts_only_first_occurrences() -> None:
    reqs = [_req([1, 2, 3], [512, 512, 100]), _req([1, 2, 4], [512, 512, 300]), _req([1, 5])]
    result = infinite_cache(reqs)
    assert result.hit_tokens == (0, 1024, 1)
    assert result.hit_blocks == (0, 2, 1)
    assert result.total_tokens == 512 * 2 + 100 + 512 * 2 + 300 + 2
    assert result.block_hit_rate == pytest.approx(3 / 8)


def test_prefix_semantics_resident_block_behind_a_miss_is_a_miss() -> None:
    # Block 2 is resident but block 9 before it is not: nothing after the miss counts.
    reqs = [_req([1, 2]), _req([9, 2])]
    assert infinite_cache(reqs).hit_blocks == (0, 0)


def test_lru_evicts_least_recent_and_leaves_first() -> None:
    reqs = [_req([1, 2]), _req([3, 4]), _req([1, 2])]
    assert lru_pooled(reqs, 4).hit_blocks == (0, 0, 2)
    # Capacity 3: request 2 evicts block 2 (leaf of the oldest path), root 1 survives.
    assert lru_pooled(reqs, 3).hit_blocks == (0, 0, 1)


def test_opt_bypasses_blocks_never_reused() -> None:
    reqs = [_req([1]), _req([2]), _req([3]), _req([1])]
    # Capacity 1: LRU loses block 1; OPT keeps it by not admitting 2 and 3.
    assert lru_pooled(reqs, 1).hit_blocks == (0, 0, 0, 0)
    assert opt_pooled(reqs, 1).hit_blocks == (0, 0, 0, 1)


def test_oversized_block_never_cached() -> None:
    reqs = [_req([1], [10]), _req([1], [10])]
    assert opt_pooled(reqs, 5).hit_tokens == (0, 0)
    assert lru_pooled(reqs, 5).hit_tokens == (0, 0)


@pytest.mark.parametrize("seed", range(150))
def test_opt_equals_exhaustive_search_with_unit_blocks(seed: int) -> None:
    reqs, capacity = _random_case(random.Random(seed), unit=True)
    bounds = compute_bounds(reqs, capacity)
    optimum = _brute_force(reqs, capacity)
    assert sum(bounds.opt.hit_tokens) == optimum
    assert sum(bounds.lru_pooled.hit_tokens) <= optimum <= sum(bounds.infinite.hit_tokens)


@pytest.mark.parametrize("seed", range(100))
def test_order_of_bounds_with_variable_blocks(seed: int) -> None:
    reqs, capacity = _random_case(random.Random(1000 + seed), unit=False)
    bounds = compute_bounds(reqs, capacity)
    optimum = _brute_force(reqs, capacity)
    assert sum(bounds.opt.hit_tokens) <= optimum <= sum(bounds.infinite.hit_tokens)
    assert sum(bounds.lru_pooled.hit_tokens) <= optimum


def test_large_capacity_reaches_infinite_cache() -> None:
    rng = random.Random(7)
    reqs = [_req([0, rng.randint(1, 20), rng.randint(21, 40)]) for _ in range(200)]
    bounds = compute_bounds(reqs, 10_000)
    assert bounds.opt.hit_tokens == bounds.infinite.hit_tokens
    assert bounds.lru_pooled.hit_tokens == bounds.infinite.hit_tokens
