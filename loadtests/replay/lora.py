"""LoRA adapters in the offline replay (issue 19): simulated workers with adapter slots
and a load time, behind the gateway's adapter-aware routing or adapter-blind routing.

Chosen by :func:`loadtests.replay.run.replay` when a workload's requests name adapters
(``lora-tenants``: ``model: "base:tenantNN"``).

**Workers** (:class:`LoraWorker`): the simulator's ``WorkerModel`` configured as
``python -m simulator --enable-lora --max-loras-per-batch B --max-loaded-loras L
--lora-load-s S`` configures it (at most B adapters per batch, a request waits in the
queue until its adapter's weights are in), with the adapter registry of
``simulator.model.lora.LoraAdapters`` (L slots, LRU eviction, SGLang's implicit reload of
an adapter loaded once, a 400 for one never loaded) and the HTTP layer's two load paths
(``simulator.http.sglang``): an explicit ``/load_lora_adapter`` answers after S and its
adapter is ready then; an implicit reload makes its request wait S in the queue. The
cache namespace of a request is its adapter's, as the HTTP worker's (requests of
different adapters never share a prefix). Warm-up, as ``loadtests.micro.lora``'s: every
worker loads every adapter once, in the order that leaves worker ``k`` holding adapters
``k, k + N, ...`` (by popularity), counters then reset.

**Routing**, as ``gateway.routing.router.Router.handle`` with ``lora.affinity`` (the
default), through the gateway's own code: the adapter a request names
(``RouteRequest.target``), the registry's candidates (``WorkerRegistry.candidates``:
the workers holding it), ``gateway.routing.lora.adapter_candidates`` (a load when none
holds it, the load time in ``WorkerView.setup_s``, idle workers offered beside a hot
adapter's holders under a policy that weighs it: replication, the load rate bound; the
404 and 503 answers counted as ``errors``), the routing core's ``choose`` with those
setup times, ``replica_load`` and the load itself: the request is dispatched (index
recorded, lease taken, sent) when the load answers, ``S`` later, as the router awaits
``load_adapter`` before its attempt; requests meanwhile for the same adapter on that
worker wait for that load (``AdapterLoads.inflight``, keyed as live; the value is no task
here). The load's answer sets the worker's adapters in the registry (its
``loaded_adapters``), the load's duration feeds ``AdapterLoads.timed``, and every
``health_interval_s`` the registry re-reads each worker's adapters (the health probe's
``/v1/models``). TTFT for the cost model counts from dispatch, as live; the request's
own TTFT counts from its arrival.

**Blind** (``affinity`` false, ``--no-lora-affinity``; and always for the reference
``sglang_cache_aware``, which forwards ``model`` untouched): the policy over every worker,
the worker reloading implicitly.

Not modelled: HTTP time of the load call (its answer is taken as S after it starts), DP
ranks, failed loads (a worker refusing one), the live default estimate's units (1 s
before the first timed load: wall seconds live, modelled here).
"""

from __future__ import annotations

import heapq
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from gateway.config import LoraConfig, OutlierConfig
from gateway.errors import GatewayError
from gateway.routing.decide import Choice, ExactRequest
from gateway.routing.lora import AdapterLoads, adapter_candidates, replica_load
from gateway.workers.registry import Worker, WorkerRegistry
from loadtests.replay.exact import ReplayExact
from loadtests.replay.metrics import RequestRecord
from loadtests.replay.sim import Prepare, Prepared, Simulation, _InFlight
from loadtests.replay.workers import ModelWorker, resolve_profile
from loadtests.workloads.base import WorkloadRequest
from loadtests.workloads.lora import adapter_name, adapter_path, warmup_orders
from policies.base import Policy
from simulator.config import SimConfig
from simulator.model.lora import LoraAdapters, LoraRef, LoraUpdate
from simulator.model.radix_cache import TOKEN_BYTES
from simulator.model.requests import SimRequest

if TYPE_CHECKING:
    import asyncio

COUNTERS = ("loads", "reloads", "evictions")
# AdapterLoads.inflight marks a load under way by its key; the live value is the load's
# task, which the replay has no use for (it never awaits it)
_LOADING = cast("asyncio.Task[str | None]", None)


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The workers' LoRA settings (the simulator's flags) and the gateway's affinity."""

    max_loras_per_batch: int = 4
    max_loaded_loras: int = 6
    load_s: float = 0.2
    affinity: bool = True  # the gateway's lora.affinity (false: --no-lora-affinity)
    health_interval_s: float = 1.0  # the gateway's re-read of each worker's adapters


def namespace(adapter: str | None) -> str:
    """A request's radix-cache namespace as the HTTP worker derives it from its adapter
    (``simulator.http.sglang.core.SGLangCore._namespace``: no extra_key, no cache_salt)."""
    return "\x1f".join((adapter, "", "")) if adapter else ""


class LoraWorker(ModelWorker):
    """One simulated worker with LoRA enabled (see module docstring)."""

    def __init__(self, config: SimConfig, kv_events: bool = False) -> None:
        super().__init__(config, kv_events)
        self.load_s = config.lora_load_s
        self.loras = LoraAdapters(True, (), config.max_loras_per_batch, config.max_loaded_loras)

    def load(self, ref: LoraRef, now: float, waited: bool) -> LoraUpdate:
        """``SGLangCore.load_adapter``: registered, ready at ``now`` when the caller
        waited the load time already (an explicit load), else ``load_s`` later; evicted
        adapters leave the model."""
        result = self.loras.load(ref)
        if result.success:
            self.model.adapter_loading(ref.name, now if waited else now + self.load_s)
            for name in result.evicted:
                self.model.adapter_unloaded(name)
        return result

    def loaded(self) -> dict[str, str]:
        """What its ``/v1/models`` cards (and a load's ``loaded_adapters``) tell."""
        return {r.name: r.path for r in self.loras.loaded()}

    def submit_adapter(
        self, rid: str, prompt_key: bytes, max_tokens: int, now: float, adapter: str | None
    ) -> None:
        """Queue a request naming ``adapter``: reloaded implicitly when evicted, a
        ValueError (SGLang's 400) when never loaded."""
        for ref in self.loras.resolve([adapter] if adapter else []):
            self.load(ref, now, waited=False)
        req = SimRequest(rid, prompt_key, max_new_tokens=max_tokens, ignore_eos=True,
                         stream=False, adapter=adapter, namespace=namespace(adapter))  # fmt: skip
        self.model.submit(req, now)

    def true_match_in(self, prompt_key: bytes, adapter: str | None) -> int:
        """``true_match`` within the adapter's namespace."""
        return self.model.cache.peek_prefix(prompt_key[:-TOKEN_BYTES], namespace(adapter))

    def counters(self) -> dict[str, int]:
        return {k: int(getattr(self.loras, k)) for k in COUNTERS}

    def reset_counters(self) -> None:
        self.loras.loads = self.loras.reloads = self.loras.evictions = 0


def make_lora_workers(
    count: int,
    capacity_tokens: int,
    profile: str | None,
    lora: LoraSettings,
    page_size: int = 1,
    kv_events: bool = False,
) -> list[LoraWorker]:
    config = SimConfig(
        capacity_tokens=capacity_tokens,
        profile=resolve_profile(profile).name,
        page_size=page_size,
        enable_lora=True,
        max_loras_per_batch=lora.max_loras_per_batch,
        max_loaded_loras=lora.max_loaded_loras,
        lora_load_s=lora.load_s,
    )
    config.validate()
    return [LoraWorker(config, kv_events) for _ in range(count)]


@dataclass(slots=True)
class _Waiting:
    """A request whose dispatch waits for an adapter load."""

    req: WorkloadRequest
    prepared: Prepared
    choice: Choice
    exact: ExactRequest | None


class LoraSimulation(Simulation):
    """:class:`Simulation` with LoRA workers and the gateway's adapter routing."""

    sims: list[LoraWorker]  # type: ignore[assignment]

    def __init__(
        self,
        policy: Policy,
        workers: Sequence[LoraWorker],
        capacity_tokens: int,
        prepare: Prepare,
        model: str,
        lora: LoraSettings,
        seed: int = 0,
        exact: Callable[[Sequence[str], Callable[[], float]], ReplayExact] | None = None,
        lora_config: LoraConfig | None = None,
    ) -> None:
        super().__init__(policy, workers, capacity_tokens, prepare, seed=seed, exact=exact)
        self.lora = lora
        self.config = lora_config or LoraConfig(affinity=lora.affinity)
        self.registry = WorkerRegistry(OutlierConfig().panic_threshold, lambda: self.now)
        gw = []
        for w in self.gw:  # the same ids, now the registry's workers
            worker, _ = self.registry.add(w.url, "sglang")
            worker.flags.clear()
            worker.metadata.capacity_tokens = capacity_tokens
            worker.metadata.model = model
            worker.metadata.lora_enabled = True
            worker.metadata.max_loaded_loras = lora.max_loaded_loras  # as /server_info tells
            gw.append(worker)
        self.gw = gw
        self.loads = AdapterLoads()
        self._load_events: list[tuple[float, int, str, str]] = []  # (done, seq, wid, adapter)
        self._waiting: dict[tuple[str, str], list[_Waiting]] = {}
        self._paths: dict[tuple[str, str], str] = {}  # the path each load is made from
        self._probed = -math.inf
        self.errors: dict[int, int] = {}  # gateway answers without a worker: 404, 503
        self.gateway_loads = 0  # load calls the gateway made
        self.adapter_of: dict[int, str | None] = {}  # request index -> its adapter

    def warm_up(self, adapters: Sequence[str]) -> None:
        """Every adapter loaded once on every worker, worker ``k`` left holding adapters
        ``k, k + N, ...`` (:func:`loadtests.workloads.lora.warmup_orders`); the gateway has
        seen every path; counters reset."""
        orders = warmup_orders(adapters, len(self.sims), self.lora.max_loaded_loras)
        for sim, worker, order in zip(self.sims, self.gw, orders, strict=True):
            for name in order:
                sim.load(LoraRef(name, adapter_path(name)), 0.0, waited=True)
                self.registry.set_adapters(worker, sim.loaded())
            sim.reset_counters()

    # --- events ---------------------------------------------------------------------

    def _advance(self, until: float) -> None:
        """Step completions and adapter loads answering, in time order."""
        while self._load_events and self._load_events[0][0] <= until:
            at = self._load_events[0][0]
            super()._advance(at)
            _, _, wid, adapter = heapq.heappop(self._load_events)
            self.now = at
            self._load_done(wid, adapter, at)
        super()._advance(until)

    def _probe(self, now: float) -> None:
        """The health checker's re-read of every worker's adapters (``/v1/models``)."""
        every = self.lora.health_interval_s
        if every <= 0 or not self.config.affinity:
            return
        tick = math.floor(now / every) * every
        if tick > self._probed:
            self._probed = tick
            for sim, worker in zip(self.sims, self.gw, strict=True):
                self.registry.set_adapters(worker, sim.loaded())

    # --- the router's phases ----------------------------------------------------------

    def _arrive(self, req: WorkloadRequest) -> None:
        now = self.now = req.arrival_s
        self._poll_loads(now)
        self._probe(now)
        prepared = self.prepare(req)
        route = prepared.route
        self.core.estimate(route)
        exact = self.exact.request(prepared.prompt_key) if self.exact is not None else None
        workers: list[Worker] = self.gw
        model, adapter = route.model, None
        if self.config.affinity and self.registry.serves_lora():
            model, adapter = route.target(self.registry.served_names())
            workers = self.registry.candidates((), model, adapter)
        path: str | None = None
        setup: dict[str, float] = {}
        if adapter is not None:
            weighs = self.core.policies.live.weighs_setup
            try:
                workers, path, setup = adapter_candidates(
                    self.registry, workers, (), model, adapter, self.config, self.loads, weighs
                )
            except GatewayError as exc:
                self.errors[exc.status] = self.errors.get(exc.status, 0) + 1
                return
        choice = self.core.choose(route, workers, now, exact, None, setup)
        worker = choice.worker
        if path is not None and adapter is not None and adapter not in worker.adapters:
            replica_load(workers, adapter, self.config, self.loads, now)
            self._load(worker, adapter, path, _Waiting(req, prepared, choice, exact), now)
            return
        self._dispatch(req, prepared, choice, exact, now)

    def _load(self, worker: Worker, adapter: str, path: str, wait: _Waiting, now: float) -> None:
        """``load_adapter``: one load per (worker, adapter) at a time; the request waits."""
        key = (worker.id, adapter)
        self._waiting.setdefault(key, []).append(wait)
        if key in self.loads.inflight:
            return
        self.loads.inflight[key] = _LOADING
        self.gateway_loads += 1
        self._seq += 1
        heapq.heappush(self._load_events, (now + self.lora.load_s, self._seq, worker.id, adapter))
        self._paths[key] = path

    def _load_done(self, wid: str, adapter: str, now: float) -> None:
        """The load answers: the worker holds it (its loaded adapters told), the waiting
        requests go."""
        key = (wid, adapter)
        del self.loads.inflight[key]
        k = next(i for i, w in enumerate(self.gw) if w.id == wid)
        result = self.sims[k].load(LoraRef(adapter, self._paths.pop(key)), now, waited=True)
        message = result.error_message or ""
        if result.success or "already loaded" in message:
            self.registry.set_adapters(self.gw[k], self.sims[k].loaded())
            self.loads.timed(self.lora.load_s)
        for wait in self._waiting.pop(key, []):
            self._dispatch(wait.req, wait.prepared, wait.choice, wait.exact, now)

    def _dispatch(
        self,
        req: WorkloadRequest,
        prepared: Prepared,
        choice: Choice,
        exact: ExactRequest | None,
        now: float,
    ) -> None:
        """``Simulation._arrive``'s dispatch, at ``now`` (the arrival, or a load's
        answer), with the adapter's namespace and the worker's implicit reload."""
        route, adapter = prepared.route, req.adapter
        k = self.gw.index(choice.worker)
        available = None  # the longest predicted match, when an index was consulted
        if choice.indexed or exact is not None:  # read before dispatch drops the views
            available = max((v.matched_tokens for v in choice.views), default=0)
        lease = self.core.dispatch(route, choice, now, exact)
        true_matches = [sim.true_match_in(prepared.prompt_key, adapter) for sim in self.sims]
        record = RequestRecord(
            index=req.index, arrival_s=req.arrival_s, worker=choice.worker.id,
            prompt_tokens=prepared.prompt_tokens, output_tokens=req.max_tokens,
            predicted_tokens=choice.matched_tokens, true_match_tokens=true_matches[k],
            best_match_tokens=max(true_matches), available_predicted_tokens=available,
        )  # fmt: skip
        self.records.append(record)
        self.reasons.append(choice.decision.reason)
        self.adapter_of[req.index] = adapter
        rid = f"r{req.index}"
        try:
            self.sims[k].submit_adapter(rid, prepared.prompt_key, req.max_tokens, now, adapter)
        except ValueError:  # an adapter never loaded there, or too long: SGLang's 400
            self.rejected += 1
            lease.release()
            return
        self._live[rid] = _InFlight(record, route, lease, choice, exact, sent_s=now)
        self._start_step(k, now)

    # --- figures ----------------------------------------------------------------------

    def lora_summary(self) -> dict[str, Any]:
        """Adapter loads per worker (the simulator's counters), the gateway's load calls,
        its 404/503 answers, and where the most popular adapter's requests went."""
        counters = [sim.counters() for sim in self.sims]
        ids = [w.id for w in self.gw]
        by_adapter: dict[str, dict[str, int]] = {}
        for r in self.records:
            name = self.adapter_of.get(r.index) or ""
            per = by_adapter.setdefault(name, {})
            per[r.worker] = per.get(r.worker, 0) + 1
        top = max(by_adapter, key=lambda a: sum(by_adapter[a].values()), default="")
        top_split = by_adapter.get(top, {})
        holder = max(top_split, key=lambda w: top_split[w], default="")
        total = len(self.records)
        share = sum(1 for r in self.records if r.worker == holder) / total if total else math.nan
        return {
            "affinity": self.config.affinity,
            "counters": dict(zip(ids, counters, strict=True)),
            "totals": {k: sum(c[k] for c in counters) for k in COUNTERS},
            "gateway_loads": self.gateway_loads,
            "errors": {str(k): v for k, v in sorted(self.errors.items())},
            "rejected": self.rejected,
            "top_adapter": top,
            "top_adapter_requests": {w: top_split.get(w, 0) for w in ids},
            "top_holder": holder,
            "top_holder_share": share,
            "load_estimate_s": self.loads.load_s,
        }


def lora_simulation(
    policy: Policy,
    workers: Sequence[LoraWorker],
    capacity_tokens: int,
    prepare: Prepare,
    model: str,
    lora: LoraSettings,
    adapters: Sequence[str],
    seed: int = 0,
    exact: Callable[[Sequence[str], Callable[[], float]], ReplayExact] | None = None,
) -> LoraSimulation:
    """A warmed-up :class:`LoraSimulation`."""
    sim = LoraSimulation(policy, workers, capacity_tokens, prepare, model, lora, seed, exact)
    sim.warm_up(adapters)
    return sim


def workload_adapters(requests: Sequence[WorkloadRequest], params: dict[str, Any]) -> list[str]:
    """The workload's adapters by popularity, as the live bench warms them up: the
    ``lora-tenants`` tenants' in tenant order (Zipf rank), else the named ones by name."""
    tenants = params.get("tenants")
    if isinstance(tenants, int):
        return [adapter_name(t) for t in range(tenants)]
    return sorted({r.adapter for r in requests if r.adapter})


def table(rows: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """LoRA runs' ``summary.json`` as one Markdown table (``python -m
    loadtests.replay.lora DIR ...``)."""
    lines = [
        "| run | routing | hit rate | ÷ LRU bound | TTFT p50 / p90 / p99 (s) | adapter loads / "
        "implicit reloads per worker (Σ) | top adapter's requests per worker | its busiest "
        "holder's share of all requests | 404 / 503 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in rows:
        lora, t = s["lora"], s["ttft_s"]
        per = " · ".join(f"{c['loads']}/{c['reloads']}" for c in lora["counters"].values())
        totals = f"{lora['totals']['loads']}/{lora['totals']['reloads']}"
        top = " / ".join(str(n) for n in lora["top_adapter_requests"].values())
        errors = lora["errors"]
        lru = s["efficiency"]["lru_pooled"]
        lines.append(
            f"| {name} | {'aware' if lora['affinity'] else 'blind'} | {s['hit_rate']:.3f} "
            f"| {'n/a' if lru is None else f'{lru:.2f}'} "
            f"| {t['p50']:.3f} / {t['p90']:.3f} / {t['p99']:.3f} | {per} ({totals}) | {top} "
            f"| {lora['top_holder_share']:.3f} | {errors.get('404', 0)} / {errors.get('503', 0)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    dirs = list(sys.argv[1:] if argv is None else argv)
    if not dirs:
        print("usage: python -m loadtests.replay.lora OUT_DIR ...", file=sys.stderr)
        return 2
    rows = []
    for d in dirs:
        summary = json.loads((Path(d) / "summary.json").read_text())
        if "lora" not in summary:
            print(f"{d}: not a LoRA run", file=sys.stderr)
            return 2
        rows.append((Path(d).name, summary))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
