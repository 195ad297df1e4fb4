"""Unit tests of the simulated worker's radix cache."""

from __future__ import annotations

import random
import time

import pytest

from simulator.model.radix_cache import (
    CacheFullError,
    RadixCache,
    TreeNode,
    common_prefix_bytes,
    decode_tokens,
    encode_tokens,
)


def k(*tokens: int) -> bytes:
    return encode_tokens(list(tokens))


def cached(cache: RadixCache, key: bytes, ns: str = "") -> int:
    return cache.peek_prefix(key, ns)


class Recorder:
    def __init__(self) -> None:
        self.stored: list[list[int]] = []
        self.removed: list[list[int]] = []
        self.cleared = 0

    def on_stored(self, node: TreeNode) -> None:
        self.stored.append(decode_tokens(node.path_key()))

    def on_removed(self, node: TreeNode) -> None:
        self.removed.append(decode_tokens(node.path_key()))

    def on_cleared(self) -> None:
        self.cleared += 1


def test_encode_decode_roundtrip() -> None:
    tokens = [0, 1, 151645, 2**32 - 1]
    assert decode_tokens(encode_tokens(tokens)) == tokens
    assert len(encode_tokens(tokens)) == 16


def test_common_prefix_bytes() -> None:
    a = k(1, 2, 3, 4, 5)
    assert common_prefix_bytes(a, 0, k(1, 2, 9), 12) == 8
    assert common_prefix_bytes(a, 4, k(2, 3, 4), 12) == 12
    assert common_prefix_bytes(a, 0, k(7), 4) < 4


def test_insert_then_match_full_and_partial() -> None:
    cache = RadixCache(100)
    assert cache.insert(k(1, 2, 3, 4)) == 0
    assert cache.tree_tokens == 4 and cache.evictable == 4 and cache.available == 96
    assert cache.match_prefix(k(1, 2, 3, 4, 5))[0] == 4
    matched, node = cache.match_prefix(k(1, 2, 9))
    assert matched == 2
    assert decode_tokens(node.path_key()) == [1, 2]  # the edge was split at the match
    assert cache.insert(k(1, 2, 9, 9)) == 2
    assert cache.tree_tokens == 6
    cache.check_invariants()


def test_page_aligned_match_and_insert() -> None:
    cache = RadixCache(100, page_size=4)
    assert cache.insert(k(*range(10))) == 0
    assert cache.tree_tokens == 8  # the partial last page is not cached
    assert cached(cache, k(*range(10))) == 8
    assert cached(cache, k(0, 1, 2, 3, 4, 5, 99, 7)) == 4  # divergence inside page 2
    assert cached(cache, k(0, 1, 2)) == 0
    cache.check_invariants()


def test_namespaces_never_share_prefixes() -> None:
    cache = RadixCache(100)
    cache.insert(k(1, 2, 3), "salt-a")
    assert cached(cache, k(1, 2, 3)) == 0
    assert cached(cache, k(1, 2, 3), "salt-a") == 3
    assert cached(cache, k(1, 2, 3), "salt-b") == 0


def test_locked_path_survives_eviction() -> None:
    cache = RadixCache(10)
    cache.insert(k(1, 1, 1, 1))
    cache.insert(k(2, 2, 2, 2))
    _, node = cache.match_prefix(k(1, 1, 1, 1))
    cache.inc_lock(node)
    assert cache.protected == 4 and cache.evictable == 4
    cache.insert(k(3, 3, 3, 3, 3))  # needs 3 more slots: only (2,2,2,2) may go
    assert cached(cache, k(1, 1, 1, 1)) == 4
    assert cached(cache, k(2, 2, 2, 2)) == 0
    with pytest.raises(CacheFullError):
        cache.alloc(7)  # 1 free + 5 evictable
    cache.dec_lock(node)
    cache.alloc(7)
    assert cache.private == 7 and cache.available + cache.evictable == 3
    cache.check_invariants()


def test_eviction_is_lru_over_leaves() -> None:
    rec = Recorder()
    cache = RadixCache(12, listener=rec)
    cache.insert(k(1, 1, 1))
    cache.insert(k(2, 2, 2))
    cache.insert(k(3, 3, 3))
    cache.match_prefix(k(1, 1, 1))  # (1,1,1) is now the most recent
    cache.insert(k(4, 4, 4, 4, 4))  # 3 free, needs 2 more: evicts the oldest leaf
    assert rec.removed == [[2, 2, 2]]
    cache.insert(k(5, 5, 5))
    assert rec.removed == [[2, 2, 2], [3, 3, 3]]
    cache.check_invariants()


def test_eviction_walks_from_tip_to_root() -> None:
    rec = Recorder()
    cache = RadixCache(8, listener=rec)
    cache.insert(k(1, 2, 3))
    cache.insert(k(1, 2, 4))  # shared (1, 2), leaves (3) and (4)
    cache.insert(k(9, 9, 9, 9, 9))  # needs 5, 4 free → evict one leaf
    assert rec.removed == [[1, 2, 3]]
    cache.insert(k(8, 8, 8))  # needs 3 more: the other leaf, then the bare parent
    assert rec.removed == [[1, 2, 3], [1, 2, 4], [1, 2]]
    cache.check_invariants()


def test_insert_of_allocated_tokens_moves_private_to_tree() -> None:
    cache = RadixCache(20)
    cache.insert(k(1, 2, 3))
    cache.alloc(5)  # a request computed 5 tokens (1, 2, 3, 4, 5) itself
    existing = cache.insert(k(1, 2, 3, 4, 5), allocated=True)
    assert existing == 3
    assert cache.private == 3  # its copies of the 3 duplicates are still its own
    cache.free(existing)
    assert cache.tree_tokens == 5 and cache.private == 0 and cache.available == 15
    cache.check_invariants()


def test_reset_drops_everything_and_notifies() -> None:
    rec = Recorder()
    cache = RadixCache(20, listener=rec)
    cache.insert(k(1, 2, 3))
    cache.reset()
    assert cache.tree_tokens == 0 and cache.available == 20 and rec.cleared == 1
    _, node = cache.match_prefix(k())
    cache.insert(k(4, 5))
    _, node = cache.match_prefix(k(4, 5))
    cache.inc_lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()


def test_listener_sees_stores_without_split_events() -> None:
    rec = Recorder()
    cache = RadixCache(20, listener=rec)
    cache.insert(k(1, 2, 3))
    cache.insert(k(1, 2, 4))
    assert rec.stored == [[1, 2, 3], [1, 2, 4]]


def test_32k_match_and_insert_is_fast() -> None:
    """The benchmark target is ≤ 1 ms; allow slack for a loaded CI machine."""
    rng = random.Random(0)
    cache = RadixCache(420_000)
    shared = [rng.randrange(150_000) for _ in range(24_000)]
    cache.insert(encode_tokens(shared))
    keys = [
        encode_tokens(shared + [rng.randrange(150_000) for _ in range(8_000)]) for _ in range(20)
    ]
    best = float("inf")
    for key in keys:
        t0 = time.perf_counter()
        cache.match_prefix(key)
        cache.insert(key)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.005
    cache.check_invariants()
