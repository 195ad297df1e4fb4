"""The replay's discrete-event loop: N simulated workers behind the gateway's own routing core.

One virtual clock, one heap of events (worker step completions; arrivals are merged in
from the sorted workload). Per request, the live router's decision phases, called from
the one place they are written (``gateway.routing.decide.RoutingCore``): views built from
the counters ``gateway.routing.lease.Lease`` keeps (in flight, uncached prompt tokens
queued until the first token, decoding requests), the prefix match from
``gateway.routing.prefix_index.PrefixIndex``, the policy object's ``select``, ``record``
at dispatch and, at the end of the response (as the live router, which reads
``cached_tokens`` from the final usage chunk), the feedback with the worker's reported
cached tokens and the TTFT; the lease moves to decoding at the first token. Engine load
(``/v1/loads``) is polled every ``engine_load_interval_s`` as the gateway's poller does.
The worker model is the simulator's, unchanged, driven through
:class:`~loadtests.replay.workers.SimWorker`. What the replay does not model: transport
failures, retries and outlier ejection (every worker answers) and the slot gate's waits.

Prefill gate (``prefill_wait_s`` > 0, the live default 2 s): the gateway's own
:class:`~gateway.routing.prefill_gate.PrefillGate` (synchronous entry points), entered
before ``dispatch`` for a request the policy routes by its match, as ``Router._attempt``
does; a held request is recorded in the index and counted in flight at once (live, the
lease is taken before the wait) but reaches its simulated worker only when the gate lets it
go at a sibling's first token (or an end without one) in virtual time, or at its bound (a
timer event). The request's TTFT in the records counts from its arrival (as its client
sees it); the cost model's observation counts from its dispatch to the worker, as the
live router's ``sent_at``. Not in the LoRA and PD replays (their own dispatch paths).

Exact mode (``exact``, :class:`~loadtests.replay.exact.ReplayExact`): the workers record
their KV events; after each step its batch is handed to the gateway's own event consumer,
applied a modelled delay after the step ends, and every decision gets the exact matches
of the workers in exact mode (as ``gateway.routing.router`` passes its ``ExactRequest``
to the core's ``choose``, ``dispatch`` and ``feedback``).

Cache tiers (HiCache workers, issue 20): the index is told each worker's host-only tier
(``host_tokens``, as the live gateway reads it from ``/server_info``) and the core reads
it (``RoutingCore.tiers``); the workers' reports carry ``cached_tokens_details``
(``tier_reports``), as ``/generate``'s ``meta_info`` does on a HiCache worker.

Events at the same instant: KV-event batches, then step completions, then arrivals (a token
produced at ``t`` is seen by a request arriving at ``t``), ties in insertion order: the run
is deterministic given the workload, the policy's rng seed and the model.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.forward.relay import CachedTiers
from gateway.routing.cost_model import CostModel
from gateway.routing.decide import Choice, ExactRequest, RoutingCore, Shortlist
from gateway.routing.lease import Lease
from gateway.routing.prefill_gate import Pass, PrefillGate, batch_blocks, prefill_seconds
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import RouteRequest
from gateway.routing.tokens import TokenAccounting
from gateway.workers.registry import Worker
from loadtests.replay.exact import ReplayExact
from loadtests.replay.metrics import BusyInterval, RequestRecord
from loadtests.replay.workers import SimOutput, SimWorker
from loadtests.workloads.base import WorkloadRequest
from policies.base import Policy

FIRST_PORT = 18001
INDEX_SWEEP_S = 60.0  # the gateway's eviction_interval_s
INDEX_MAX_IDLE_S = 3600.0  # the gateway's max_idle_s


@dataclass(slots=True)
class Prepared:
    """One request as the gateway sees it and as the worker model receives it."""

    route: RouteRequest
    prompt_key: bytes  # token ids, 4 bytes each (simulator.model.radix_cache.encode_tokens)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_key) // 4


Prepare = Callable[[WorkloadRequest], Prepared]


@dataclass(slots=True)
class _InFlight:
    record: RequestRecord
    route: RouteRequest
    lease: Lease
    choice: Choice
    exact: ExactRequest | None
    sent_s: float | None = None  # dispatched after its arrival (a LoRA load first): then
    place: Pass | None = None  # its place in the prefill gate (gated requests)


@dataclass(frozen=True, slots=True)
class _Send:
    """What reaches the worker model, kept while the prefill gate holds the request."""

    rid: str
    k: int
    prompt_key: bytes
    max_tokens: int


@dataclass(frozen=True, slots=True)
class _Outcome:
    """A complete response as the routing core's feedback reads it (every worker of the
    replay answers 200 and reports its cached tokens)."""

    ttft_s: float | None
    cached_tokens: int | None
    prompt_tokens: int | None
    status: int = 200
    cached_tiers: CachedTiers | None = None  # cached_tokens_details, when reported


@dataclass(slots=True)
class SimOutcome:
    records: list[RequestRecord]
    intervals: list[BusyInterval]
    timelines: dict[str, list[tuple[float, int, float]]]
    worker_ids: list[str]


@dataclass(slots=True)
class _Timeline:
    every_s: float
    points: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)

    def sample(self, wid: str, now: float, sim: SimWorker) -> None:
        if now - self.last.get(wid, -math.inf) >= self.every_s:
            self.last[wid] = now
            self.points.setdefault(wid, []).append((now, sim.queue_length(), sim.occupancy()))


class Simulation:
    """N workers, the gateway's index / cost model / lease counters, and one policy."""

    def __init__(
        self,
        policy: Policy,
        workers: Sequence[SimWorker],
        capacity_tokens: int,
        prepare: Prepare,
        seed: int = 0,
        timeline_every_s: float = 1.0,
        engine_load_interval_s: float = 1.0,
        exact: Callable[[Sequence[str], Callable[[], float]], ReplayExact] | None = None,
        host_tokens: int | None = None,
        tier_reports: bool = False,
        prefill_wait_s: float = 2.0,
        shortlist_above: int = 64,
    ) -> None:
        """``exact``: builds the exact-mode consumer from the worker ids and the clock
        (None: approximate only, as a gateway without KV events). ``host_tokens``: each
        worker's host-only tier as the gateway believes it (None: none); ``tier_reports``:
        the workers report ``cached_tokens_details`` (they run HiCache).
        ``prefill_wait_s``: the prefill gate's bound (``prefix_index.prefill_wait_s``; 0:
        no gate). ``shortlist_above``: the routing core's candidate shortlist above this many
        workers (``policy.shortlist_above``; 0: never)."""
        self.policy = policy
        self.sims = list(workers)
        self.gw = [Worker(f"http://127.0.0.1:{FIRST_PORT + i}", 0.0) for i in range(len(workers))]
        self.index = PrefixIndex(block_tokens=16.0, max_blocks_per_worker=67_108_864 // 64)
        self.costs = CostModel()
        for w in self.gw:
            w.flags.clear()
            w.metadata.capacity_tokens = capacity_tokens
            self.index.set_capacity(w.id, capacity_tokens)
        self.prepare = prepare
        self.rng = random.Random(seed)
        # characters per token learnt from the workers' prompt_tokens, as live
        self.tokens = TokenAccounting(on_worker_ratio=self.index.set_block_tokens)
        self.core = RoutingCore(policy, self.index, self.costs, self.rng, self.tokens)
        self.core.tiers = self.index  # as the live gateway's composition root sets it
        self.core.shortlist = Shortlist(above=shortlist_above)
        if host_tokens:
            for w in self.gw:
                self.index.set_host_capacity(w.id, host_tokens)
        self._tier_reports = tier_reports
        self.timeline = _Timeline(timeline_every_s)
        self._events: list[tuple[float, int, int]] = []  # (time, seq, worker index)
        self._pending: dict[int, tuple[float, list[SimOutput]]] = {}
        self._busy: list[bool] = [False] * len(workers)
        self._seq = 0
        self._live: dict[str, _InFlight] = {}
        self.records: list[RequestRecord] = []
        self.reasons: list[str] = []  # each decision's reason, in arrival order
        self.intervals: list[BusyInterval] = []
        self.rejected = 0
        self._poll_s = engine_load_interval_s
        self._polled = [-math.inf] * len(workers)
        self.now = 0.0
        self.exact = exact([w.id for w in self.gw], lambda: self.now) if exact else None
        self.gate = PrefillGate(
            self.index,
            prefill_wait_s,
            prefill_s=self._prefill_s,
            batch_blocks=lambda wid: batch_blocks(self.index.block_tokens(wid)),
            futures=False,
        )
        self._held: dict[Pass, tuple[_InFlight, _Send]] = {}
        self._timers: list[tuple[float, int, Pass]] = []  # (bound, seq, held place)

    def _prefill_s(self, worker_id: str, blocks: int) -> float | None:
        """The gate's bound, as the live gateway's composition root estimates it."""
        worker = next((w for w in self.gw if w.id == worker_id), None)  # joins append
        queued = 0 if worker is None else worker.queued_prefill_tokens
        tokens = int(blocks * self.index.block_tokens(worker_id))
        return prefill_seconds(self.costs, worker_id, tokens, queued)

    def gate_figures(self) -> dict[str, float]:
        """The prefill gate's counts: held, released at a sibling's first token (or end),
        timed out at the bound, and the seconds held in all."""
        st = self.gate.stats
        return {"held": st.held, "released": st.handed, "timed_out": st.timed_out,
                "waited_s": st.waited_s}  # fmt: skip

    def run(self, requests: Sequence[WorkloadRequest]) -> SimOutcome:
        next_sweep = INDEX_SWEEP_S
        for req in requests:
            self._advance(req.arrival_s)
            while next_sweep <= req.arrival_s:
                self.index.evict_idle(next_sweep, INDEX_MAX_IDLE_S)
                next_sweep += INDEX_SWEEP_S
            self._arrive(req)
        self._advance(math.inf)
        return SimOutcome(self.records, self.intervals, self.timeline.points,
                          [w.id for w in self.gw])  # fmt: skip

    # --- events ---------------------------------------------------------------------

    def _advance(self, until: float) -> None:
        """Process every KV-event batch and step completion at or before ``until``."""
        exact = self.exact
        while True:
            step_at = self._events[0][0] if self._events else math.inf
            timer_at = self._timers[0][0] if self._timers else math.inf
            if min(step_at, timer_at) > until or not (self._events or self._timers):
                break
            if timer_at < step_at:  # a held request's bound (after a step at the same instant)
                _, _, place = heapq.heappop(self._timers)
                if exact is not None:
                    exact.deliver(timer_at)
                self.now = timer_at
                if place in self._held and self.gate.expire(place):
                    self._send(*self._held.pop(place), timer_at)
                continue
            now, _, k = heapq.heappop(self._events)
            if exact is not None:
                exact.deliver(now)
            self.now = now
            _, outputs = self._pending.pop(k)
            for out in outputs:
                self._deliver(out, now)
            self._busy[k] = False
            self._start_step(k, now)
        if exact is not None:
            exact.deliver(until)

    def _start_step(self, k: int, now: float) -> None:
        if self._busy[k]:
            return
        result = self.sims[k].step(now)
        self.timeline.sample(self.gw[k].id, now, self.sims[k])
        if result is None:
            return
        duration, outputs = result
        if self.exact is not None:
            batch = self.sims[k].kv_batch(now + duration)
            if batch is not None:
                self.exact.publish(self.gw[k].id, batch, now + duration)
        self._busy[k] = True
        self._pending[k] = (duration, outputs)
        self.intervals.append(BusyInterval(self.gw[k].id, now, duration))
        self._seq += 1
        heapq.heappush(self._events, (now + duration, self._seq, k))

    def routable(self) -> list[Worker]:
        """The candidates: every worker not flagged (a drain flags one: membership)."""
        return [w for w in self.gw if not w.flags]

    # --- the router's phases ----------------------------------------------------------

    def _poll_loads(self, now: float) -> None:
        """The gateway's load poller: every ``engine_load_interval_s``, each worker's
        ``/v1/loads`` figures (read lazily at the next decision, stamped with the tick)."""
        if self._poll_s <= 0:
            return
        tick = math.floor(now / self._poll_s) * self._poll_s
        for k, w in enumerate(self.gw):
            if tick > self._polled[k]:
                self._polled[k] = tick
                w.engine_load = self.sims[k].engine_load()
                w.load_read_at = tick

    def _arrive(self, req: WorkloadRequest) -> None:
        now = self.now = req.arrival_s
        self._poll_loads(now)
        prepared = self.prepare(req)
        route = prepared.route
        self.core.estimate(route)
        exact = self.exact.request(prepared.prompt_key) if self.exact is not None else None
        choice = self.core.choose(route, self.routable(), now, exact)
        k = self.gw.index(choice.worker)
        place = None
        if choice.indexed and choice.policy.uses_prefix_match:  # the router's condition
            place = self.gate.enter(choice.worker.id, route.block_hashes, choice.predicted_blocks)
        lease = self.core.dispatch(route, choice, now, exact)
        # the longest predicted match, None when no index was consulted (the live rule)
        available = choice.available_tokens
        record = RequestRecord(
            index=req.index, arrival_s=now, worker=choice.worker.id,
            prompt_tokens=prepared.prompt_tokens, output_tokens=req.max_tokens,
            predicted_tokens=choice.matched_tokens, true_match_tokens=0,
            best_match_tokens=0, available_predicted_tokens=available,
            predicted_host_tokens=choice.matched_host_tokens,
        )  # fmt: skip
        self.records.append(record)
        self.reasons.append(choice.decision.reason)
        live = _InFlight(record, route, lease, choice, exact, place=place)
        send = _Send(f"r{req.index}", k, prepared.prompt_key, req.max_tokens)
        if place is not None and place.held_back:  # sent at a sibling's first token
            self._held[place] = (live, send)
            self._seq += 1
            heapq.heappush(self._timers, (now + place.max_wait_s, self._seq, place))
            return
        self._send(live, send, now)

    def _send(self, live: _InFlight, send: _Send, now: float) -> None:
        """The request reaches its worker model: at its arrival, or when the prefill gate
        lets it go."""
        rec, k = live.record, send.k
        true_matches = [sim.true_match(send.prompt_key) for sim in self.sims]
        rec.true_match_tokens, rec.best_match_tokens = true_matches[k], max(true_matches)
        if now > rec.arrival_s:  # held: the live router's TTFT counts from here
            live.sent_s = now
            self.gate.stats.waited_s += now - rec.arrival_s
        try:
            self.sims[k].submit(send.rid, send.prompt_key, send.max_tokens, now)
        except ValueError:  # e.g. longer than the worker's KV: the worker answers 400
            self.rejected += 1
            live.lease.release()
            if live.place is not None:
                self._let_go(self.gate.leave(live.place), now)
            return
        self._live[send.rid] = live
        self._start_step(k, now)

    def _let_go(self, released: list[Pass], now: float) -> None:
        """Send the held requests the prefill gate let go."""
        for place in released:
            held = self._held.pop(place, None)
            if held is not None:
                self._send(*held, now)

    def _deliver(self, out: SimOutput, now: float) -> None:
        live = self._live.get(out.rid)
        if live is None:
            return
        rec = live.record
        if out.first_token and rec.first_token_s is None:
            rec.first_token_s = now
            rec.cached_tokens = out.cached_tokens
            rec.cached_host_tokens = out.cached_host
            live.lease.first_token()
            if live.place is not None:  # the prompt is cached there: its siblings go
                self._let_go(self.gate.first_byte(live.place), now)
        if out.finished:
            rec.finish_s = now
            live.lease.release()
            if live.place is not None:
                self._let_go(self.gate.leave(live.place), now)
            sent = rec.arrival_s if live.sent_s is None else live.sent_s  # live: from dispatch
            ttft = None if rec.first_token_s is None else rec.first_token_s - sent
            tiers = None  # null without a hit, as SGLang's get_cached_tokens_details
            if self._tier_reports and rec.cached_tokens > 0:
                host = rec.cached_host_tokens
                tiers = CachedTiers(rec.cached_tokens - host, host)
            outcome = _Outcome(ttft, rec.cached_tokens, rec.prompt_tokens, cached_tiers=tiers)
            self.core.feedback(live.route, live.choice, live.lease, outcome, now, live.exact)
            del self._live[out.rid]
