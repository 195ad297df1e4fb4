"""A drain and a scale-out in the offline replay (issue 20): naive, re-homed, cache-aware.

Events on the virtual clock, set by :class:`MembershipPlan` (``--drain K@T``,
``--join T``):

- **drain** of worker ``K`` at ``T`` (``K`` -1: the worker that served the most requests
  in the minute before): it is flagged draining, as ``POST
  /workers/{id}/drain`` flags it (no new requests; its running ones finish), and leaves
  ``drain_period_s`` later (its index entries and chain log forgotten, as a removal
  forgets them; pre-warms still queued for its chains dropped).
- **join** at ``T``: a new worker of the same model and capacity is added (as ``POST
  /workers`` adds one that passes its first probe).

Modes (``--membership``):

- ``naive``: just that; the routing core's chain log and slow start are off.
- ``rehome``: the drain re-homes the worker's chains through
  ``gateway.routing.rehome.plan_rehome`` (the live gateway's code); the join ramps under
  ``gateway.workers.slow_start.SlowStart`` (the routing core's gate, as live).
- ``cache_aware``: as ``rehome``, and pre-warms: the re-homed chains' prompts (the replay's
  prompt store holds each chain's token ids, as the live one holds its body) are sent as
  prefill-only requests (one output token) to their new homes through the live
  :class:`~gateway.routing.rehome.PrewarmQueue` and its :class:`TokenBudget`, counted on
  the home by a lease and pinned in the index while in flight; the joining worker gets
  the fleet's most shared prefixes (``join_items``, the prompt cut to the prefix's tokens)
  within the same budget. The queue is pumped whenever it says something may go
  (``next_wake``) between the replay's own events.

Figures (``summary["membership"]``), over the requests that *arrive* within
``window_s`` of the event:

- drain: the **affected** requests: those for which, at the drain instant, the drained
  worker's radix cache held at least ``affected_min_tokens`` more of the prompt than any
  other worker's (the sessions that lived there). Both modes replay identically up to
  the drain, so the set is the same in every mode; it is computed once at the drain from
  the workers' real caches (``peek_prefix``, nothing changed).
- join: every request in the window, and those the new worker served.
- TTFT p50 / p99 (from arrival), hit rate, the prefill tokens computed (prompt minus
  cached) in the window and over the run, and what pre-warming spent (its requests'
  prompt minus cached tokens as the homes reported) against them.
"""

from __future__ import annotations

import argparse
import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import Any

from gateway.routing.lease import Lease
from gateway.routing.rehome import (
    REASON_DRAIN,
    REASON_JOIN,
    ChainLog,
    PrewarmItem,
    PrewarmJob,
    PrewarmQueue,
    PromptStore,
    RehomeReport,
    RehomeSettings,
    TokenBudget,
    join_items,
    plan_rehome,
    still_wanted,
)
from gateway.workers.registry import HealthFlag, Worker
from gateway.workers.slow_start import SlowStart
from loadtests.harness.stats import percentile
from loadtests.replay.metrics import RequestRecord
from loadtests.replay.sim import (
    FIRST_PORT,
    INDEX_MAX_IDLE_S,
    INDEX_SWEEP_S,
    Prepare,
    Prepared,
    SimOutcome,
    Simulation,
)
from loadtests.replay.workers import SimOutput, SimWorker
from loadtests.workloads.base import WorkloadRequest
from policies.base import EngineLoad, Policy
from simulator.model.radix_cache import TOKEN_BYTES

MODES = ("naive", "rehome", "cache_aware")


@dataclass(frozen=True, slots=True)
class MembershipPlan:
    """The event and the mode (module docstring); picklable, part of ``ReplayConfig``."""

    mode: str = "naive"
    # the worker drained (its index; -1: the one that served most requests in the minute
    # before), or None
    drain_worker: int | None = None
    drain_at_s: float = 0.0
    drain_period_s: float = 60.0  # drain to leave
    join_at_s: float | None = None
    window_s: float = 600.0  # figures over arrivals this long after the event
    affected_min_tokens: int = 256
    # the gateway's settings (config: drain, prewarm, slow_start)
    rehome_recent_s: float = 600.0
    min_uses: int = 2
    returning_share: float = 0.5
    max_home_share: float = math.inf  # rehome.RehomeSettings.max_home_share
    prewarm_recent_s: float = 300.0
    prewarm_tokens_per_s: float = 8000.0
    prewarm_burst_tokens: int = 65536
    prewarm_max_in_flight: int = 2
    # a home is sent a pre-warm only while its queued prefill is at most this (inf: any)
    prewarm_max_home_queued: float = math.inf
    prompt_store_bytes: int = 1 << 30  # token ids, 4 bytes each
    slow_start_s: float = 60.0
    slow_start_aggression: float = 1.0
    slow_start_min_factor: float = 0.1
    join_prefixes: int = 4

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--membership must be one of {', '.join(MODES)}")
        if self.drain_worker is None and self.join_at_s is None:
            raise ValueError("a membership plan needs --drain K@T or --join T")


def parse_drain(spec: str) -> tuple[int, float]:
    """``K@T`` → (worker index K, time T in seconds of the replay's clock); ``busiest@T``:
    K is -1 (the worker that served the most requests in the minute before T)."""
    k, sep, t = spec.partition("@")
    if k == "busiest":
        k = "-1"
    if not sep or not k.lstrip("-").isdigit():
        raise ValueError(f"--drain expects K@T or busiest@T (seconds), got {spec!r}")
    return int(k), float(t)


@dataclass(slots=True)
class _Prewarm:
    item: PrewarmItem
    lease: Lease
    prompt_tokens: int


class _Departed:
    """A worker that left: it still steps what it was running, and matches nothing."""

    def __init__(self, inner: SimWorker) -> None:
        self.inner = inner

    def submit(self, rid: str, prompt_key: bytes, max_tokens: int, now: float) -> None:
        self.inner.submit(rid, prompt_key, max_tokens, now)

    def step(self, now: float) -> tuple[float, list[SimOutput]] | None:
        return self.inner.step(now)

    def true_match(self, prompt_key: bytes) -> int:
        return 0

    def queue_length(self) -> int:
        return self.inner.queue_length()

    def occupancy(self) -> float:
        return self.inner.occupancy()

    def engine_load(self) -> EngineLoad:
        return self.inner.engine_load()

    def kv_batch(self, ts: float) -> bytes | None:
        return self.inner.kv_batch(ts)


class MembershipSimulation(Simulation):
    """The replay's loop with one drain or join (module docstring)."""

    def __init__(
        self,
        policy: Policy,
        workers: Sequence[SimWorker],
        capacity_tokens: int,
        prepare: Prepare,
        plan: MembershipPlan,
        new_worker: Callable[[], SimWorker],
        seed: int = 0,
        prefill_wait_s: float = 2.0,
    ) -> None:
        self._raw_prepare = prepare
        self._last_key = b""
        super().__init__(policy, workers, capacity_tokens, self._prepare_kept, seed=seed,
                         prefill_wait_s=prefill_wait_s)  # fmt: skip
        self.plan = plan
        self.capacity_tokens = capacity_tokens
        self._new_worker = new_worker
        aware = plan.mode != "naive"
        store = None
        if plan.mode == "cache_aware":
            store = PromptStore[bytes](plan.prompt_store_bytes, len)
        self.chains: ChainLog[bytes] = ChainLog(
            self.index.capacity_blocks, store=store, payload=lambda _req: self._last_key
        )
        if aware:
            self.core.chains = self.chains
        self.slow_start = None
        if aware and plan.join_at_s is not None and plan.slow_start_s > 0:
            self.slow_start = SlowStart(
                plan.slow_start_s, plan.slow_start_aggression, plan.slow_start_min_factor
            )
            self.core.gate = self.slow_start
        self.queue = PrewarmQueue(
            TokenBudget(plan.prewarm_tokens_per_s, plan.prewarm_burst_tokens, 0.0),
            plan.prewarm_max_in_flight,
            plan.prewarm_max_home_queued,
        )
        self._prewarms: dict[str, _Prewarm] = {}
        self._sent = 0
        self._in_flight: dict[str, int] = {}
        self.prewarm_records: list[tuple[str, int, int]] = []  # (reason, prompt, cached)
        self.report: RehomeReport | None = None
        self.job: PrewarmJob | None = None
        self.affected: set[int] = set()
        self.drained: int | None = None  # the drained worker's index, once drained
        self.joined: str | None = None
        self.event_s = plan.drain_at_s if plan.drain_worker is not None else plan.join_at_s or 0.0
        self._requests: Sequence[WorkloadRequest] = ()

    def _prepare_kept(self, req: WorkloadRequest) -> Prepared:
        prepared = self._raw_prepare(req)
        self._last_key = prepared.prompt_key  # what the chain log stores at dispatch
        return prepared

    # --- the loop ---------------------------------------------------------------------

    def run(self, requests: Sequence[WorkloadRequest]) -> SimOutcome:
        self._requests = requests
        plan = self.plan
        events: list[tuple[float, Callable[[float], None]]] = []
        if plan.drain_worker is not None:
            events.append((plan.drain_at_s, self._drain))
            events.append((plan.drain_at_s + plan.drain_period_s, self._leave))
        if plan.join_at_s is not None:
            events.append((plan.join_at_s, self._join))
        events.sort(key=lambda e: e[0])
        next_sweep = INDEX_SWEEP_S
        for req in requests:
            while events and events[0][0] <= req.arrival_s:
                t, action = events.pop(0)
                self._advance(t)
                self.now = t
                action(t)
            self._advance(req.arrival_s)
            while next_sweep <= req.arrival_s:
                self.index.evict_idle(next_sweep, INDEX_MAX_IDLE_S)
                next_sweep += INDEX_SWEEP_S
            self._arrive(req)
        for t, action in events:
            self._advance(t)
            self.now = t
            action(t)
        self._advance(math.inf)
        return SimOutcome(self.records, self.intervals, self.timeline.points,
                          [w.id for w in self.gw])  # fmt: skip

    def _advance(self, until: float) -> None:
        """The base loop's events, with the pre-warm queue pumped whenever it may send
        (and at each pre-warm's completion, in :meth:`_deliver`)."""
        t = self.now
        while True:
            wake = self.queue.next_wake(t, self._in_flight, self._queued())
            if wake is None or wake > until:
                break
            super()._advance(wake)
            t = max(t, wake)
            self.now = max(self.now, t)
            queued = len(self.queue)
            self._pump(t)
            if len(self.queue) == queued:  # nothing moved: let 1 ms of virtual time pass
                t += 1e-3
        super()._advance(until)

    # --- the events -------------------------------------------------------------------

    def _drain(self, now: float) -> None:
        k = self.plan.drain_worker
        assert k is not None
        if k < 0:  # the busiest: most requests in the minute before
            minute = takewhile(lambda r: r.arrival_s >= now - 60, reversed(self.records))
            recent = Counter(r.worker for r in minute)
            k = max(range(len(self.gw)), key=lambda j: (recent[self.gw[j].id], -j))
        self.drained = k
        worker = self.gw[k]
        worker.flags.add(HealthFlag.DRAINING)
        self.affected = self._affected(k, now)
        if self.plan.mode == "naive":
            return
        settings = RehomeSettings(recent_s=self.plan.rehome_recent_s, prewarm=True,
                                  prewarm_recent_s=self.plan.prewarm_recent_s,
                                  min_uses=self.plan.min_uses,
                                  returning_share=self.plan.returning_share,
                                  max_home_share=self.plan.max_home_share)  # fmt: skip
        if self.plan.mode == "cache_aware":
            self.job = PrewarmJob(REASON_DRAIN, worker.id, now + self.plan.drain_period_s)
        loads = {w.id: float(w.queued_prefill_tokens) for w in self.routable()}
        self.report, items = plan_rehome(self.chains, self.index, [worker.id], loads, now,
                                         settings, self.job)  # fmt: skip
        self.queue.add(items)
        self._pump(now)

    def _leave(self, now: float) -> None:
        k = self.drained
        assert k is not None
        wid = self.gw[k].id
        self.index.forget_worker(wid)
        self.chains.forget_worker(wid)
        self._let_go(self.gate.forget_worker(wid), now)  # as the gateway's removal
        self.sims[k] = _Departed(self.sims[k])
        if self.job is not None:
            self.queue.stop(self.job)
        if self.report is not None:
            self.report.ended_s = now

    def _join(self, now: float) -> None:
        sim = self._new_worker()
        worker = Worker(f"http://127.0.0.1:{FIRST_PORT + len(self.gw)}", now)
        worker.flags.clear()
        worker.metadata.capacity_tokens = self.capacity_tokens
        self.index.set_capacity(worker.id, self.capacity_tokens)
        self.sims.append(sim)
        self.gw.append(worker)
        self._busy.append(False)
        self._polled.append(-math.inf)
        self.joined = worker.id
        if self.slow_start is not None:
            self.slow_start.begin(worker.id)
        if self.plan.mode == "cache_aware":
            self.job = PrewarmJob(REASON_JOIN, worker.id, now + self.plan.window_s)
            fleet = [w.id for w in self.routable()]
            self.queue.add(join_items(self.chains, self.index, worker.id, fleet, now,
                                      self.plan.prewarm_recent_s, self.plan.join_prefixes,
                                      self.job))  # fmt: skip
            self._pump(now)

    def _affected(self, k: int, now: float) -> set[int]:
        """Requests of the window whose prompt the drained worker's cache holds, now, at
        least ``affected_min_tokens`` beyond any other worker's."""
        out: set[int] = set()
        end = now + self.plan.window_s
        for req in self._requests:
            if not now <= req.arrival_s < end:
                continue
            key = self._raw_prepare(req).prompt_key
            there = self.sims[k].true_match(key)
            if there < self.plan.affected_min_tokens:
                continue
            elsewhere = max(s.true_match(key) for j, s in enumerate(self.sims) if j != k)
            if there - elsewhere >= self.plan.affected_min_tokens:
                out.add(req.index)
        return out

    # --- pre-warming ------------------------------------------------------------------

    def _queued(self) -> dict[str, float]:
        """Each worker's queued prefill tokens (its leases': live requests, pre-warms)."""
        return {w.id: float(w.queued_prefill_tokens) for w in self.gw}

    def _pump(self, now: float) -> None:
        wanted = functools.partial(still_wanted, self.chains)
        due = self.queue.due(now, self._in_flight, wanted, self._queued())
        for item in due:
            k = next(j for j, w in enumerate(self.gw) if w.id == item.worker_id)
            key = self.chains.payload(*item.key)
            worker = self.gw[k]
            if key is None or worker.flags:
                item.job.failed += 1
                continue
            if item.prefix_blocks is not None:  # a shared prefix: its tokens only
                tokens = int(item.prefix_blocks * self.index.block_tokens(worker.id))
                key = key[: max(1, tokens) * TOKEN_BYTES]
            self._sent += 1
            rid = f"w{self._sent}"
            try:
                self.sims[k].submit(rid, key, 1, now)
            except ValueError:
                item.job.failed += 1
                continue
            self._in_flight[worker.id] = self._in_flight.get(worker.id, 0) + 1
            self.index.record(item.chain, worker.id, now)  # pinned while in flight
            self._prewarms[rid] = _Prewarm(item, Lease(worker, item.tokens), len(key) // 4)
            self._start_step(k, now)

    def _deliver(self, out: SimOutput, now: float) -> None:
        warm = self._prewarms.get(out.rid)
        if warm is None:
            super()._deliver(out, now)
            return
        if out.first_token:
            warm.lease.first_token()
        if not out.finished:
            return
        del self._prewarms[out.rid]
        item = warm.item
        warm.lease.release()
        self.index.release(item.worker_id, item.chain, now)
        self._in_flight[item.worker_id] -= 1
        item.job.completed += 1
        computed = max(0, warm.prompt_tokens - out.cached_tokens)
        item.job.tokens_reported += computed
        self.prewarm_records.append((item.job.reason, warm.prompt_tokens, out.cached_tokens))
        self._pump(now)

    # --- figures ----------------------------------------------------------------------

    def figures(self) -> dict[str, Any]:
        """``summary["membership"]`` (module docstring)."""
        plan = self.plan
        t0, t1 = self.event_s, self.event_s + plan.window_s
        window = [r for r in self.records if t0 <= r.arrival_s < t1]
        computed_all = sum(r.prompt_tokens - r.cached_tokens for r in self.records)
        computed_window = sum(r.prompt_tokens - r.cached_tokens for r in window)
        prewarm = sum(p - c for _, p, c in self.prewarm_records)
        out: dict[str, Any] = {
            "event": "drain" if plan.drain_worker is not None else "join",
            "mode": plan.mode,
            "at_s": t0,
            "window_s": plan.window_s,
            "window": _group(window),
            "prefill_tokens_window": computed_window,
            "prefill_tokens_total": computed_all,
            "prewarm_tokens": prewarm,
            "prewarm_requests": len(self.prewarm_records),
            "prewarm_share_window": prewarm / computed_window if computed_window else math.nan,
            "prewarm_share_total": prewarm / computed_all if computed_all else math.nan,
            "prewarm": None if self.job is None else self.job.as_dict(),
            "rehome": None if self.report is None else self.report.as_dict(self.now),
        }
        if plan.drain_worker is not None:
            out["affected"] = _group([r for r in window if r.index in self.affected], True)
            out["drained"] = None if self.drained is None else self.gw[self.drained].id
        if self.joined is not None:
            out["new_worker"] = _group([r for r in window if r.worker == self.joined], True)
            out["joined"] = self.joined
            share = sum(1 for r in window if r.worker == self.joined)
            out["new_worker_share"] = share / len(window) if window else math.nan
        if self.slow_start is not None:
            out["slow_start"] = {"kept": self.slow_start.kept, "dropped": self.slow_start.dropped}
        return out


def _group(records: Sequence[RequestRecord], keep: bool = False) -> dict[str, Any]:
    """TTFT percentiles (from arrival), hit rate, prefill tokens of ``records``; with
    ``keep``, each one's TTFT and prompt and cached tokens too (for pooling runs)."""
    ttfts = [t for r in records if (t := r.ttft_s) is not None]
    prompt = sum(r.prompt_tokens for r in records)
    rows = [(r.ttft_s, r.prompt_tokens, r.cached_tokens) for r in records] if keep else None
    return {
        "rows": rows,
        "requests": len(records),
        "ttft_p50": percentile(ttfts, 50, "linear") if ttfts else math.nan,
        "ttft_p99": percentile(ttfts, 99, "linear") if ttfts else math.nan,
        "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else math.nan,
        "prefill_tokens": sum(r.prompt_tokens - r.cached_tokens for r in records),
    }


# --- command line ----------------------------------------------------------------------


def add_membership_args(parser: argparse.ArgumentParser) -> None:
    """``--drain K@T``, ``--join T``, ``--membership MODE`` and the gateway's settings."""
    g = parser.add_argument_group("drain / scale-out (issue 20; loadtests/replay/membership.py)")
    g.add_argument(
        "--drain",
        metavar="K@T",
        help="drain worker K (or busiest) at T s; it leaves after --drain-period",
    )
    g.add_argument("--drain-period", type=float, default=60.0, help="drain to leave, s (60)")
    g.add_argument("--join", type=float, metavar="T", help="a worker joins at T s")
    g.add_argument("--membership", choices=MODES, default="naive",
                   help="naive, rehome (and slow start), cache_aware (and pre-warm)")  # fmt: skip
    g.add_argument("--membership-window", type=float, default=600.0,
                   help="figures over arrivals this long after the event (600)")  # fmt: skip
    g.add_argument("--prewarm-tokens-per-s", type=float, default=8000.0)
    g.add_argument("--prewarm-recent-s", type=float, default=300.0)
    g.add_argument("--prewarm-max-home-queued", type=float, default=math.inf,
                   help="pre-warm a home only while its queued prefill tokens are at most "
                   "this (default: any)")  # fmt: skip
    g.add_argument("--min-uses", type=int, default=2, help="drain.min_uses (2)")
    g.add_argument("--max-home-share", type=float, default=math.inf,
                   help="a home's cap, x an even share (default inf: by load)")  # fmt: skip
    g.add_argument("--slow-start-s", type=float, default=60.0)
    g.add_argument("--join-prefixes", type=int, default=4)


def plan_from_args(ns: argparse.Namespace) -> MembershipPlan | None:
    if getattr(ns, "drain", None) is None and getattr(ns, "join", None) is None:
        return None
    worker, at = parse_drain(ns.drain) if ns.drain is not None else (None, 0.0)
    return MembershipPlan(
        mode=ns.membership,
        drain_worker=worker,
        drain_at_s=at,
        drain_period_s=ns.drain_period,
        join_at_s=ns.join,
        window_s=ns.membership_window,
        prewarm_tokens_per_s=ns.prewarm_tokens_per_s,
        prewarm_recent_s=ns.prewarm_recent_s,
        prewarm_max_home_queued=ns.prewarm_max_home_queued,
        min_uses=ns.min_uses,
        max_home_share=ns.max_home_share,
        slow_start_s=ns.slow_start_s,
        join_prefixes=ns.join_prefixes,
    )
