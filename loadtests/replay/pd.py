"""Prefill/decode disaggregation in the offline replay: N prefill + M decode worker models
behind the gateway's PD routing, beside a regular fleet of N + M, on one virtual clock.

    python -m loadtests.replay.pd --workload generated-shared-prefix \
        --workload-arg num_groups=16 ... [--prefill 2] [--decode 2] [--rows ...]

**Workers** are the simulator's own PD models (``simulator.model.disagg``), driven on the
replay's clock as the HTTP layer (``simulator.http.sglang.pd``) drives them, without the
HTTP: a request is announced to both sides at its arrival (the router's dual dispatch);
the decode side's handshake is taken as immediate, so the prefill schedules it at once
(bootstrap queue left at arrival); the prefill computes the prompt with its radix cache,
samples one token and keeps the KV locked while it moves over its
:class:`~simulator.model.transfer.TransferLink` (every prompt token, queued per prefill);
when the prefill's scheduler concludes the transfer (at its next step, as in the HTTP
simulator) the decode model gets the handoff, commits it (``cached_tokens`` = the
prefill's hit) and decodes without a radix cache. A prefill that only waits for its
transfers is woken early by a new request, as the simulator's driver is.

**Routing**, as ``gateway.routing.router.Router._attempt_pd``: the prefill chosen by the
routing core over the prefill workers (prefix index recorded at dispatch, cost model),
the decode by a second core (``gateway.app.make_decode_core``: its own policy, the same
index and cost model) over the decode workers; the prefill's lease is the core's, the
decode's a plain lease of no prefill tokens; both move to decoding at the decode's first
token and are released at its last; the feedback (index correction with the decode's
reported ``cached_tokens``, the cost model with the TTFT) goes to the prefill. Engine
loads are polled every second for every worker.

**sglang-router 0.3.2's PD rule** (docs/PD.md section 3), as two reference prefill
policies with the decode by ``round_robin``:

* ``sglang_pd_prefill``: what 0.3.2 does. Its PD router builds the prefill policy as a
  fresh ``CacheAwarePolicy`` (``routers/factory.rs`` ``create_pd_router``) whose radix
  trees are never initialised: ``init_pd_cache_aware_policies`` is defined in
  ``policies/registry.rs`` but called nowhere, and worker registration
  (``core/steps/worker/shared/update_policies.rs``) initialises only the per-model
  policy. ``select_worker`` then finds no tree for the model and picks a uniformly random
  healthy worker ("No tree found for model ..., using random worker selection", seen in
  its debug log in front of the simulated pair), unless the loads are imbalanced (then
  the least loaded: the load branch does not need the tree). Loads are the router's own
  in-flight counts, held until the response ends.
* ``sglang_cache_aware`` (``loadtests.replay.sglang_rule``): the rule as its regular mode
  runs it, i.e. what the PD prefill policy would do with its tree initialised.

**Rows** (``--rows``): ``pd:PREFILL_POLICY/DECODE_POLICY`` on the PD fleet, and
``regular:POLICY`` on N + M regular workers (``loadtests.replay.run``, unchanged).
Figures: TTFT p50 / p99 (modelled s), the hit rate (Σ cached / Σ prompt tokens as the
workers report; on PD the prefill side's), completed requests per second (completed /
(last finish - first arrival)), output tokens per second, the request share per prefill
and per decode worker.

Not modelled (beyond the simulator's own PD limits, docs/PD.md section 8): HTTP and
router CPU time, the handshake's and the decode's polling latency, failures and retries.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from gateway.routing.decide import RoutingCore
from gateway.routing.lease import Lease
from loadtests.replay.metrics import BusyInterval, RequestRecord, summarize, summarize_latency
from loadtests.replay.prompts import PromptBuilder
from loadtests.replay.run import ReplayConfig, load_workload, make_policy, replay
from loadtests.replay.sglang_rule import REFERENCE_NAME
from loadtests.replay.sim import Prepare, Simulation, _InFlight, _Outcome
from loadtests.replay.workers import ModelWorker, SimOutput, prefill_time_fn, resolve_profile
from loadtests.workloads.base import WorkloadRequest
from policies.base import Decision, Policy, RouteContext
from simulator.config import SimConfig
from simulator.model.disagg import DecodeWorkerModel, Handoff, PrefillWorkerModel
from simulator.model.requests import SimRequest
from simulator.model.transfer import DEFAULT_TRANSFER_PROFILE, get_transfer_profile

PD_REFERENCE_NAME = "sglang_pd_prefill"
DEFAULT_ROWS = (
    "pd:min_ttft/least_load",
    "pd:cache_aware/least_load",
    f"pd:{PD_REFERENCE_NAME}/round_robin",
    f"pd:{REFERENCE_NAME}/round_robin",
    "regular:min_ttft",
    f"regular:{REFERENCE_NAME}",
)


class SglangPdPrefill(Policy):
    """sglang-router 0.3.2's PD prefill choice as it behaves (module docstring): the least
    loaded (first of ties) when imbalanced, else a random worker."""

    name: ClassVar[str] = PD_REFERENCE_NAME

    def __init__(self, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5):
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def select(self, ctx: RouteContext) -> Decision:
        views = ctx.candidates
        loads = [w.in_flight for w in views]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return Decision(next(w.id for w in views if w.in_flight == lo), "imbalance")
        return Decision(ctx.rng.choice(list(views)).id, "random")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "balance_abs_threshold": self.balance_abs_threshold,
                "balance_rel_threshold": self.balance_rel_threshold}  # fmt: skip


def pd_policy(name: str) -> Policy:
    """A policy of ``policies/``, the replay's ``sglang_cache_aware``, or
    ``sglang_pd_prefill``."""
    return SglangPdPrefill() if name == PD_REFERENCE_NAME else make_policy(name, {})


class PrefillSim(ModelWorker):
    """A prefill worker model on the virtual clock: requests bootstrapped at submission;
    its own answers (one token) are drained, not read: :meth:`step` reports none, and
    the concluded transfers wait in :attr:`handoffs`."""

    def __init__(self, config: SimConfig, transfer: str) -> None:
        self.recorder = None
        self.prefill = PrefillWorkerModel.build(config, get_transfer_profile(transfer))
        self.model = self.prefill
        self.prefill.on_transfer_done = self._done
        self.handoffs: list[tuple[str, Handoff]] = []
        self.idle = False  # the last step only waits for transfers (a submit may cut it)

    def _done(self, rid: str, handoff: Handoff | None, failure: str | None) -> None:
        if handoff is not None:
            self.handoffs.append((rid, handoff))

    def submit(self, rid: str, prompt_key: bytes, max_tokens: int, now: float) -> None:
        self.prefill.expect(rid)
        try:
            super().submit(rid, prompt_key, max_tokens, now)
        finally:
            self.prefill.forget(rid)
        if not self.prefill.bootstrapped(rid):  # e.g. longer than the KV pool
            raise ValueError(f"prefill refused {rid}")

    def step(self, now: float) -> tuple[float, list[SimOutput]] | None:
        result = self.prefill.step(now)
        self.idle = result is not None and result.kind == "idle"
        return None if result is None else (result.duration, [])


class DecodeSim(ModelWorker):
    """A decode worker model on the virtual clock: requests held until their KV arrives
    (:meth:`kv_arrived`), streamed so that the first decoded token is reported."""

    def __init__(self, config: SimConfig) -> None:
        self.recorder = None
        self.decode = DecodeWorkerModel.build(config)
        self.model = self.decode

    def submit(self, rid: str, prompt_key: bytes, max_tokens: int, now: float) -> None:
        self.decode.expect(rid)
        try:
            req = SimRequest(rid, prompt_key, max_new_tokens=max_tokens, ignore_eos=True)
            self.decode.submit(req, now)
        finally:
            self.decode.forget(rid)
        if not self.decode.bootstrapped(rid):
            raise ValueError(f"decode refused {rid}")

    def kv_arrived(self, rid: str, handoff: Handoff) -> None:
        self.decode.kv_arrived(rid, handoff)

    def abort(self, rid: str, now: float) -> None:
        self.decode.abort(rid, now)


class PDSimulation(Simulation):
    """The PD fleet behind the gateway's PD routing (module docstring). Worker ids: the
    prefills first, then the decodes."""

    def __init__(
        self,
        policy: Policy,
        decode_policy: Policy,
        prefills: Sequence[PrefillSim],
        decodes: Sequence[DecodeSim],
        capacity_tokens: int,
        prepare: Prepare,
        seed: int = 0,
    ) -> None:
        super().__init__(policy, [*prefills, *decodes], capacity_tokens, prepare, seed=seed)
        self.prefills, self.decodes = list(prefills), list(decodes)
        self.n_prefill = len(self.prefills)
        self.decode_core = RoutingCore(
            decode_policy, self.index, self.costs, random.Random(seed), self.tokens
        )
        self._current: list[int] = [0] * len(self.sims)  # each worker's live step event
        self._decode_of: dict[str, int] = {}
        self._decode_leases: dict[str, Lease] = {}

    @property
    def prefill_ids(self) -> list[str]:
        return [w.id for w in self.gw[: self.n_prefill]]

    def _advance(self, until: float) -> None:
        while self._events and self._events[0][0] <= until:
            now, seq, k = heapq.heappop(self._events)
            if self._current[k] != seq:
                continue  # an idle wait cut short by a submit
            self.now = now
            _, outputs = self._pending.pop(k)
            self._busy[k] = False
            for out in outputs:
                self._deliver(out, now)
            self._start_step(k, now)

    def _start_step(self, k: int, now: float) -> None:
        prefill = self.prefills[k] if k < self.n_prefill else None
        if self._busy[k]:
            if prefill is None or not prefill.idle:
                return
            self._pending.pop(k)  # the driver's wake-up: a new request ends the idle wait
            self._busy[k] = False
        result = self.sims[k].step(now)
        self.timeline.sample(self.gw[k].id, now, self.sims[k])
        if result is not None:
            duration, outputs = result
            self._busy[k] = True
            self._pending[k] = (duration, outputs)
            if prefill is None or not prefill.idle:
                self.intervals.append(BusyInterval(self.gw[k].id, now, duration))
            self._seq += 1
            self._current[k] = self._seq
            heapq.heappush(self._events, (now + duration, self._seq, k))
        if prefill is not None:
            handoffs, prefill.handoffs = prefill.handoffs, []
            for rid, handoff in handoffs:
                d = self._decode_of.get(rid)
                if d is not None:
                    self.decodes[d].kv_arrived(rid, handoff)
                    self._start_step(self.n_prefill + d, now)

    def _arrive(self, req: WorkloadRequest) -> None:
        now = self.now = req.arrival_s
        self._poll_loads(now)
        prepared = self.prepare(req)
        route, key = prepared.route, prepared.prompt_key
        self.core.estimate(route)
        choice = self.core.choose(route, self.gw[: self.n_prefill], now)
        decode = self.decode_core.choose(route, self.gw[self.n_prefill :], now)
        k, d = self.gw.index(choice.worker), self.gw.index(decode.worker) - self.n_prefill
        available = None  # read before dispatch, which drops the views
        if choice.indexed:
            available = max((v.matched_tokens for v in choice.views), default=0)
        lease = self.core.dispatch(route, choice, now)
        decode_lease = Lease(decode.worker, 0)  # a decode computes no prompt
        true_matches = [p.true_match(key) for p in self.prefills]
        record = RequestRecord(
            index=req.index, arrival_s=now, worker=choice.worker.id,
            prompt_tokens=prepared.prompt_tokens, output_tokens=req.max_tokens,
            predicted_tokens=choice.matched_tokens, true_match_tokens=true_matches[k],
            best_match_tokens=max(true_matches), available_predicted_tokens=available,
        )  # fmt: skip
        self.records.append(record)
        self.reasons.append(choice.decision.reason)
        rid = f"r{req.index}"
        try:
            self.prefills[k].submit(rid, key, req.max_tokens, now)
            try:
                self.decodes[d].submit(rid, key, req.max_tokens, now)
            except ValueError:
                self.prefills[k].model.abort(rid, now)
                raise
        except ValueError:  # a prompt longer than the KV pool: SGLang's 400
            self.rejected += 1
            lease.release()
            decode_lease.release()
            return
        self._live[rid] = _InFlight(record, route, lease, choice, None)
        self._decode_of[rid] = d
        self._decode_leases[rid] = decode_lease
        self._start_step(k, now)
        self._start_step(self.n_prefill + d, now)

    def _deliver(self, out: SimOutput, now: float) -> None:
        live = self._live.get(out.rid)
        if live is None:
            return
        rec = live.record
        decode_lease = self._decode_leases[out.rid]
        if (out.first_token or out.finished) and rec.first_token_s is None:
            rec.first_token_s = now
            rec.cached_tokens = out.cached_tokens
            live.lease.first_token()
            decode_lease.first_token()
        if out.finished:
            rec.finish_s = now
            live.lease.release()
            decode_lease.release()
            ttft = None if rec.first_token_s is None else rec.first_token_s - rec.arrival_s
            outcome = _Outcome(ttft, rec.cached_tokens, rec.prompt_tokens)
            self.core.feedback(live.route, live.choice, live.lease, outcome, now, None)
            del self._live[out.rid], self._decode_of[out.rid], self._decode_leases[out.rid]


@dataclass(frozen=True, slots=True)
class PDConfig:
    """One PD replay: the fleet, the two policies and the workload (picklable)."""

    prefill: int
    decode: int
    capacity_tokens: int
    prefill_policy: str
    decode_policy: str
    workload: str
    workload_args: tuple[str, ...] = ()
    limit: int = 0
    time_scale: float = 1.0
    profile: str | None = None
    seed: int = 0
    page_size: int = 1
    transfer_profile: str = DEFAULT_TRANSFER_PROFILE

    def sim_config(self) -> SimConfig:
        """Each worker's settings, as ``loadtests.replay.workers.make_workers`` sets a
        regular worker's."""
        return SimConfig(capacity_tokens=self.capacity_tokens, page_size=self.page_size,
                         profile=resolve_profile(self.profile).name)  # fmt: skip

    def regular(self, policy: str) -> ReplayConfig:
        """The regular fleet of the same size, as ``loadtests.replay.run`` replays it."""
        return ReplayConfig(
            workers=self.prefill + self.decode, capacity_tokens=self.capacity_tokens,
            policy=policy, workload=self.workload, workload_args=self.workload_args,
            limit=self.limit, time_scale=self.time_scale, profile=self.profile,
            seed=self.seed, page_size=self.page_size, bounds=False,
        )  # fmt: skip


def run_pd(config: PDConfig) -> dict[str, Any]:
    """Replay the PD fleet; the summary of ``loadtests.replay.metrics.summarize`` over the
    prefill side, plus ``decode_share``, ``requests_per_s``, ``config`` and ``wall_s``."""
    started = time.perf_counter()
    workload = load_workload(config.regular(config.prefill_policy))
    sim_config = config.sim_config()
    prefills = [PrefillSim(sim_config, config.transfer_profile) for _ in range(config.prefill)]
    decodes = [DecodeSim(sim_config) for _ in range(config.decode)]
    sim = PDSimulation(
        pd_policy(config.prefill_policy), pd_policy(config.decode_policy), prefills, decodes,
        config.capacity_tokens, PromptBuilder().prepare, seed=config.seed,
    )  # fmt: skip
    outcome = sim.run(workload.requests)
    ids = set(sim.prefill_ids)
    intervals = [iv for iv in outcome.intervals if iv.worker in ids]
    summary = summarize(outcome.records, intervals, sim.prefill_ids, None,
                        prefill_time_fn(config.profile))  # fmt: skip
    decode_ids = [w.id for w in sim.gw[sim.n_prefill :]]
    served = [sum(1 for iv in outcome.intervals if iv.worker == w) for w in decode_ids]
    summary["decode_steps"] = dict(zip(decode_ids, served, strict=True))
    summary["rejected"] = sim.rejected
    extra_figures(summary, outcome.records)
    summary["config"] = {"fleet": "pd", **_asdict(config)}
    summary["wall_s"] = time.perf_counter() - started
    return summary


def extra_figures(summary: dict[str, Any], records: Sequence[RequestRecord]) -> None:
    """``requests_per_s``: completed / (last finish - first arrival); ``tpot_s``: per
    request (finish - first token) / (output tokens - 1), the decode's pace."""
    span = summary["makespan_s"] - min((r.arrival_s for r in records), default=0.0)
    summary["requests_per_s"] = summary["completed"] / span if span > 0 else math.nan
    tpots = [
        (r.finish_s - r.first_token_s) / (r.output_tokens - 1)
        for r in records
        if r.finish_s is not None and r.first_token_s is not None and r.output_tokens > 1
    ]
    summary["tpot_s"] = summarize_latency(tpots)


def _asdict(config: PDConfig) -> dict[str, Any]:
    return {f: getattr(config, f) for f in PDConfig.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class Row:
    spec: str
    fleet: str
    policy: str
    decode_policy: str = ""

    @classmethod
    def parse(cls, spec: str) -> Row:
        fleet, _, policies = spec.partition(":")
        policy, _, decode = policies.partition("/")
        if fleet not in ("pd", "regular") or not policy or (fleet == "pd") != bool(decode):
            raise ValueError(f"bad row {spec!r}: pd:PREFILL/DECODE or regular:POLICY")
        return cls(spec, fleet, policy, decode)


def run_row(row: Row, base: PDConfig) -> dict[str, Any]:
    """One row: a PD replay, or the regular fleet's (``loadtests.replay.run.replay``)."""
    if row.fleet == "pd":
        return run_pd(replace(base, prefill_policy=row.policy, decode_policy=row.decode_policy))
    summary, outcome = replay(base.regular(row.policy))
    extra_figures(summary, outcome.records)
    return summary


def _f(x: float, digits: int) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def render(results: Sequence[tuple[Row, dict[str, Any]]]) -> str:
    """The rows as one Markdown table, TTFT ratios against sglang-router 0.3.2's PD row."""
    ref = next((s for r, s in results if r.policy == PD_REFERENCE_NAME), None)
    lines = [
        "| row | TTFT p50 / p99 (s) | p50 / p99 ÷ sglang-router 0.3.2 PD | hit rate "
        "| TPOT p50 / p99 (ms) | completed / requests | req/s | output tok/s | share per prefill "
        "(per worker when regular) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, s in results:
        t = s["ttft_s"]
        ratios = "-"
        if ref is not None:
            ratios = " / ".join(_f(t[q] / ref["ttft_s"][q], 2) if ref["ttft_s"][q] else "-"
                                for q in ("p50", "p99"))  # fmt: skip
        share = " / ".join(f"{v:.2f}" for v in s["worker_share"].values())
        lines.append(
            f"| {row.spec} | {_f(t['p50'], 3)} / {_f(t['p99'], 3)} | {ratios} | "
            f"{_f(s['hit_rate'], 3)} | {_f(s['tpot_s']['p50'] * 1e3, 1)} / "
            f"{_f(s['tpot_s']['p99'] * 1e3, 1)} | "
            f"{s['completed']} / {s['requests']} | "
            f"{_f(s['requests_per_s'], 2)} | {_f(s['output_tokens_per_s'], 0)} | {share} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.replay.pd",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--workload", default="generated-shared-prefix")
    p.add_argument("--workload-arg", action="append", default=[], metavar="K=V")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--capacity-tokens", type=int, default=32768)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--transfer-profile", default=DEFAULT_TRANSFER_PROFILE)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS))
    ns = p.parse_args(argv)
    try:
        rows = [Row.parse(r.strip()) for r in ns.rows.split(",") if r.strip()]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    base = PDConfig(
        ns.prefill, ns.decode, ns.capacity_tokens, "min_ttft", "least_load", ns.workload,
        tuple(ns.workload_arg), ns.limit, ns.time_scale, ns.profile, ns.seed, ns.page_size,
        ns.transfer_profile,
    )  # fmt: skip
    started = time.perf_counter()
    results = [(row, run_row(row, base)) for row in rows]
    first = results[0][1]
    print(
        f"{ns.workload} ({', '.join(ns.workload_arg) or 'defaults'}): {first['requests']} "
        f"requests, time scale {ns.time_scale:g}; PD {ns.prefill} prefill + {ns.decode} decode "
        f"(link {ns.transfer_profile}), regular {ns.prefill + ns.decode} workers; "
        f"{ns.capacity_tokens:,} KV tokens each, profile {ns.profile}\n"
    )
    print(render(results))
    print(f"\n{time.perf_counter() - started:.1f} s of wall time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
