"""Which worker is believed to hold which prompt blocks: match / record / forget / correct.

Structure (after llm-d's approximate prefix indexer):
- a flat map ``block hash → bitmask of workers`` believed to hold that block (each worker
  owns one bit; a bit is reused after the worker is forgotten);
- per worker, an LRU of its block hashes (a plain ``dict`` in insertion order: front =
  least recently used, value = time of last touch; a touch re-inserts at the end)
  bounded by the worker's capacity in blocks. Not an ``OrderedDict``: the garbage
  collector never tracks a plain dict of numbers, but walks every entry of an
  ``OrderedDict`` on each full collection; with 256 full workers (6.7 million blocks)
  that paused the event loop for 0.6-3 s, several times a minute under load
  (BENCHMARKS.md, "Scale").
Blocks are chained hashes (``gateway.routing.hashing``): a hit on block ``i`` implies the prefix.

Memory is bounded whatever the traffic: every block entry belongs to some worker's LRU,
and each LRU is trimmed to its capacity on every ``record``. Capacity per worker:
``ceil(max_total_num_tokens / block_tokens)`` blocks (``set_capacity``), else
``default_capacity_blocks``; both capped by ``max_blocks_per_worker``. ``block_tokens`` is
per worker: the engine tokens a block of the gateway's characters holds there, learnt
from the worker's answers (``set_block_tokens``, from ``gateway.routing.tokens``). Measured cost per
indexed block is in BENCHMARKS.md ("Prefix index cost"); ``IndexStats.approx_bytes`` uses
that figure.

Flags of sglang-router and their meaning here:
- ``--max-tree-size`` counts *characters per worker* in sglang-router's radix tree; here
  it becomes ``max_blocks_per_worker = max_tree_size // block_chars`` (its default,
  67,108,864 characters, is 1,048,576 blocks of 64: far above a worker's real capacity,
  so the engine-derived capacity normally binds).
- ``--eviction-interval-secs`` is, in sglang-router, the period of the background job that
  trims each worker's tree to ``max_tree_size``. Capacity is enforced on every ``record``
  here, so no such job is needed; instead the gateway calls ``evict_idle(now,
  max_idle_s)`` every ``eviction_interval_secs`` to drop blocks nobody has touched for
  ``max_idle_s`` seconds (entries that old are the first an engine under pressure evicts,
  and the ones a restarted engine has lost).

One class of ~630 lines on purpose: the LRU, the pins of in-flight recordings, the
sequence bound, the host tier and the deferred recordings all act on one per-worker state
and keep one invariant between them (prefix-closed blocks, each block in exactly one of
the pins, the LRU and the host tier); splitting it would spread that invariant over
several classes reaching into each other's state.

Sequence bound (optional, per worker: ``set_capacity(..., max_sequences=n)``): a worker
that keeps a fixed number of prompts rather than tokens (llama.cpp with its RAM prompt
cache off keeps one per slot) is also bounded by ``n`` *sequences*: the chains recorded
there, kept in an LRU keyed by their last block. A new chain takes over the held one with
which it shares the longest prefix when that exceeds ``_REUSE_SHARE`` of its blocks
(llama.cpp reuses the slot most similar to the prompt, above 10 %), else it is added and
the least recently used chain is evicted beyond ``n``. A chain dropped so loses only its
blocks beyond what the worker's other chains share with it. Such a worker holds the very
prompt it just answered, so ``correct`` does not trim it; a shortfall there means the
prompt ran in another slot than the one believed to hold it (busy with a sibling, or long
overwritten), so when all slots are believed in use, the least recently used other chain
is dropped: the engine overwrote its least recently used idle slot.

Pins (after the engine's lock on a running request's path): a recording is *in flight*
until ``correct`` reports its response complete, and meanwhile its blocks are pinned
(``pins``, a count per block) rather than in the LRU, so newer recordings evict other
blocks first, as SGLang's radix cache never evicts a locked path. On completion the
blocks held by no other in-flight recording join the LRU as most recently used (SGLang
touches the whole path when it caches the finished request). Measured on the Mooncake
conversation trace replay (BENCHMARKS.md, "Policy tuning"): responses stay in flight
about 20 s against a cache turnover of about 30 s, so ageing blocks from dispatch
dropped prefixes still locked on the worker. Bounds: pinned blocks count toward the
capacity; when pins alone exceed it (more in flight than the pool can lock, i.e. queued
requests) the oldest recordings are released first; a recording never released (an
error without usage) expires after ``pin_ttl_s``, and beyond ``_MAX_INFLIGHT`` recordings
per worker the oldest is released at once (each holds its block list: the bound on their
memory). A peer gateway's recordings are not pinned (``record(..., pin=False)``): this
index never hears when they end.
Sequence-bounded workers are not pinned.

Recording order and invariant: a prompt's blocks are touched deepest first, so its first
block is the most recently used and LRU eviction removes a chain from its tail, as the
engine's radix cache evicts leaves first. Hence each worker's believed blocks are
*prefix-closed* (if it holds block i of a chain it holds blocks 0..i), like the engine's
cache itself, and ``match`` finds each worker's match length by bisection instead of
visiting every block. Only a correction can break closure (trimming a chain also cuts
siblings that share the trimmed blocks); ``match`` may then over-estimate such a
sibling until its own report trims it: never below the exact answer, and self-healing.

Correction: when a worker reports fewer cached tokens than predicted, its entries for
that prompt beyond the real match are dropped, unless a recording within
``correction_grace_s`` started adding blocks right where the real match ends (then the
shortfall is explained by a sibling still in prefill on that worker, not by eviction;
each recording remembers only its first new block, so this costs one entry per
recording). ``correction_tolerance`` absorbs the error of the characters-per-token
estimate. Predicted and reported cached tokens are counted per worker: the index's
fidelity.

Host tier (HiCache, issue 20; ``set_host_capacity``): a worker running SGLang's
``--enable-hierarchical-cache`` keeps what its GPU evicts in host memory and loads it back
for a request that matches it. Per such worker, ``host`` holds the blocks believed
demoted: a block the device LRU evicts moves there (front = first demoted) instead of
being forgotten, and leaves it when the host bound (the worker's host-only capacity in
blocks) pushes it out, or when a recording touches it again (the engine loads it back to
the GPU: it is in the device LRU, or pinned, from then on). Each held block is in exactly
one of ``pins``, ``lru`` and ``host``; ``match`` sees all three (the holder bit), and the
device part of a match is prefix-closed as the whole is (demotion takes a chain from its
tail, as the engine's device eviction takes leaves), so :meth:`device_blocks` finds it by
bisection. The device bound is ``capacity_tokens`` times the worker's ``device_share``,
1.0 until the engine's reports (``cached_tokens_details``: :meth:`observe_tiers`) show
that fewer of the prompts the gateway recorded fit on its GPU (it also caches the output
tokens and holds running requests' KV there). Memory: the host dict is bounded by its
capacity as the LRU is by its own (both capped by ``max_blocks_per_worker``). The tier
adds about 130 lines to the class for the reason above: its blocks share the invariant.

Deferred recording (``defer``; the live gateway's mode): a pinned recording's work is
proportional to the whole prompt (every held block is moved to the pins, every new block
evicts one from the front of the LRU), and at 256 workers the index's millions of
entries make each of those dict operations a cache miss: 0.4-1 ms for a 1,000-block
prompt, on the request's path (``python -m loadtests.micro.decision --phases``).
Deferred, ``record`` does on the path only what the next ``match`` needs to co-locate:
the worker's holder bit on the blocks past its held prefix (found by bisection, as
``match`` does, or from the match the decision saw where that is shorter; a prompt that
extends a held conversation marks only its new turn). The rest (pins, LRU, eviction,
host tier, sequence bookkeeping) is queued and done by ``flush``, which the owner
schedules to run as soon as the event loop is free (``call_soon``: once the request's
task waits, normally for the worker), and which every other public method runs first, so
``correct``, ``stats``, ``forget_worker`` and the rest see the index exactly as if
nothing had been deferred. Those that do not wait for it: ``match``, and what a deferred
recording cannot change (``free_sequences``, ``held_sequences``, ``capacity_blocks``,
and ``device_blocks`` of a worker without a host tier). Until then a marked block may be
in none of ``pins``, ``lru`` and ``host``, and the blocks the queued recordings will
evict still count in a ``match``: for the time between a dispatch and the next turn of
the event loop. Sequence-bounded workers and unpinned recordings are never deferred. At
most ``_MAX_PENDING`` recordings wait; past that the oldest is done at once.

Not thread-safe; used from one event loop (or one replay) only. Times are seconds on one
monotonic clock (``time.monotonic`` unless the caller passes ``now``).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice, takewhile

# Bytes per indexed block for one holder (map entry + LRU entry + int key), measured by
# ``python -m loadtests.micro.index`` with tracemalloc; see BENCHMARKS.md.
APPROX_BYTES_PER_BLOCK = 190
# Bound on remembered recent insertion points per worker (one per recording, not per block).
_MAX_FRESH = 4096
# A chain takes over a held one sharing more than this share of its blocks (llama.cpp's
# default slot_prompt_similarity).
_REUSE_SHARE = 0.1
# Bound on in-flight recordings per worker (each holds its block list): far above what one
# worker runs at once; past it the oldest is released, whatever its age.
_MAX_INFLIGHT = 4096
# A recording not released by ``correct`` or ``release`` within this many seconds stops
# pinning its blocks (a response whose end was never reported, e.g. a lost task).
DEFAULT_PIN_TTL_S = 300.0
# Host tier (see "Host tier"): each report that shows the device part of a match off by
# more than the tolerance moves the worker's device share by this factor, never below
# the floor (a GPU holding under a tenth of the recorded prompts is no longer a tier).
_SHARE_STEP = 0.02
_MIN_DEVICE_SHARE = 0.1
# Bound on deferred recordings waiting for ``flush`` (see "Deferred recording").
_MAX_PENDING = 256


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two chains share; chained hashes make equality prefix-closed."""
    n = min(len(a), len(b))
    return bisect_left(range(n), True, key=lambda i: a[i] != b[i])


def _loses_any(get: Callable[[int, int], int], hashes: Sequence[int], alive: int, i: int) -> bool:
    """True when some worker of ``alive`` does not hold block ``i``."""
    return get(hashes[i], 0) & alive != alive


@dataclass(frozen=True, slots=True)
class IndexStats:
    blocks: int
    approx_bytes: int
    predicted_tokens: int
    reported_tokens: int


@dataclass(slots=True)
class _WorkerBlocks:
    bit: int
    capacity: int  # blocks
    block_tokens: float  # the worker's engine tokens per block (``set_block_tokens``)
    capacity_tokens: int | None = None  # as the worker told (``set_capacity``)
    # a plain dict, insertion order = recency (module docstring: never tracked by the
    # garbage collector, unlike an OrderedDict)
    lru: dict[int, float] = field(default_factory=dict)
    # first newly inserted block of each recent recording -> time (see ``correct``)
    fresh: OrderedDict[int, float] = field(default_factory=OrderedDict)
    predicted_tokens: int = 0
    reported_tokens: int = 0
    max_sequences: int | None = None  # None: bounded by blocks only
    # last block of each held chain -> the chain (LRU: front = least recently recorded)
    sequences: OrderedDict[int, tuple[int, ...]] = field(default_factory=OrderedDict)
    # blocks of in-flight recordings (see "Pins"): block -> recordings holding it; a block
    # is either here or in ``lru``, never both
    pins: dict[int, int] = field(default_factory=dict)
    # in-flight recordings, oldest first: sequence number -> (chain, time recorded)
    inflight: OrderedDict[int, tuple[Sequence[int], float]] = field(default_factory=OrderedDict)
    # last block of an in-flight chain -> its recordings' sequence numbers, oldest first
    inflight_by_leaf: dict[int, list[int]] = field(default_factory=dict)
    # host tier (see "Host tier"): blocks believed demoted to host memory -> last touch,
    # insertion order = demotion order; bounded by ``host_capacity`` blocks (0: none)
    host: dict[int, float] = field(default_factory=dict)
    host_capacity: int = 0
    host_tokens: int | None = None  # the host-only capacity as the worker told it
    device_share: float = 1.0  # of ``capacity_tokens``, the part believed to hold prompts


class PrefixIndex:
    def __init__(
        self,
        block_tokens: float = 16.0,
        default_capacity_blocks: int = 26_250,
        max_blocks_per_worker: int | None = None,
        *,
        correction_tolerance: float = 0.25,
        correction_grace_s: float = 10.0,
        pin_ttl_s: float = DEFAULT_PIN_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # 26,250 blocks x 16 tokens = 420k tokens: one H100-80GB worker's KV for an 8B
        # model (PERFORMANCE.md section 3), the capacity assumed before a worker reports.
        if block_tokens <= 0 or default_capacity_blocks <= 0:
            raise ValueError("block_tokens and default_capacity_blocks must be positive")
        if max_blocks_per_worker is not None and max_blocks_per_worker <= 0:
            raise ValueError("max_blocks_per_worker must be positive")
        self._block_tokens = block_tokens
        self._default_capacity = default_capacity_blocks
        self._max_blocks = max_blocks_per_worker
        self._tolerance = correction_tolerance
        self._grace_s = correction_grace_s
        self._pin_ttl_s = pin_ttl_s
        self._seq = 0  # numbers in-flight recordings
        self._clock = clock
        self._holders: dict[int, int] = {}  # block hash -> bitmask of workers
        self._workers: dict[str, _WorkerBlocks] = {}
        self._names: dict[int, str] = {}  # bit -> worker id
        self._free_bits: list[int] = []
        self._next_bit = 1
        # deferred recordings (chain, worker id, time), oldest first; ``_schedule`` asks
        # the owner to run ``flush`` soon (None: nothing is deferred)
        self._pending: deque[tuple[Sequence[int], str, float]] = deque()
        self._tiered: set[str] = set()  # workers with a host tier (``tiered``)
        self._schedule: Callable[[], None] | None = None

    def defer(self, schedule: Callable[[], None] | None) -> None:
        """Defer pinned recordings' bookkeeping (see "Deferred recording"); ``schedule``
        is called when the first recording waits, and must get ``flush`` run soon (the
        live gateway: ``loop.call_soon``). None: record at once again (after a flush)."""
        self.flush()
        self._schedule = schedule

    def flush(self) -> None:
        """Do the deferred recordings' bookkeeping, oldest first."""
        pending = self._pending
        while pending:
            hashes, worker_id, t = pending.popleft()
            self._record(hashes, worker_id, t, True)

    # --- configuration ---------------------------------------------------------------

    def set_capacity(
        self, worker_id: str, capacity_tokens: int | None, max_sequences: int | None = None
    ) -> None:
        """Bound the worker's LRU from its ``max_total_num_tokens``.

        blocks = ceil(capacity_tokens / block_tokens): e.g. 420,000 tokens / 16 = 26,250
        blocks; capped by ``max_blocks_per_worker``. Shrinking evicts at once. None keeps
        the bound in blocks as it is (a worker that told only a sequence bound).
        ``max_sequences`` (> 0) also bounds it by chains (see "Sequence bound"); setting it
        on a worker whose blocks were recorded without the bound forgets those blocks (no
        chain is known for them), and None removes the bound.
        """
        if self._pending:
            self.flush()
        state = self._state(worker_id)
        if capacity_tokens is not None:
            state.capacity_tokens = capacity_tokens
            self._resize(state)
        if max_sequences is not None and max_sequences <= 0:
            raise ValueError("max_sequences must be positive")
        if max_sequences is not None and state.max_sequences is None:
            for h in state.lru:
                self._clear(h, state.bit)
            for h in state.pins:
                self._clear(h, state.bit)
            for h in state.host:
                self._clear(h, state.bit)
            state.host.clear()
            state.lru.clear()
            state.fresh.clear()
            state.pins.clear()
            state.inflight.clear()
            state.inflight_by_leaf.clear()
        elif max_sequences is None:
            state.sequences.clear()
        state.max_sequences = max_sequences
        while max_sequences is not None and len(state.sequences) > max_sequences:
            self._drop_sequence(state, next(iter(state.sequences)))

    def set_block_tokens(self, worker_id: str, block_tokens: float) -> None:
        """The worker's engine tokens per block, as learnt from its answers
        (``routing.tokens``): its capacity in blocks and the corrections from its
        ``cached_tokens`` follow. Shrinking evicts at once."""
        if self._pending:
            self.flush()
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        state = self._state(worker_id)
        state.block_tokens = block_tokens
        if state.capacity_tokens is not None:
            self._resize(state)
        if state.host_tokens:
            self._resize_host(state)

    def _resize(self, state: _WorkerBlocks) -> None:
        assert state.capacity_tokens is not None
        blocks = math.ceil(state.capacity_tokens * state.device_share / state.block_tokens)
        state.capacity = self._cap(max(1, blocks))
        self._evict_over_capacity(state)

    def block_tokens(self, worker_id: str) -> float:
        """The worker's engine tokens per block (the index's default until told)."""
        state = self._workers.get(worker_id)
        return state.block_tokens if state is not None else self._block_tokens

    def _cap(self, blocks: int) -> int:
        return blocks if self._max_blocks is None else min(blocks, self._max_blocks)

    def _state(self, worker_id: str) -> _WorkerBlocks:
        state = self._workers.get(worker_id)
        if state is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit << 1
            state = _WorkerBlocks(bit, self._cap(self._default_capacity), self._block_tokens)
            self._workers[worker_id] = state
            self._names[bit] = worker_id
        return state

    # --- match / record --------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Worker id → number of leading blocks of ``block_hashes`` it holds (if > 0).

        Each worker's believed blocks are prefix-closed (see "Invariant" in the module
        docstring), so the set of workers holding *all* of blocks ``0..i`` only shrinks
        with ``i`` and its change points are found by bisection: O(w log n) lookups for
        w workers, instead of one lookup per block. Stops at once when nobody holds
        block 0.
        """
        n = len(block_hashes)
        if n == 0:
            return {}
        get = self._holders.get
        alive = get(block_hashes[0], 0)
        result: dict[str, int] = {}
        pos = 1
        while alive:
            end = bisect_left(
                range(n), True, lo=pos, key=partial(_loses_any, get, block_hashes, alive)
            )
            remaining = get(block_hashes[end], 0) & alive if end < n else 0
            gone = alive & ~remaining
            while gone:
                low = gone & -gone
                result[self._names[low]] = end
                gone ^= low
            alive, pos = remaining, end + 1
        return result

    def record(
        self,
        block_hashes: Sequence[int],
        worker_id: str,
        now: float | None = None,
        *,
        pin: bool = True,
        held: int | None = None,
    ) -> None:
        """Believe ``worker_id`` holds these blocks (called at dispatch); refresh its LRU.
        ``pin=False`` for a recording whose end this index will never hear of (a peer
        gateway's, a snapshot's): its blocks go straight into the LRU. Pinned, it may be
        deferred (see "Deferred recording"); ``held``: the worker's match of these
        blocks as the decision saw it (deferred, the marks start there at the latest)."""
        if not block_hashes:
            return
        t = self._clock() if now is None else now
        if pin and self._schedule is not None:
            state = self._state(worker_id)
            if state.max_sequences is None:
                self._mark(state, block_hashes, held)
                pending = self._pending
                pending.append((block_hashes, worker_id, t))
                if len(pending) == 1:
                    self._schedule()
                elif len(pending) > _MAX_PENDING:
                    self._record(*pending.popleft(), True)
                return
        if self._pending:
            self.flush()
        self._record(block_hashes, worker_id, t, pin)

    def _mark(self, state: _WorkerBlocks, block_hashes: Sequence[int], held: int | None) -> None:
        """A deferred recording's part on the request's path: the worker's holder bit
        on the blocks past its held prefix (prefix-closed: found by bisection), from
        ``held`` on if that is shorter (a correction's gap: see "Invariant", where the
        bisection may land past it while ``match`` stopped at it)."""
        holders, bit = self._holders, state.bit
        get = holders.get
        start = bisect_left(
            range(len(block_hashes)), True, key=lambda i: not get(block_hashes[i], 0) & bit
        )
        if held is not None and 0 <= held < start:
            start = held
        for h in block_hashes[start:]:
            holders[h] = get(h, 0) | bit

    def _record(self, block_hashes: Sequence[int], worker_id: str, t: float, pin: bool) -> None:
        state = self._state(worker_id)
        if state.host:
            self._load_back(state, block_hashes)
        lru, holders, bit = state.lru, self._holders, state.bit
        first_new: int | None = None
        if state.max_sequences is None and pin:
            # pinned until ``correct`` releases this recording (see "Pins"); deepest block
            # first, so the chain's first new block is the shallowest
            pins = state.pins
            for h in reversed(block_hashes):
                c = pins.get(h)
                if c is not None:
                    pins[h] = c + 1
                    continue
                if lru.pop(h, None) is None:
                    holders[h] = holders.get(h, 0) | bit
                    first_new = h
                pins[h] = 1
            self._seq += 1
            state.inflight[self._seq] = (block_hashes, t)
            state.inflight_by_leaf.setdefault(block_hashes[-1], []).append(self._seq)
            self._expire_pins(state, t)
        else:
            # Deepest block first, so block 0 ends up the most recently used; a touch
            # moves a block to the end (pop, then insert). A block pinned by an in-flight
            # recording stays pinned (it joins the LRU at its release): put in the LRU
            # too, its eviction would clear its holder bit while the pin kept it, and no
            # later recording would set the bit again (a re-homing's pin=False recording
            # of a shared system prompt lost it on every home: issue 20).
            pins = state.pins
            for h in reversed(block_hashes):
                if h in pins:
                    continue
                if lru.pop(h, None) is None:
                    holders[h] = holders.get(h, 0) | bit
                    first_new = h
                lru[h] = t
        if first_new is not None:
            # where this prompt starts adding to the worker: a sibling routed there while
            # this one is still in prefill will report a cache miss from here on
            state.fresh[first_new] = t
            state.fresh.move_to_end(first_new)
        self._prune_fresh(state, t)
        if state.max_sequences is not None:
            self._hold_sequence(state, tuple(block_hashes), state.max_sequences)
        self._evict_over_capacity(state)

    def _hold_sequence(self, state: _WorkerBlocks, chain: tuple[int, ...], bound: int) -> None:
        """Track ``chain`` among the worker's held chains (see "Sequence bound")."""
        sequences, leaf = state.sequences, chain[-1]
        if leaf in sequences:
            sequences.move_to_end(leaf)
            return
        replaced, shared = None, 0
        for key, held in sequences.items():
            common = _common_prefix(held, chain)
            if common > shared:
                replaced, shared = key, common
        sequences[leaf] = chain
        if replaced is not None and shared > _REUSE_SHARE * len(chain):
            self._drop_sequence(state, replaced)
        while len(sequences) > bound:
            self._drop_sequence(state, next(iter(sequences)))

    def _slot_taken(self, state: _WorkerBlocks, leaf: int, bound: int) -> None:
        """A slot-bound worker missed a prompt believed held: it ran it in another slot
        (the believed one was busy with a sibling, or long gone), so with every slot
        believed in use the least recently used other chain is the one it overwrote."""
        if len(state.sequences) < bound:
            return  # it had an empty slot
        victim = next((k for k in state.sequences if k != leaf), None)
        if victim is not None:
            self._drop_sequence(state, victim)

    def _drop_sequence(self, state: _WorkerBlocks, leaf: int) -> None:
        """Forget one held chain's blocks beyond what the other held chains share."""
        chain = state.sequences.pop(leaf)
        keep = max((_common_prefix(chain, other) for other in state.sequences.values()), default=0)
        lru = state.lru
        for h in chain[keep:]:
            if lru.pop(h, None) is not None:
                state.fresh.pop(h, None)
                self._clear(h, state.bit)

    def _prune_fresh(self, state: _WorkerBlocks, now: float) -> None:
        fresh, horizon = state.fresh, now - self._grace_s
        while fresh and (len(fresh) > _MAX_FRESH or next(iter(fresh.values())) < horizon):
            fresh.popitem(last=False)

    def _evict_over_capacity(self, state: _WorkerBlocks) -> None:
        lru, pins, inflight = state.lru, state.pins, state.inflight
        # the engine cannot lock more than its pool: release the oldest recordings first
        while len(pins) > state.capacity and inflight:
            self._release(state, next(iter(inflight)), None)
        if state.host_capacity and state.max_sequences is None:
            self._demote(state, len(lru) + len(pins) - state.capacity)
        excess = len(lru) + len(pins) - state.capacity
        if excess > 0:  # the least recently used, in one pass from the front
            for h in list(islice(lru, excess)):
                del lru[h]
                self._clear(h, state.bit)

    def _release(self, state: _WorkerBlocks, seq: int, now: float | None) -> None:
        """Unpin one in-flight recording: its blocks held by no other in-flight recording
        join the LRU as most recently used, deepest first (as the engine touches the whole
        path when the request finishes); ``now`` None keeps its recording time."""
        chain, t = state.inflight.pop(seq)
        seqs = state.inflight_by_leaf[chain[-1]]
        seqs.remove(seq)
        if not seqs:
            del state.inflight_by_leaf[chain[-1]]
        t = t if now is None else now
        lru, pins = state.lru, state.pins
        for h in reversed(chain):
            c = pins.get(h)
            if c is None:
                continue
            if c > 1:
                pins[h] = c - 1
            else:
                del pins[h]
                lru[h] = t

    def _expire_pins(self, state: _WorkerBlocks, now: float) -> None:
        inflight, horizon = state.inflight, now - self._pin_ttl_s
        while inflight and (
            len(inflight) > _MAX_INFLIGHT or next(iter(inflight.values()))[1] < horizon
        ):
            self._release(state, next(iter(inflight)), None)

    def _clear(self, h: int, bit: int) -> None:
        mask = self._holders.get(h, 0) & ~bit
        if mask:
            self._holders[h] = mask
        else:
            self._holders.pop(h, None)

    # --- host tier (see "Host tier") -------------------------------------------------

    def set_host_capacity(self, worker_id: str, host_tokens: int | None) -> None:
        """The worker's host-only tier in tokens (HiCache: what its host pool keeps beyond
        copies of GPU blocks); None or 0: no host tier, its host blocks forgotten.
        Shrinking drops the first demoted blocks at once."""
        if self._pending:
            self.flush()
        if host_tokens is not None and host_tokens < 0:
            raise ValueError("host_tokens must be >= 0")
        state = self._state(worker_id)
        state.host_tokens = host_tokens or None
        self._resize_host(state)

    def _resize_host(self, state: _WorkerBlocks) -> None:
        tokens = state.host_tokens
        state.host_capacity = self._cap(math.ceil(tokens / state.block_tokens)) if tokens else 0
        self._drop_host_excess(state)
        if state.host_capacity:
            self._tiered.add(self._names[state.bit])
        else:
            self._tiered.discard(self._names[state.bit])

    def tiered(self) -> Collection[str]:
        """The workers with a host tier (``set_host_capacity``): the only ones whose
        matches :meth:`device_blocks` can split. Read-only."""
        return self._tiered

    def _demote(self, state: _WorkerBlocks, excess: int) -> None:
        """Move the device LRU's ``excess`` least recently used blocks to the host tier
        (the engine's device eviction of backed-up leaves), then bound the host tier."""
        if excess <= 0:
            return
        lru, host = state.lru, state.host
        for h in list(islice(lru, excess)):
            host[h] = lru.pop(h)
        self._drop_host_excess(state)

    def _drop_host_excess(self, state: _WorkerBlocks) -> None:
        host = state.host
        excess = len(host) - state.host_capacity
        if excess > 0:  # the first demoted go first (the engine's host LRU)
            for h in list(islice(host, excess)):
                del host[h]
                state.fresh.pop(h, None)
                self._clear(h, state.bit)

    def _load_back(self, state: _WorkerBlocks, block_hashes: Sequence[int]) -> None:
        """A recording touches host blocks: the engine loads them back to the GPU, so they
        rejoin the device LRU (the recording then touches or pins them as its own)."""
        host, lru = state.host, state.lru
        for h in block_hashes:
            t = host.pop(h, None)
            if t is not None:
                lru[h] = t

    def _drop_host(self, state: _WorkerBlocks, block_hashes: Sequence[int]) -> None:
        host = state.host
        for h in block_hashes:
            if host.pop(h, None) is not None:
                state.fresh.pop(h, None)
                self._clear(h, state.bit)

    def _drop_idle_host(self, state: _WorkerBlocks, horizon: float) -> int:
        host = state.host
        idle = [h for h, t in takewhile(lambda item: item[1] < horizon, host.items())]
        for h in idle:
            del host[h]
            state.fresh.pop(h, None)
            self._clear(h, state.bit)
        return len(idle)

    def device_blocks(self, worker_id: str, block_hashes: Sequence[int], matched: int) -> int:
        """Of the worker's ``matched`` leading blocks of ``block_hashes`` (``match``'s
        answer), how many are believed on its GPU; the rest are on its host tier. The
        device part is prefix-closed (see "Host tier"): O(log matched) lookups. Waiting
        recordings are done first only for a worker with a host tier (nothing else's
        answer can they change)."""
        state = self._workers.get(worker_id)
        matched = max(0, min(matched, len(block_hashes)))
        if state is None or not state.host_capacity or matched == 0:
            return matched
        if self._pending:
            self.flush()
        if not state.host:
            return matched
        host = state.host
        return bisect_left(range(matched), True, key=lambda i: block_hashes[i] in host)

    def observe_tiers(
        self,
        worker_id: str,
        predicted_device_blocks: int,
        predicted_host_blocks: int,
        reported_device_tokens: int,
        reported_host_tokens: int,
    ) -> None:
        """A worker's ``cached_tokens_details`` against the tiers predicted for the same
        request: its device part shorter than believed while the host supplied the rest
        means its GPU holds fewer of the recorded prompts than the index's device bound
        (the share shrinks by ``_SHARE_STEP``); longer than believed while a host part was
        predicted, that it holds more (the share grows, up to 1). Workers with no host
        tier are left alone (their ``cached_tokens`` already correct the index)."""
        if self._pending:
            self.flush()
        state = self._workers.get(worker_id)
        if state is None or not state.host_capacity or state.capacity_tokens is None:
            return
        tol, bt = self._tolerance, state.block_tokens
        reported_device = reported_device_tokens / bt
        share, believed = state.device_share, predicted_device_blocks
        if reported_host_tokens > 0 and reported_device < believed * (1 - tol) - 1:
            share = max(_MIN_DEVICE_SHARE, share * (1.0 - _SHARE_STEP))
        elif predicted_host_blocks > 0 and reported_device > believed * (1 + tol) + 1:
            share = min(1.0, share * (1.0 + _SHARE_STEP))
        if share != state.device_share:
            state.device_share = share
            self._resize(state)

    def tiers(self, worker_id: str) -> tuple[int, int, float]:
        """(device blocks, host blocks, device share) believed for the worker."""
        if self._pending:
            self.flush()
        state = self._workers.get(worker_id)
        if state is None:
            return 0, 0, 1.0
        return len(state.lru) + len(state.pins), len(state.host), state.device_share

    # --- forget / correct / evict ----------------------------------------------------

    def forget_worker(self, worker_id: str) -> None:
        if self._pending:
            self.flush()
        state = self._workers.pop(worker_id, None)
        if state is None:
            return
        self._tiered.discard(worker_id)
        for h in state.lru:
            self._clear(h, state.bit)
        for h in state.pins:
            self._clear(h, state.bit)
        for h in state.host:
            self._clear(h, state.bit)
        del self._names[state.bit]
        self._free_bits.append(state.bit)

    def release(
        self, worker_id: str, block_hashes: Sequence[int], now: float | None = None
    ) -> None:
        """The response for this recording ended without a cached-token report: unpin it
        (the engine unlocks the path) without correcting anything. Without this, such
        recordings stay pinned, and their block lists held, until the pin expires."""
        if self._pending:
            self.flush()
        state = self._workers.get(worker_id)
        if state is None or state.max_sequences is not None or not block_hashes:
            return
        seqs = state.inflight_by_leaf.get(block_hashes[-1])
        if seqs:
            self._release(state, seqs[0], self._clock() if now is None else now)

    def correct(
        self,
        worker_id: str,
        block_hashes: Sequence[int],
        predicted_blocks: int,
        reported_tokens: int,
        now: float | None = None,
    ) -> None:
        """Feed back the worker's reported ``cached_tokens`` for a prompt (see module)."""
        if self._pending:
            self.flush()
        state = self._workers.get(worker_id)
        if state is None:
            return
        predicted_blocks = max(0, min(predicted_blocks, len(block_hashes)))
        reported_tokens = max(0, reported_tokens)
        state.predicted_tokens += int(predicted_blocks * state.block_tokens)
        state.reported_tokens += reported_tokens
        if state.max_sequences is not None:
            real_blocks = reported_tokens / state.block_tokens * (1.0 + self._tolerance)
            if block_hashes and int(real_blocks) < predicted_blocks:
                self._slot_taken(state, block_hashes[-1], state.max_sequences)
            return  # it holds this prompt now (see "Sequence bound")
        t = self._clock() if now is None else now
        seqs = state.inflight_by_leaf.get(block_hashes[-1]) if block_hashes else None
        if seqs:  # the response is complete: the engine unlocks (and touches) its path
            self._release(state, seqs[0], t)
        real = reported_tokens / state.block_tokens
        keep = int(real * (1.0 + self._tolerance))
        if keep >= predicted_blocks:
            return
        if self._recently_extended(state, block_hashes, real, predicted_blocks, t):
            return  # a sibling recorded moments ago is still in prefill there
        if state.host:
            self._drop_host(state, block_hashes[keep:])
        lru = state.lru
        for h in block_hashes[keep:]:
            if lru.pop(h, None) is not None:
                state.fresh.pop(h, None)
                self._clear(h, state.bit)

    def _recently_extended(
        self, state: _WorkerBlocks, hashes: Sequence[int], real: float, limit: int, now: float
    ) -> bool:
        """Did a recording within the grace period start adding blocks where the real
        match ends (within the tolerance of the token estimate)?"""
        fresh = state.fresh
        if not fresh:
            return False
        lo = max(0, int(real * (1.0 - self._tolerance)) - 1)
        hi = min(limit, int(real * (1.0 + self._tolerance)) + 2)
        for h in hashes[lo:hi]:
            inserted = fresh.get(h)
            if inserted is not None and now - inserted < self._grace_s:
                return True
        return False

    def evict_idle(self, now: float, max_idle_s: float) -> int:
        """Drop blocks untouched for ``max_idle_s`` seconds; return how many were dropped."""
        if self._pending:
            self.flush()
        if max_idle_s <= 0 or math.isinf(max_idle_s):
            return 0
        horizon, dropped = now - max_idle_s, 0
        for state in self._workers.values():
            self._expire_pins(state, now)
            if state.host:
                dropped += self._drop_idle_host(state, horizon)
            lru = state.lru
            # from the front, up to the first block touched since the horizon
            idle = [h for h, _ in takewhile(lambda item: item[1] < horizon, lru.items())]
            for h in idle:
                del lru[h]
                state.fresh.pop(h, None)
                self._clear(h, state.bit)
            dropped += len(idle)
        return dropped

    # --- introspection ---------------------------------------------------------------

    def stats(self, worker_id: str) -> IndexStats:
        if self._pending:
            self.flush()
        state = self._workers.get(worker_id)
        if state is None:
            return IndexStats(0, 0, 0, 0)
        blocks = len(state.lru) + len(state.pins) + len(state.host)
        return IndexStats(
            blocks, blocks * APPROX_BYTES_PER_BLOCK, state.predicted_tokens, state.reported_tokens
        )

    def workers(self) -> list[str]:
        return list(self._workers)

    def blocks(self, worker_id: str) -> list[int]:
        """The worker's believed blocks, most recently used first (a snapshot for
        ``gateway.peers.state``: recording them in this order rebuilds the LRU)."""
        if self._pending:
            self.flush()
        state = self._workers.get(worker_id)
        if state is None:
            return []
        # pinned (in-flight) blocks first; reversed insertion puts a chain's root first
        return [*reversed(state.pins), *reversed(state.lru), *reversed(state.host)]

    def free_sequences(self, worker_id: str) -> int | None:
        """Chains the worker can still take without evicting one (None: no sequence bound)."""
        state = self._workers.get(worker_id)
        if state is None or state.max_sequences is None:
            return None
        return max(0, state.max_sequences - len(state.sequences))

    def held_sequences(self, worker_id: str) -> list[tuple[int, ...]] | None:
        """The prompt chains a sequence-bounded worker is believed to hold, least recently
        used first (None: no sequence bound)."""
        state = self._workers.get(worker_id)
        if state is None or state.max_sequences is None:
            return None
        return list(state.sequences.values())

    def capacity_blocks(self, worker_id: str) -> int:
        """The worker's LRU bound in blocks (the default for an unknown worker)."""
        state = self._workers.get(worker_id)
        return state.capacity if state is not None else self._cap(self._default_capacity)
