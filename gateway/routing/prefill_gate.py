"""Holds a request for an SGLang worker until a sibling's prefill has cached their prefix.

Why: SGLang's radix cache shares a prefix between requests only once it holds it, and it
inserts a prompt there when that prompt's prefill has run. Its default scheduler
(``fcfs``) does not de-duplicate prefixes within one prefill batch (only ``lpm`` does:
docs SGLANG_API.md §5.3), so requests sharing a prompt that reach a worker within one
scheduler step are prefilled together, each computing the whole prefix. GRPO rollouts
send n = 8 requests sharing one prompt at once: routed whole to one worker by
``min_ttft``, the workers still reported 13,656 cached of 82,880 prompt tokens
(BENCHMARKS.md, "After issue 22's ``min_ttft`` changes", "Live check").

Rule, per request routed to a radix-cache worker (the prefix index does not bound it by
sequences: ``held_sequences`` is None; the router offers only SGLang workers): let
``busy`` be the longest prefix (in blocks) it shares with a request *in prefill* there
(dispatched by this gate, no first byte yet) or waiting there ahead of it, and ``held``
the blocks of it the worker holds idle. The request waits until that sibling's first
byte (SGLang has then cached its prompt), and goes then, as a hit, when waiting is worth
it:
- ``busy - held`` is at least ``min_share`` of the request's blocks and at least one block;
- it is at least half of what that sibling computes (its blocks not held): the wait lasts
  about that prefill, so a request sharing only a short instruction with another group's
  first goes at once (waiting, it would have cost the group behind it a round trip);
- the prefill queued on the worker (the blocks not held of the requests there in prefill)
  is within one batch (``batch_blocks``: SGLang's ``max_prefill_tokens``, 16,384 by
  default). Sent at once, the request would then be prefilled in the sibling's batch; behind
  more, it would be prefilled in a later batch, after its sibling's prompt is cached, and
  hit without waiting, while held it would go behind everything sent meanwhile. (A burst
  of 600 shared-prefix requests held 496 until their 2 s bound, one leader per group at the
  head of each queue, and lost a third of the hits: BENCHMARKS.md, "Prefill gate".)
Requests sharing nothing with a request in prefill or waiting are never held.

``held``: the index records a prompt at dispatch, so its match on the chosen worker
(``held_blocks``, taken before this request is recorded) counts the blocks of requests
still in prefill or waiting as held. When that match does not reach beyond ``busy``, ``held`` is
instead what the sharing requests found held at their own dispatch (each pass keeps it,
raised at every first byte of a request sharing its prefix), capped by the match; a
request that entered behind more than a batch is not compared with the others (no wait is
worth it then: this keeps a burst's bookkeeping O(1) per request) and does not count here.

Order and bounds:
- At a first byte, the waiters are re-examined oldest first: a waiter goes when waiting
  for the requests now in prefill (the ones just released included) and the waiters
  staying ahead of it is no longer worth it (as above), so at most one request per prefix
  leads at a time: identical siblings all go at their
  first's first byte; two waiters sharing more with each other than with the finished
  one go one after the other.
- A request in prefill that ends without a first byte (failed, client gone) releases its
  waiters the same way (the oldest then leads, its prompt was not cached).
- A waiter never waits beyond ``max_wait_s`` and, once the worker's prefill cost is
  calibrated (``prefill_s``: the gateway's cost model), beyond the estimated time to
  prefill the ``busy - held`` blocks the wait saves there now, behind the prefill queued
  on the worker (its sibling's among it): what sending it at once would cost it. Held
  longer, it would start later than computing the prefix itself. After the bound it goes
  ahead (it then computes the prefix, as without the gate). A sibling's first byte
  normally comes well before: sent at once it would be prefilled in the same queue.
- A waiter whose client disconnects is removed at once (``leave``; the router's
  ``finally``).

Synchronous callers (the offline replay, on a virtual clock: ``futures=False``): ``enter``
makes no future, ``Pass.held_back`` says whether the request waits, ``first_byte``,
``leave`` and ``forget_worker`` return the waiters they let go (the caller sends them), and
the caller calls ``expire`` once ``Pass.max_wait_s`` has passed since ``enter``. The router
awaits ``wait`` instead, which calls ``expire`` at the bound; the rule is the same code.
``prefill_seconds`` is the bound's estimate from the gateway's cost model.

Not thread-safe; one event loop.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.routing.cost_model import CostModel
from gateway.routing.slot_gate import GateStats, HeldChains, common_prefix, hold

_WAITING = 0
_PREFILL = 1
_DONE = 2


@dataclass(eq=False, slots=True)
class Pass:
    """One request's place at a worker: waiting, in prefill, or done (first byte, or
    ended)."""

    worker_id: str
    chain: tuple[int, ...]
    held: int  # blocks of ``chain`` the worker holds idle (raised at siblings' first bytes)
    phase: int = _PREFILL
    waiting: asyncio.Future[None] | None = None  # set while held
    max_wait_s: float = 0.0  # this request's bound
    waited_s: float = 0.0
    # False: entered behind over a batch, not compared with the requests there, so its
    # ``held`` is the index's match, which may count blocks only they brought
    compared: bool = True

    @property
    def held_back(self) -> bool:
        """Waiting for a sibling's first byte (not yet let go, bound not passed)."""
        return self.phase == _WAITING


@dataclass(slots=True)
class _Worker:
    prefill: dict[Pass, None] = field(default_factory=dict)  # in dispatch order
    waiting: deque[Pass] = field(default_factory=deque)
    queued: int = 0  # blocks not held of the requests in prefill

    def add(self, p: Pass) -> None:
        self.prefill[p] = None
        self.queued += len(p.chain) - p.held

    def drop(self, p: Pass) -> None:
        del self.prefill[p]
        self.queued -= len(p.chain) - p.held


_FREE = Pass("", (), 0, _DONE)  # for requests the gate does not track


def _uncalibrated(worker_id: str, blocks: int) -> float | None:
    return None


BATCH_TOKENS = 16384  # SGLang's default max_prefill_tokens: one prefill batch at most


def _one_batch(worker_id: str) -> int:
    return BATCH_TOKENS // 64  # blocks of 64 tokens, when the caller does not say


def batch_blocks(block_tokens: float) -> int:
    """One SGLang prefill batch's tokens (max_prefill_tokens' default), in blocks."""
    return max(1, int(BATCH_TOKENS / block_tokens))


def prefill_seconds(
    costs: CostModel, worker_id: str, tokens: float, queued_tokens: float
) -> float | None:
    """The cost model's time to prefill ``tokens`` more tokens on ``worker_id`` behind
    ``queued_tokens`` of queued prefill (fixed + per token + attention term); None before
    calibration."""
    if not costs.calibrated(worker_id):
        return None
    cost = costs.cost(worker_id)
    return (
        (cost.prefill_fixed_s or 0.0)
        + (cost.prefill_per_token_s or 0.0) * (tokens + queued_tokens)
        + (cost.prefill_pair_s or 0.0) * tokens * tokens / 2
    )


class PrefillGate:
    def __init__(
        self,
        index: HeldChains,
        max_wait_s: float,
        min_share: float = 0.1,
        prefill_s: Callable[[str, int], float | None] = _uncalibrated,
        batch_blocks: Callable[[str], int] = _one_batch,
        futures: bool = True,
    ) -> None:
        """``prefill_s(worker, blocks)``: the estimated seconds to prefill that many more
        blocks there now, its queue included; None before calibration.
        ``batch_blocks(worker)``: the blocks one prefill batch there takes at most.
        ``futures=False``: a synchronous caller (module docstring), no event loop needed."""
        if max_wait_s < 0 or not 0 <= min_share <= 1:
            raise ValueError("max_wait_s must be >= 0 and min_share in [0, 1]")
        self._index = index
        self._max_wait_s = max_wait_s
        self._min_share = min_share
        self._prefill_s = prefill_s
        self._batch_blocks = batch_blocks
        self._futures = futures
        self._workers: dict[str, _Worker] = {}
        self.stats = GateStats()  # handed: released at a sibling's first byte or end

    def enter(self, worker_id: str, chain: Sequence[int], held_blocks: int) -> Pass:
        """Take a place at ``worker_id`` for a prompt of blocks ``chain``, of which the
        index matched ``held_blocks`` there; call before the prompt is recorded in the
        index, then ``await wait(p)``, call ``first_byte(p)`` at the worker's first byte
        and ``leave(p)`` when the request ends, whatever the path."""
        if self._max_wait_s <= 0 or not chain:
            return _FREE
        if self._index.held_sequences(worker_id) is not None:
            return _FREE  # slot-bound: the slot gate's
        state = self._workers.get(worker_id)
        if state is None:
            state = self._workers[worker_id] = _Worker()
        p = Pass(worker_id, tuple(chain), held_blocks)
        # over a batch queued, no wait is worth it (``_worth``): no need to look
        if state.queued > self._batch_blocks(worker_id):
            sharers = []
            p.compared = False
        else:  # the index counts waiters' blocks too
            ahead = (*state.prefill, *state.waiting)
            sharers = [(c, t) for t in ahead if (c := common_prefix(t.chain, p.chain))]
        if sharers:
            busy, lead = max(sharers, key=lambda s: s[0])
            if held_blocks <= busy:  # the match may count blocks only they brought
                p.held = min(
                    held_blocks, max((min(c, t.held) for c, t in sharers if t.compared), default=0)
                )
            gain = busy - p.held
            if self._worth(state, p, busy, lead, worker_id):
                p.max_wait_s = self._bound(worker_id, gain)
        if p.max_wait_s > 0:
            p.phase = _WAITING
            if self._futures:
                p.waiting = asyncio.get_running_loop().create_future()
            state.waiting.append(p)
            self.stats.held += 1
        else:
            state.add(p)
        return p

    async def wait(self, p: Pass) -> float:
        """Until a sibling's first byte lets ``p`` go, or its bound passes; the seconds
        held."""
        return await hold(p, self.stats, lambda: self.expire(p))

    def expire(self, p: Pass) -> bool:
        """``p``'s bound has passed: if still waiting, it goes ahead (True)."""
        state = self._workers.get(p.worker_id)
        if p.phase != _WAITING or state is None:
            return False
        state.waiting.remove(p)
        self._go(state, p)
        self.stats.timed_out += 1
        return True

    def first_byte(self, p: Pass) -> list[Pass]:
        """The worker's first byte for ``p``: its prompt is in the radix cache now. The
        waiters it lets go."""
        if p.phase != _PREFILL:
            return []
        state = self._workers.get(p.worker_id)
        p.phase = _DONE
        if state is None:
            return []
        state.drop(p)
        chain = p.chain
        for t in state.prefill:  # a sharer beyond what it holds shares its next block
            if t.held < len(chain) and t.held < len(t.chain) and t.chain[t.held] == chain[t.held]:
                more = common_prefix(t.chain, chain) - t.held
                if more > 0:
                    t.held += more
                    state.queued -= more
        for t in state.waiting:
            t.held = max(t.held, common_prefix(t.chain, chain))
        released = self._release(state)
        self._drop_if_idle(p.worker_id, state)
        return released

    def leave(self, p: Pass) -> list[Pass]:
        """The request is over (or never ran): free its place, release its waiters (the
        ones let go are returned)."""
        if p.phase == _DONE:
            return []
        phase, p.phase = p.phase, _DONE
        state = self._workers.get(p.worker_id)
        if state is None:
            return []
        released: list[Pass] = []
        if phase == _WAITING:
            if p in state.waiting:
                state.waiting.remove(p)
        elif p in state.prefill:  # ended before its first byte: nothing was cached
            state.drop(p)
            released = self._release(state)
        self._drop_if_idle(p.worker_id, state)
        return released

    def forget_worker(self, worker_id: str) -> list[Pass]:
        """The worker is gone: its waiters go ahead (their attempt will fail over); the
        waiters let go are returned."""
        state = self._workers.pop(worker_id, None)
        if state is None:
            return []
        released = list(state.waiting)
        for t in (*state.prefill, *state.waiting):
            t.phase = _DONE
            if t.waiting is not None and not t.waiting.done():
                t.waiting.set_result(None)
        return released

    def waiting(self, worker_id: str) -> int:
        state = self._workers.get(worker_id)
        return 0 if state is None else len(state.waiting)

    def in_prefill(self, worker_id: str) -> int:
        state = self._workers.get(worker_id)
        return 0 if state is None else len(state.prefill)

    def _least(self, p: Pass) -> int:
        return max(1, math.ceil(self._min_share * len(p.chain)))

    def _worth(self, state: _Worker, p: Pass, busy: int, lead: Pass, worker_id: str) -> bool:
        """Whether ``p`` gains by waiting for ``lead`` (its longest sharer, ``busy``
        blocks in common): it saves at least ``min_share`` of its prompt, at least half of
        what ``lead`` computes (the wait lasts about ``lead``'s prefill), and the worker's
        queued prefill is within one batch (sent now, ``p`` would be prefilled with
        ``lead``; behind more, it would be prefilled after ``lead`` and hit anyway)."""
        gain = busy - p.held
        if gain < self._least(p) or 2 * gain < len(lead.chain) - lead.held:
            return False
        return state.queued <= self._batch_blocks(worker_id)

    def _bound(self, worker_id: str, gain_blocks: int) -> float:
        estimate = self._prefill_s(worker_id, gain_blocks)
        if estimate is None:
            return self._max_wait_s
        return min(self._max_wait_s, estimate)

    def _release(self, state: _Worker) -> list[Pass]:
        """Waiters, oldest first, that no request in prefill or still waiting ahead of
        them holds back any longer go; those returned."""
        stay: list[Pass] = []
        released: list[Pass] = []
        for w in list(state.waiting):
            busy, lead = max(
                ((common_prefix(t.chain, w.chain), t) for t in (*state.prefill, *stay)),
                key=lambda s: s[0],
                default=(0, w),
            )
            if self._worth(state, w, busy, lead, w.worker_id):
                stay.append(w)  # another request leads its prefix: it waits for that one
                continue
            state.waiting.remove(w)
            self._go(state, w)
            self.stats.handed += 1
            released.append(w)
            if w.waiting is not None and not w.waiting.done():
                w.waiting.set_result(None)
        return released

    def _go(self, state: _Worker, p: Pass) -> None:
        p.phase = _PREFILL
        state.add(p)

    def _drop_if_idle(self, worker_id: str, state: _Worker) -> None:
        if not state.prefill and not state.waiting and self._workers.get(worker_id) is state:
            del self._workers[worker_id]
