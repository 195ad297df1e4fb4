"""Cache-hit bounds for a request sequence: H_inf, OPT(N·C) and pooled LRU.

Input: requests in arrival order, each a :class:`BlockRequest` — the ids of its prompt
blocks in prompt order and the token size of each block. Ids are *chained* (as Mooncake
``hash_ids`` and the gateway's block hashes are): an equal id at position ``i`` means the
whole prefix up to ``i`` is equal.

Definitions (``../shared/docs/PERFORMANCE.md`` §1):

* **Prefix semantics.** A block counts as a hit only if it and every block before it in
  the same request are resident when the request arrives: a request's hit is the leading
  run of resident blocks. A resident block behind a miss is a miss (the engine's radix
  tree could not reach it either).
* **Token-level hit rate** = hit tokens / prompt tokens (blocks weighted by their token
  size); the block-level rate (each block counts 1) is reported beside it, because the
  measured table of PERFORMANCE.md §2 is block-level.
* ``infinite_cache``: one cache of unbounded size; only a block's first occurrence misses.
* ``opt_pooled``: Belady with bypass on ONE cache of ``capacity_tokens``. After each access
  a block's priority is the index of its next access; on a miss the block is admitted only
  if it is used again and room can be made by evicting blocks whose next use is later than
  its own (otherwise it bypasses the cache). Within a request, blocks are accessed in
  prompt order, so a child's next use is always later than its parent's: children are
  evicted before parents and the resident set stays prefix-closed. With unit block sizes
  this is the optimal offline policy (the tests check it against exhaustive search); with
  variable sizes (the last, partial block of a prompt) it is Belady's rule, a heuristic
  (the exact optimum with sizes is NP-hard) that the tests check never exceeds the
  exhaustive optimum; on the traces only the last block of a prompt is short, so the gap
  is small, but strictly it is then an estimate of the bound, not a proof.
* ``lru_pooled``: one LRU cache of ``capacity_tokens``, demand admission of every block.
  Within a request recency is refreshed deepest block first, so a parent is always more
  recent than its children and eviction removes leaves first, as SGLang's radix cache does.

Cost: O(M) for H_inf and LRU, O(M log M) for OPT, for M block references. No module state.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

_NEVER = 1 << 62  # "no next use": larger than any access index


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One request's prompt as chained block ids and the token size of each block."""

    ids: tuple[Hashable, ...]
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.tokens):
            raise ValueError("ids and tokens must have the same length")

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)


@dataclass(frozen=True, slots=True)
class CacheResult:
    """Hits of one cache policy over a request sequence; ``hit_tokens[i]`` per request."""

    hit_tokens: tuple[int, ...]
    hit_blocks: tuple[int, ...]
    total_tokens: int
    total_blocks: int

    @property
    def token_hit_rate(self) -> float:
        return sum(self.hit_tokens) / self.total_tokens if self.total_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return sum(self.hit_blocks) / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class Bounds:
    """The three reference points of PERFORMANCE.md §1 for one capacity."""

    capacity_tokens: int
    infinite: CacheResult
    opt: CacheResult
    lru_pooled: CacheResult

    def token_rates(self) -> dict[str, float]:
        return {
            "infinite": self.infinite.token_hit_rate,
            "opt": self.opt.token_hit_rate,
            "lru_pooled": self.lru_pooled.token_hit_rate,
        }

    def block_rates(self) -> dict[str, float]:
        return {
            "infinite": self.infinite.block_hit_rate,
            "opt": self.opt.block_hit_rate,
            "lru_pooled": self.lru_pooled.block_hit_rate,
        }


def _leading_hits(req: BlockRequest, resident: Iterable[bool]) -> tuple[int, int]:
    """(blocks, tokens) of the leading run of resident blocks."""
    blocks = 0
    tokens = 0
    for is_resident, size in zip(resident, req.tokens, strict=False):
        if not is_resident:
            break
        blocks += 1
        tokens += size
    return blocks, tokens


def _result(requests: Sequence[BlockRequest], hits: list[tuple[int, int]]) -> CacheResult:
    return CacheResult(
        hit_tokens=tuple(t for _, t in hits),
        hit_blocks=tuple(b for b, _ in hits),
        total_tokens=sum(r.total_tokens for r in requests),
        total_blocks=sum(len(r.ids) for r in requests),
    )


def infinite_cache(requests: Sequence[BlockRequest]) -> CacheResult:
    """H_inf: an unbounded cache; only first occurrences miss."""
    seen: set[Hashable] = set()
    hits: list[tuple[int, int]] = []
    for req in requests:
        hits.append(_leading_hits(req, (b in seen for b in req.ids)))
        seen.update(req.ids)
    return _result(requests, hits)


def lru_pooled(requests: Sequence[BlockRequest], capacity_tokens: int) -> CacheResult:
    """One LRU cache of ``capacity_tokens``; every block is admitted on use."""
    cache: OrderedDict[Hashable, int] = OrderedDict()  # id -> size, least recent first
    used = 0
    hits: list[tuple[int, int]] = []
    for req in requests:
        hits.append(_leading_hits(req, (b in cache for b in req.ids)))
        for block, size in zip(reversed(req.ids), reversed(req.tokens), strict=True):
            old = cache.pop(block, None)
            if old is not None:
                used -= old
            if size > capacity_tokens:
                continue
            cache[block] = size
            used += size
            while used > capacity_tokens:
                _, evicted = cache.popitem(last=False)
                used -= evicted
    return _result(requests, hits)


def _next_uses(requests: Sequence[BlockRequest]) -> list[int]:
    """For every access (request-major, prompt order), the index of the block's next access."""
    flat = [b for req in requests for b in req.ids]
    nxt = [_NEVER] * len(flat)
    last: dict[Hashable, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = last.get(flat[i], _NEVER)
        last[flat[i]] = i
    return nxt


class _BeladyCache:
    """Resident blocks keyed by id, with a lazy max-heap on next use."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.used = 0
        self.next_use: dict[Hashable, int] = {}
        self.size: dict[Hashable, int] = {}
        self._heap: list[tuple[int, int, Hashable]] = []  # (-next_use, tiebreak, id)
        self._tick = 0

    def _push(self, block: Hashable, next_use: int) -> None:
        self._tick += 1
        heapq.heappush(self._heap, (-next_use, self._tick, block))

    def touch(self, block: Hashable, next_use: int) -> None:
        if next_use == _NEVER:
            self.used -= self.size.pop(block)
            del self.next_use[block]
            return
        self.next_use[block] = next_use
        self._push(block, next_use)

    def _furthest(self) -> tuple[Hashable, int] | None:
        while self._heap:
            neg, _, block = self._heap[0]
            if self.next_use.get(block) == -neg:
                return block, -neg
            heapq.heappop(self._heap)
        return None

    def admit(self, block: Hashable, size: int, next_use: int) -> None:
        if next_use == _NEVER or size > self.capacity:
            return
        while self.used + size > self.capacity:
            furthest = self._furthest()
            if furthest is None or furthest[1] <= next_use:
                return  # bypass: everything resident is needed sooner
            victim = furthest[0]
            heapq.heappop(self._heap)
            del self.next_use[victim]
            self.used -= self.size.pop(victim)
        self.next_use[block] = next_use
        self.size[block] = size
        self.used += size
        self._push(block, next_use)


def opt_pooled(requests: Sequence[BlockRequest], capacity_tokens: int) -> CacheResult:
    """OPT(N·C): Belady with bypass on one pooled cache of ``capacity_tokens``."""
    nxt = _next_uses(requests)
    cache = _BeladyCache(capacity_tokens)
    hits: list[tuple[int, int]] = []
    i = 0
    for req in requests:
        hits.append(_leading_hits(req, (b in cache.size for b in req.ids)))
        for block, size in zip(req.ids, req.tokens, strict=True):
            if block in cache.size:
                cache.touch(block, nxt[i])
            else:
                cache.admit(block, size, nxt[i])
            i += 1
    return _result(requests, hits)


def compute_bounds(requests: Sequence[BlockRequest], capacity_tokens: int) -> Bounds:
    """H_inf, OPT and pooled LRU for a pooled capacity (N workers of C tokens each)."""
    return Bounds(
        capacity_tokens=capacity_tokens,
        infinite=infinite_cache(requests),
        opt=opt_pooled(requests, capacity_tokens),
        lru_pooled=lru_pooled(requests, capacity_tokens),
    )
