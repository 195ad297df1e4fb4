"""Property tests: the radix cache against a naive reference.

The reference keeps the cached content as a set of page-aligned token prefixes (one entry
per page boundary), the obvious O(n²) representation. After every operation:

* every match equals the reference's longest cached prefix (matches are true prefixes, and
  nothing cached is missed);
* the pool counters agree with a recount of the tree, and the tree holds exactly the
  reference's tokens, so capacity is never exceeded;
* every locked path is still fully cached (locked paths are never evicted);
* each evicted node was, at its eviction, an unlocked leaf whose last access was the oldest
  of all unlocked leaves, found by brute force over the whole tree (eviction order is LRU).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.model.radix_cache import (
    CacheFullError,
    RadixCache,
    TreeNode,
    decode_tokens,
    encode_tokens,
)

NAMESPACES = ("", "salt-a")


@dataclass
class Reference:
    page: int
    prefixes: set[tuple[str, tuple[int, ...]]] = field(default_factory=set)

    def aligned(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % self.page]

    def longest(self, ns: str, tokens: list[int]) -> int:
        tokens = self.aligned(tokens)
        best = 0
        for end in range(self.page, len(tokens) + 1, self.page):
            if (ns, tuple(tokens[:end])) in self.prefixes:
                best = end
            else:
                break
        return best

    def insert(self, ns: str, tokens: list[int]) -> None:
        tokens = self.aligned(tokens)
        for end in range(self.page, len(tokens) + 1, self.page):
            self.prefixes.add((ns, tuple(tokens[:end])))

    def num_tokens(self) -> int:
        return len(self.prefixes) * self.page


class CheckingListener:
    """Checks each eviction against the reference and a brute-force LRU choice."""

    def __init__(self, cache_ref: list[RadixCache], ref: Reference) -> None:
        self._cache_ref = cache_ref
        self.ref = ref
        self.evictions = 0

    def on_stored(self, node: TreeNode) -> None:
        assert node.num_tokens > 0

    def on_removed(self, node: TreeNode) -> None:
        cache = self._cache_ref[0]
        assert not node.children and node.lock_ref == 0, "evicting a non-leaf or locked node"
        oldest = min(
            n.last_access for n in cache.iter_nodes() if not n.children and n.lock_ref == 0
        )
        assert node.last_access == oldest, "eviction is not LRU"
        path = decode_tokens(node.path_key())
        start = node.depth_tokens()
        for end in range(start + self.ref.page, len(path) + 1, self.ref.page):
            entry = (node.namespace, tuple(path[:end]))
            assert entry in self.ref.prefixes, "evicted tokens the reference never cached"
            self.ref.prefixes.remove(entry)
        longer = (node.namespace, tuple(path))
        assert not any(
            ns == longer[0] and len(p) > len(path) and p[: len(path)] == longer[1]
            for ns, p in self.ref.prefixes
        ), "evicted a node that still has cached extensions"
        self.evictions += 1

    def on_cleared(self) -> None:
        self.ref.prefixes.clear()


# An operation: ("insert" | "match" | "lock", namespace, tokens), ("unlock" | "alloc" |
# "free" | "evict", n) or ("reset",); run_ops dispatches on the first item.
Op = tuple[Any, ...]

tokens_st = st.lists(st.integers(min_value=0, max_value=3), min_size=0, max_size=14)
insert_st = st.tuples(st.just("insert"), st.sampled_from(NAMESPACES), tokens_st)
op_st = st.one_of(
    # inserts dominate so that the pool fills and evictions happen in most examples
    insert_st,
    insert_st,
    insert_st,
    insert_st,
    st.tuples(st.just("match"), st.sampled_from(NAMESPACES), tokens_st),
    st.tuples(st.just("lock"), st.sampled_from(NAMESPACES), tokens_st),
    st.tuples(st.just("unlock"), st.integers(min_value=0, max_value=7)),
    st.tuples(st.just("alloc"), st.integers(min_value=0, max_value=12)),
    st.tuples(st.just("free"), st.integers(min_value=0, max_value=12)),
    st.tuples(st.just("evict"), st.integers(min_value=0, max_value=12)),
    st.tuples(st.just("reset")),
)


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    page=st.sampled_from([1, 2, 4]),
    capacity=st.integers(min_value=6, max_value=40),
    ops=st.lists(op_st, min_size=5, max_size=80),
)
def test_cache_matches_reference(page: int, capacity: int, ops: list[Op]) -> None:
    run_ops(page, capacity, ops)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page=st.sampled_from([1, 2, 4]),
    capacity=st.integers(min_value=6, max_value=40),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_long_random_workloads(page: int, capacity: int, seed: int) -> None:
    """Long op sequences (hundreds of ops) drawn from a seeded RNG: many evictions per run."""
    rng = random.Random(seed)
    ops: list[Op] = []
    for _ in range(400):
        r = rng.random()
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 13))]
        ns = rng.choice(NAMESPACES)
        if r < 0.45:
            ops.append(("insert", ns, tokens))
        elif r < 0.6:
            ops.append(("match", ns, tokens))
        elif r < 0.72:
            ops.append(("lock", ns, tokens))
        elif r < 0.85:
            ops.append(("unlock", rng.randrange(8)))
        elif r < 0.92:
            ops.append(("alloc", rng.randrange(6)))
        elif r < 0.98:
            ops.append(("free", rng.randrange(6)))
        else:
            ops.append(("evict", rng.randrange(8)))
    evictions = run_ops(page, capacity, ops)
    assert evictions > 0


def run_ops(page: int, capacity: int, ops: list[Op]) -> int:
    """Apply ``ops`` to a cache and the reference, checking everything after each one."""
    ref = Reference(page)
    holder: list[RadixCache] = []
    listener = CheckingListener(holder, ref)
    cache = RadixCache(capacity, page_size=page, listener=listener)
    holder.append(cache)
    locks: list[tuple[str, list[int], TreeNode]] = []

    for op in ops:
        kind = op[0]
        if kind == "insert":
            _, ns, tokens = op
            try:
                cache.insert(encode_tokens(tokens), ns)
            except CacheFullError:
                pass
            else:
                ref.insert(ns, tokens)
        elif kind in ("match", "lock"):
            _, ns, tokens = op
            expected = ref.longest(ns, tokens)
            got, node = cache.match_prefix(encode_tokens(tokens), ns)
            assert got == expected
            assert decode_tokens(node.path_key()) == ref.aligned(tokens)[:got]
            if kind == "lock" and got > 0:
                cache.inc_lock(node)
                locks.append((ns, ref.aligned(tokens)[:got], node))
        elif kind == "unlock":
            if locks:
                _, _, node = locks.pop(op[1] % len(locks))
                cache.dec_lock(node)
        elif kind == "alloc":
            if cache.can_alloc(op[1]):
                cache.alloc(op[1])
            else:
                try:
                    cache.alloc(op[1])
                except CacheFullError:
                    pass
                else:
                    raise AssertionError("alloc beyond free + evictable succeeded")
        elif kind == "free":
            cache.free(min(op[1], cache.private))
        elif kind == "evict":
            cache.evict(op[1])
        elif kind == "reset" and not locks:
            cache.reset()

        cache.check_invariants()
        assert cache.tree_tokens == ref.num_tokens()
        assert cache.tree_tokens + cache.private <= cache.capacity
        for ns, key, _ in locks:
            assert cache.peek_prefix(encode_tokens(key), ns) == len(key), "locked path evicted"
    return listener.evictions


@settings(max_examples=100, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4]),
    seqs=st.lists(tokens_st, min_size=1, max_size=20),
    probe=tokens_st,
)
def test_match_is_longest_common_page_aligned_prefix(
    page: int, seqs: list[list[int]], probe: list[int]
) -> None:
    """Without eviction, a match is the longest page-aligned common prefix with any insert."""
    cache = RadixCache(10_000, page_size=page)
    for seq in seqs:
        cache.insert(encode_tokens(seq))
    best = 0
    for seq in seqs:
        common = 0
        for a, b in zip(seq, probe, strict=False):
            if a != b:
                break
            common += 1
        best = max(best, common - common % page)
    assert cache.peek_prefix(encode_tokens(probe)) == best
    assert cache.match_prefix(encode_tokens(probe))[0] == best
    cache.check_invariants()
