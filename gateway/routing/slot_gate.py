"""Holds a request for a slot-bound worker until the slot holding its prefix is free.

Why: an engine whose slots share no KV (llama.cpp: each slot keeps its own prompt, and
with its RAM prompt cache off nothing else) can reuse a prefix only from an *idle* slot
that holds it. A second request for that prefix sent while the first is still running
lands in another slot, computes the whole prefix again (on the same threads, slowing the
first), and evicts whatever that slot held, whose next request then misses too.
Measured on 4 llama.cpp workers x 2 slots with two concurrent clients (docs/REAL_ENGINE.md):
without the gate min_ttft's cached fraction was 0.48-0.57; with it see BENCHMARKS.md
("Real engine").

Rule, per request routed to a worker the prefix index bounds by sequences
(``held_sequences`` is not None): let ``busy`` be the longest prefix (in blocks) the
request shares with a request running there or waiting there ahead of it, and ``idle``
the longest it shares with a chain the index believes the worker holds and nobody runs.
When ``busy - idle`` is at least ``min_share`` of the request's blocks (llama.cpp reuses a
slot only above 10 % similarity) and at least one block, the request waits: it is handed
the slot when a request sharing its prefix finishes there (the oldest such waiter first,
so a burst of siblings is served one after the other from the warm slot), or it goes
ahead after ``max_wait_s`` (then it computes the prefix in another slot, as without the
gate). Other requests are never held. Waiting is bounded: the gate never adds more than
``max_wait_s`` to a request's time to first token, and a waiter's client disconnecting
removes it at once. Once the worker's prefill cost is calibrated (``seconds_per_block``,
from the gateway's cost model), the bound is also at most twice the estimated time to
compute the ``busy - idle`` blocks the wait would save: not waiting costs that prefill
and, on an engine whose slots share its threads, slows the holder by as much (and evicts
another slot's prompt). A fast engine with long generations (a GPU) thus holds a request
for milliseconds, not seconds; before calibration ``max_wait_s`` alone applies.

Workers bounded by blocks (SGLang's radix cache shares a prefix between running
requests) are never held here: ``held_sequences`` is None for them; the prefill gate
(``gateway.routing.prefill_gate``) holds their requests while a sibling's prefill runs.

Not thread-safe; one event loop.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class HeldChains(Protocol):
    """The prefix index's view of a slot-bound worker (``gateway.routing.prefix_index``)."""

    def held_sequences(self, worker_id: str) -> list[tuple[int, ...]] | None: ...


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place at a worker: running (admitted) or waiting."""

    worker_id: str
    chain: tuple[int, ...]
    waiting: asyncio.Future[None] | None = None  # set while held
    admitted: bool = False
    waited_s: float = 0.0
    max_wait_s: float = 0.0  # this request's bound
    need: int = 0  # blocks a finished chain must share with it to hand it the slot


@dataclass(slots=True)
class _Worker:
    running: list[Ticket] = field(default_factory=list)
    waiting: deque[Ticket] = field(default_factory=deque)


@dataclass(slots=True)
class GateStats:
    """Counters for telemetry: requests held, handed a slot, released by the bound."""

    held: int = 0
    handed: int = 0
    timed_out: int = 0
    waited_s: float = 0.0


_FREE = Ticket("", ())  # for requests the gate does not track


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading blocks two chains share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _uncalibrated(worker_id: str) -> float | None:
    return None


class Held(Protocol):
    """A place a gate may hold: :class:`Ticket` here, ``prefill_gate.Pass``."""

    waiting: asyncio.Future[None] | None
    max_wait_s: float
    waited_s: float


async def hold(place: Held, stats: GateStats, expire: Callable[[], object]) -> float:
    """Wait until ``place.waiting`` is done or ``place.max_wait_s`` passes (then
    ``expire()``); a cancel is never swallowed. Records and returns the seconds held (0
    for a place not held). Both gates' ``wait``."""
    future = place.waiting
    if future is None:
        return 0.0
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(place.max_wait_s):
            await asyncio.shield(future)
    except TimeoutError:
        expire()
    finally:
        place.waiting = None
        place.waited_s = loop.time() - start
        stats.waited_s += place.waited_s
    return place.waited_s


class SlotGate:
    def __init__(
        self,
        index: HeldChains,
        max_wait_s: float,
        min_share: float = 0.1,
        seconds_per_block: Callable[[str], float | None] = _uncalibrated,
    ) -> None:
        if max_wait_s < 0 or not 0 <= min_share <= 1:
            raise ValueError("max_wait_s must be >= 0 and min_share in [0, 1]")
        self._index = index
        self._max_wait_s = max_wait_s
        self._min_share = min_share
        self._seconds_per_block = seconds_per_block
        self._workers: dict[str, _Worker] = {}
        self.stats = GateStats()

    def enter(self, worker_id: str, chain: Sequence[int]) -> Ticket:
        """Take a place at ``worker_id`` for a prompt of blocks ``chain``; call before the
        prompt is recorded in the index, then ``await wait(ticket)``, and ``leave`` it when
        the request ends, whatever the path."""
        if self._max_wait_s <= 0 or not chain:
            return _FREE
        held = self._index.held_sequences(worker_id)
        if held is None:
            return _FREE
        state = self._workers.get(worker_id)
        if state is None:
            state = self._workers[worker_id] = _Worker()
        ticket = Ticket(worker_id, tuple(chain))
        ahead = (*state.running, *state.waiting)  # their chains are in no idle slot
        busy_leaves = {t.chain[-1] for t in ahead}
        busy = max((common_prefix(t.chain, ticket.chain) for t in ahead), default=0)
        idle = max(
            (common_prefix(c, ticket.chain) for c in held if c and c[-1] not in busy_leaves),
            default=0,
        )
        gain, least = busy - idle, max(1, math.ceil(self._min_share * len(ticket.chain)))
        if gain >= least:
            ticket.max_wait_s = self._bound(worker_id, gain)
            ticket.need = idle + least
        if ticket.max_wait_s > 0:
            ticket.waiting = asyncio.get_running_loop().create_future()
            state.waiting.append(ticket)
            self.stats.held += 1
        else:
            self._admit(state, ticket)
        return ticket

    async def wait(self, ticket: Ticket) -> float:
        """Until the ticket is handed its slot or ``max_wait_s`` passes; the seconds held."""
        return await hold(ticket, self.stats, lambda: self._expire(ticket))

    def _expire(self, ticket: Ticket) -> None:
        """``ticket``'s bound has passed: if still waiting, it takes another slot."""
        state = self._workers.get(ticket.worker_id)
        if not ticket.admitted and state is not None:
            state.waiting.remove(ticket)
            self._admit(state, ticket)
            self.stats.timed_out += 1

    def leave(self, ticket: Ticket) -> None:
        """The request is over (or never ran): free its place and hand it on."""
        if ticket is _FREE:
            return
        state = self._workers.get(ticket.worker_id)
        if state is None:
            return
        if not ticket.admitted:
            if ticket in state.waiting:
                state.waiting.remove(ticket)
        elif ticket in state.running:
            state.running.remove(ticket)
            self._hand_on(state, ticket.chain)
        if not state.running and not state.waiting:
            del self._workers[ticket.worker_id]

    def forget_worker(self, worker_id: str) -> None:
        """The worker is gone: its waiters go ahead (their attempt will fail over)."""
        state = self._workers.pop(worker_id, None)
        if state is None:
            return
        for t in state.waiting:
            t.admitted = True
            if t.waiting is not None and not t.waiting.done():
                t.waiting.set_result(None)

    def waiting(self, worker_id: str) -> int:
        state = self._workers.get(worker_id)
        return 0 if state is None else len(state.waiting)

    def _bound(self, worker_id: str, gain_blocks: int) -> float:
        per_block = self._seconds_per_block(worker_id)
        if per_block is None:
            return self._max_wait_s
        return min(self._max_wait_s, 2.0 * per_block * gain_blocks)

    def _admit(self, state: _Worker, ticket: Ticket) -> None:
        ticket.admitted = True
        state.running.append(ticket)

    def _hand_on(self, state: _Worker, chain: tuple[int, ...]) -> None:
        """Hand the slot that held ``chain`` to the oldest waiter sharing the longest
        prefix with it, among those for which it holds enough (``need``): a request that
        merely opens with the same words frees no slot worth waiting for."""
        best, shared = None, 0
        for t in state.waiting:
            common = common_prefix(t.chain, chain)
            if common > shared and common >= t.need:
                best, shared = t, common
        if best is None:
            return
        state.waiting.remove(best)
        self._admit(state, best)
        self.stats.handed += 1
        if best.waiting is not None and not best.waiting.done():
            best.waiting.set_result(None)
