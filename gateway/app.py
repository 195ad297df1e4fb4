"""The composition root: builds every component from the config and wires them together.

Contract: :func:`build_app` returns an ``aiohttp`` application whose components are
reachable only through the typed keys of ``gateway.http.app_keys``. Components without I/O are
built at once; the client session and everything that uses it are built at startup in a
``cleanup_ctx`` and torn down at shutdown in reverse order (loops cancelled, pending
aborts cancelled, session closed). This module and ``policies.registry`` are the only ones
that know concrete policy classes; nothing here is module-level state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from gateway.config import (
    ConfigError,
    GatewayConfig,
    PolicyConfig,
    parse_prefill_spec,
    validate_worker_url,
)
from gateway.config.allowlist import HostAllowList
from gateway.config.policyspec import parse_policy_spec
from gateway.config.workerspec import SGLANG, configured_kind, parse_worker_spec
from gateway.exact.choice import load_choice
from gateway.exact.manager import FollowedWorker, KVEventsManager
from gateway.forward.credentials import worker_credentials, worker_key_exposed
from gateway.forward.upstream import UpstreamPool
from gateway.http import admin, app_keys, handlers, tuning
from gateway.http.admission import Admission
from gateway.http.debug import add_telemetry_routes
from gateway.http.observe import RegistrySnapshot, TelemetryHooks, telemetry_middleware
from gateway.http.openapi import add_openapi_route
from gateway.peers.adapters import wire_shared_state
from gateway.routing.cost_model import CostModel
from gateway.routing.decide import RoutingCore, Shortlist, TtftEstimate
from gateway.routing.decisions import DecisionLog
from gateway.routing.policy_set import PolicySet
from gateway.routing.prefill_gate import PrefillGate, prefill_seconds
from gateway.routing.prefill_gate import batch_blocks as gate_batch_blocks
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.prewarm import Membership, MembershipSettings, Stored
from gateway.routing.rehome import ChainLog, PrewarmQueue, PromptStore, RehomeSettings, TokenBudget
from gateway.routing.request import RequestSettings
from gateway.routing.router import Forwarding, Router
from gateway.routing.slot_gate import SlotGate
from gateway.routing.tokens import TokenAccounting
from gateway.tasks import TaskSet
from gateway.telemetry.gates import GateCollector
from gateway.telemetry.hub import Telemetry, TelemetryConfig
from gateway.telemetry.membership import MembershipTelemetry
from gateway.telemetry.tracing import TracingConfig
from gateway.workers.engine_load import LoadPoller
from gateway.workers.health import HealthChecker
from gateway.workers.outlier import OutlierDetector
from gateway.workers.registry import DECODE, PREFILL, Worker, WorkerRegistry
from gateway.workers.slow_start import SlowStart
from policies.base import Policy
from policies.min_ttft import MinTtftPolicy
from policies.registry import POLICIES, create_policy

# sglang-router's cache_aware flags, handed to any policy whose constructor takes them.
_COMPAT_PARAMS = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")
OUTLIER_SWEEP_S = 0.5  # how soon an expired ejection is lifted


def make_policy(cfg: PolicyConfig) -> Policy:
    """The configured policy; ConfigError names the problem (unknown name, bad params)."""
    return make_named_policy(cfg, cfg.name, cfg.params, "policy.params", "policy.name")


def make_named_policy(
    cfg: PolicyConfig, name: str, extra: Mapping[str, Any], where: str, name_key: str = ""
) -> Policy:
    """Policy ``name`` with the compatible flags of ``cfg`` and ``extra`` parameters;
    ConfigError names ``name_key`` (else ``where``) for an unknown name, ``where`` for
    parameters it refuses."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"{name_key or where}: unknown policy {name!r}")
    accepted = inspect.signature(cls).parameters
    params: dict[str, Any] = {k: getattr(cfg, k) for k in _COMPAT_PARAMS if k in accepted}
    params.update(extra)
    try:
        return create_policy(name, **params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _prefill_policy(config: GatewayConfig) -> PolicyConfig:
    """The policy of the routing core: ``policy``, or in PD mode ``pd.prefill_policy``
    when set (the prefill side is where the prefix cache is)."""
    pd = config.pd
    if pd.enabled and pd.prefill_policy and pd.prefill_policy != config.policy.name:
        return dataclasses.replace(config.policy, name=pd.prefill_policy, params={})
    return config.policy


def make_decode_core(config: GatewayConfig, core: RoutingCore) -> RoutingCore | None:
    """PD mode's second core: ``pd.decode_policy`` over the decode workers (the prefix
    index and cost model are the prefill core's; a decode policy that ignores the match,
    the default, never reads them). None outside PD mode."""
    if not config.pd.enabled:
        return None
    cfg = PolicyConfig(name=config.pd.decode_policy, seed=config.policy.seed)
    return RoutingCore(
        make_policy_set(cfg), core.index, core.costs, random.Random(cfg.seed), core.tokens
    )


def make_policy_set(cfg: PolicyConfig) -> PolicySet:
    """The live policy, its shadows and its A/B arm; ConfigError names the problem."""
    shadows = []
    for i, spec in enumerate(cfg.shadows):
        name, params = _spec(spec, f"policy.shadows[{i}]")
        shadows.append(make_named_policy(cfg, name, params, f"policy.shadows[{i}]"))
    ab = None
    if cfg.ab_policy:
        name, params = _spec(cfg.ab_policy, "policy.ab_policy")
        ab = make_named_policy(cfg, name, params, "policy.ab_policy")
    return PolicySet(make_policy(cfg), tuple(shadows), ab, cfg.ab_fraction if ab else 0.0)


def make_model_policy_sets(config: GatewayConfig) -> dict[str, PolicySet]:
    """Per ``models:`` entry with a policy of its own, its set (no shadows, no A/B arm:
    those stay top-level); ConfigError names ``models.<name>.policy.*``."""
    sets: dict[str, PolicySet] = {}
    for model, entry in config.models.items():
        if entry.policy is not None:
            cfg, where = entry.policy.as_policy(), f"models.{model}.policy"
            params_key, name_key = f"{where}.params", f"{where}.name"
            policy = make_named_policy(cfg, cfg.name, cfg.params, params_key, name_key)
            sets[model] = PolicySet(policy)
    return sets


def _spec(spec: str, where: str) -> tuple[str, dict[str, Any]]:
    try:
        return parse_policy_spec(spec)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def ttft_estimate() -> TtftEstimate:
    """The yardstick shadow comparisons are read with: ``min_ttft``'s TTFT model."""
    model = MinTtftPolicy()
    return lambda view, prompt_tokens: model.estimate(view, prompt_tokens)[0]


def build_app(
    config: GatewayConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> web.Application:
    if worker_key_exposed(config.server):
        raise ConfigError(
            "server.worker_api_key needs server.admin_api_key: without it any client may "
            "add a worker (POST /workers) and receive the worker key with its first probe"
        )
    telemetry = make_telemetry(config)
    # The server's middleware first: it sets the request id telemetry reads.
    app = web.Application(
        client_max_size=config.server.max_payload_size,
        middlewares=[handlers.make_middleware(config), telemetry_middleware(telemetry)],
    )
    registry = WorkerRegistry(config.outlier.panic_threshold, clock, dp_aware=config.dp_aware)
    for spec in config.workers:
        url, kind = parse_worker_spec(spec)
        registry.add(validate_worker_url(url), kind or configured_kind(config.worker_kind))
    for spec in config.pd.prefill:  # PD mode (validated: these are the only workers)
        url, port = parse_prefill_spec(spec)
        registry.add(url, SGLANG, PREFILL, port)
    for spec in config.pd.decode:
        registry.add(validate_worker_url(spec.strip()), SGLANG, DECODE)
    req = config.request
    app[app_keys.CONFIG] = config
    app[app_keys.REGISTRY] = registry
    app[app_keys.SETTINGS] = RequestSettings(
        chars_per_token=req.chars_per_token,
        block_chars=req.block_chars,
        routing_key_headers=tuple(h.lower() for h in req.routing_key_headers),
        routing_key_from_user=req.routing_key_from_user,
    )
    app[app_keys.ADMISSION] = Admission(config.admission)
    app[app_keys.DECISIONS] = DecisionLog(config.decisions.ring_size)
    app[app_keys.TASKS] = TaskSet()
    app[app_keys.TELEMETRY] = telemetry
    policies = make_policy_set(_prefill_policy(config))
    app[tuning.TUNING] = telemetry.tuning
    seeded = rng or random.Random(config.policy.seed)
    per_model = make_model_policy_sets(config)
    app.cleanup_ctx.append(lambda a: _runtime(a, policies, seeded, per_model))
    handlers.add_routes(app)
    admin.add_routes(app)
    app[admin.ALLOWLIST] = HostAllowList(config.server.worker_allowlist)
    tuning.add_routes(app)
    add_openapi_route(app)
    add_telemetry_routes(app, telemetry=telemetry, decisions=app[app_keys.DECISIONS])
    return app


def make_telemetry(config: GatewayConfig) -> Telemetry:
    t = config.telemetry
    return Telemetry(
        TelemetryConfig(
            metrics=t.metrics,
            tracing=TracingConfig(
                exporter=t.tracing_exporter,  # type: ignore[arg-type]
                sampling_ratio=t.tracing_sampling_ratio,
                service_name=t.tracing_service_name,
                otlp_endpoint=t.otlp_endpoint,
            ),
        )
    )


def _session(config: GatewayConfig) -> aiohttp.ClientSession:
    # One session for the app's life, for probes, polls, aborts and model lists (the
    # request path uses the leaner gateway.forward.upstream pool). No global connection cap;
    # per worker, enough kept-alive connections for its concurrency.
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=config.server.connections_per_worker, keepalive_timeout=60.0
    )
    # auto_decompress off: bodies are relayed byte for byte, encoding header included.
    # No cookie jar: workers set no cookies, and filtering them costs every request.
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
        headers=worker_credentials(config.server).session_headers(),  # the worker key
    )


def make_kv_events(
    config: GatewayConfig,
    registry: WorkerRegistry,
    session: aiohttp.ClientSession,
    allowlist: HostAllowList | None = None,
) -> KVEventsManager | None:
    """Exact mode over the registry's workers (``kv_events.enabled`` auto or true), or
    None when it is off. Which workers it follows, and why not the others:
    :mod:`gateway.exact.manager`; ``allowlist``: the worker URLs' (events are read from
    a worker's own host or from an allowed one)."""
    k = config.kv_events
    if k.enabled == "false":
        return None
    return KVEventsManager(
        k,
        load_choice(k),
        lambda: [
            FollowedWorker(w.id, w.url, w.kind, w.metadata.models | _named(w.metadata.model))
            for w in registry
        ],
        session,
        clock=registry.clock,
        allowlist=allowlist,
        rank_targets=lambda wid: len(w.ranks) if (w := registry.get(wid)) else 0,
    )


def _named(model: str | None) -> frozenset[str]:
    return frozenset() if model is None else frozenset((model,))


@dataclass(frozen=True, slots=True)
class _Routing:
    """The routing state the runtime builds: prefix index, cost model, the gates."""

    index: PrefixIndex
    costs: CostModel
    slots: SlotGate
    tokens: TokenAccounting
    prefill: PrefillGate


def _soon(callback: Callable[[], None]) -> Callable[[], None]:
    """A schedule that runs ``callback`` at the running event loop's next turn (at once
    when no loop runs: a tool driving the gateway's objects by hand)."""

    def schedule() -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            callback()
            return
        loop.call_soon(callback)

    return schedule


def _routing_state(config: GatewayConfig, registry: WorkerRegistry) -> _Routing:
    block_tokens = config.request.block_chars / config.request.chars_per_token  # the prior
    index = PrefixIndex(
        block_tokens=block_tokens,
        max_blocks_per_worker=max(
            1, config.prefix_index.max_tree_size // config.request.block_chars
        ),
        clock=registry.clock,
    )
    # a dispatch's index bookkeeping waits for the event loop's next turn (see
    # "Deferred recording" in gateway.routing.prefix_index)
    index.defer(_soon(index.flush))
    costs = CostModel()

    def seconds_per_block(worker_id: str) -> float | None:
        if not costs.calibrated(worker_id):
            return None
        return (costs.cost(worker_id).prefill_per_token_s or 0.0) * index.block_tokens(worker_id)

    slots = SlotGate(index, config.prefix_index.slot_wait_s, seconds_per_block=seconds_per_block)

    def prefill_s(worker_id: str, blocks: int) -> float | None:
        """The cost model's time to prefill ``blocks`` more blocks there, behind its queue."""
        worker = registry.get(worker_id)
        queued = 0 if worker is None else worker.queued_prefill_tokens
        return prefill_seconds(costs, worker_id, blocks * index.block_tokens(worker_id), queued)

    def batch_blocks(worker_id: str) -> int:
        return gate_batch_blocks(index.block_tokens(worker_id))

    prefill = PrefillGate(
        index,
        config.prefix_index.prefill_wait_s,
        prefill_s=prefill_s,
        batch_blocks=batch_blocks,
    )
    tokens = TokenAccounting(
        config.request.chars_per_token,
        config.request.block_chars,
        on_worker_ratio=index.set_block_tokens,
    )
    return _Routing(index, costs, slots, tokens, prefill)


def _follow_membership(
    routing: _Routing,
    registry: WorkerRegistry,
    health: HealthChecker,
    load: LoadPoller,
    forget_elsewhere: Callable[[Worker], None],
) -> None:
    """Capacity learnt from probes and polls reaches the index; a removed worker is
    forgotten everywhere."""
    index = routing.index

    def set_capacity(worker: Worker) -> None:
        meta = worker.metadata
        if meta.capacity_tokens or meta.max_sequences:
            # a sequence bound alone (no context size told) leaves the block bound as is;
            # a DP rank's capacity is per rank (SGLang reports it per rank)
            for target in worker.targets():
                index.set_capacity(target.id, meta.capacity_tokens or None, meta.max_sequences)
                # HiCache's host tier (None: none, or no longer: its host blocks go)
                index.set_host_capacity(target.id, meta.host_capacity_tokens)

    def forget_target(target: Worker) -> None:
        routing.tokens.forget_worker(target.id)
        routing.slots.forget_worker(target.id)
        routing.prefill.forget_worker(target.id)
        index.forget_worker(target.id)
        routing.costs.forget_worker(target.id)

    def forget(worker: Worker) -> None:
        load.forget(worker)
        forget_elsewhere(worker)

    health.on_metadata.append(set_capacity)
    load.on_capacity.append(set_capacity)
    registry.on_target_removed(forget_target)
    registry.on_removed(forget)


def make_membership(
    config: GatewayConfig,
    app: web.Application,
    core: RoutingCore,
    index: PrefixIndex,
    session: aiohttp.ClientSession,
) -> Membership:
    """Drains that re-home, joins that ramp and pre-warm (``gateway.routing.prewarm``):
    the chain log and slow start set on ``core``, the prompt store and budget when
    ``prewarm.prompt_store_bytes`` opts in; removed workers forgotten."""
    registry, p = app[app_keys.REGISTRY], config.prewarm
    chains: ChainLog[Stored] | None = None
    queue = None
    if config.prefix_index.recent_chains > 0:
        store = None
        if p.prompt_store_bytes > 0:
            store = PromptStore[Stored](p.prompt_store_bytes, lambda s: len(s[1]))
            queue = PrewarmQueue(
                TokenBudget(p.tokens_per_s, p.burst_tokens, registry.clock()), p.max_in_flight
            )
        chains = ChainLog(
            index.capacity_blocks,
            max_chains=config.prefix_index.recent_chains,
            store=store,
            payload=lambda req: (req.kind, req.body),
        )
        core.chains = chains
        registry.on_target_removed(lambda t: chains.forget_worker(t.id))
    s = config.slow_start
    slow = SlowStart(s.window_s, s.aggression, s.min_factor) if s.window_s > 0 else None
    core.gate = slow
    rehome = RehomeSettings(
        recent_s=config.drain.recent_s,
        prewarm=True,
        prewarm_recent_s=p.recent_s,
        min_uses=config.drain.min_uses,
        returning_share=config.drain.returning_share,
    )
    settings = MembershipSettings(
        rehome,
        drain_deadline_s=config.drain.deadline_s,
        join_prefixes=s.prewarm_prefixes,
        join_deadline_s=config.drain.deadline_s,
        timeout_s=p.timeout_s,
    )
    membership = Membership(
        registry=registry, index=index, chains=chains, queue=queue, settings=settings,
        request_settings=app[app_keys.SETTINGS], session=session, slow_start=slow,
        hooks=MembershipTelemetry(app[app_keys.TELEMETRY].registry),
    )  # fmt: skip
    registry.on_removed(membership.left)
    return membership


def _loops(
    config: GatewayConfig,
    registry: WorkerRegistry,
    index: PrefixIndex,
    health: HealthChecker,
    load: LoadPoller,
    outlier: OutlierDetector,
) -> TaskSet:
    loops = TaskSet()
    loops.spawn(health.run(), "health")
    if config.load.poll_interval_s > 0:
        loops.spawn(load.run(), "load")
    loops.spawn(_every(OUTLIER_SWEEP_S, outlier.sweep), "outlier")
    loops.spawn(
        _every(
            config.prefix_index.eviction_interval_s,
            lambda: index.evict_idle(registry.clock(), config.prefix_index.max_idle_s),
        ),
        "index",
    )
    return loops


def _pool(config: GatewayConfig) -> UpstreamPool:
    s = config.server
    return UpstreamPool(
        s.connect_timeout_s,
        max_idle_per_worker=s.connections_per_worker,
        first_byte_timeout_s=s.first_byte_timeout_s,
        read_idle_timeout_s=s.stream_idle_timeout_s,
        client_write_timeout_s=s.client_write_timeout_s,
        max_body_bytes=s.max_response_size,
        max_event_bytes=s.max_event_size,
    )


def _policy_control(
    config: GatewayConfig, core: RoutingCore, telemetry: Telemetry, snapshot: RegistrySnapshot
) -> tuning.PolicyControl:
    """Live policy changes over ``core``; the dashboard's policy name follows them."""

    def changed(new: PolicySet) -> None:
        snapshot.policy = new.live.name

    return tuning.PolicyControl(config.policy, core, make_policy_set, telemetry.tuning, changed)


async def _runtime(
    app: web.Application,
    policies: PolicySet,
    rng: random.Random,
    per_model: Mapping[str, PolicySet],
) -> AsyncIterator[None]:
    """The runtime's whole life in one place (~70 lines, on purpose): what is built here
    is torn down in the ``finally`` in reverse order, and reading both halves side by
    side is how one checks nothing is left running."""
    config = app[app_keys.CONFIG]
    registry = app[app_keys.REGISTRY]
    telemetry = app[app_keys.TELEMETRY]
    session = _session(config)
    routing = _routing_state(config, registry)
    index = routing.index
    pool = _pool(config)
    health = HealthChecker(config.health, registry, session)
    load = LoadPoller(config.load, registry, session, config.health.timeout_s)
    outlier = OutlierDetector(config.outlier, registry, registry.clock)
    exact = make_kv_events(config, registry, session, app[admin.ALLOWLIST])
    if exact is not None:
        await exact.start()
    snapshot = RegistrySnapshot(
        registry,
        index=index,
        admission=app[app_keys.ADMISSION],
        policy=policies.live.name,
        modes=exact,
        tokens=routing.tokens,
    )
    telemetry.use_snapshot(snapshot)
    gates = {"slot": routing.slots.stats, "prefill": routing.prefill.stats}
    telemetry.registry.register(GateCollector(gates))
    outlier.on_eject.append(lambda w: telemetry.worker_ejected(w.id))
    registry.on_target_removed(lambda t: telemetry.forget_worker(t.id))
    _follow_membership(routing, registry, health, load, lambda w: pool.forget(w.url))
    app[app_keys.SESSION] = session
    app[app_keys.HEALTH] = health
    shared = wire_shared_state(app, config.redis, index, registry, health.check_now)
    credentials = worker_credentials(
        config.server, gateway_checks_keys=handlers.make_authenticator(config).enabled
    )
    core = RoutingCore(
        policies,
        index if shared is None else shared.index,
        routing.costs,
        rng,
        routing.tokens,
        ttft_estimate(),
        model_policies=per_model,
    )
    core.tiers = index  # the host tier of the approximate index (HiCache workers)
    core.shortlist = Shortlist(config.policy.shortlist_above, config.policy.shortlist_least_loaded)
    app[tuning.POLICY_CONTROL] = _policy_control(config, core, telemetry, snapshot)
    app[app_keys.ROUTER] = Router(
        config=config,
        registry=registry,
        core=core,
        outlier=outlier,
        forwarding=Forwarding(pool, session, app[app_keys.TASKS].spawn, credentials),
        decisions=app[app_keys.DECISIONS],
        hooks=TelemetryHooks(telemetry),
        slots=routing.slots,
        exact=exact,
        prefill=routing.prefill,
        decode_core=make_decode_core(config, core),
    )
    membership = app[admin.MEMBERSHIP] = make_membership(config, app, core, index, session)
    if shared is not None:
        shared.start()
    loops = _loops(config, registry, index, health, load, outlier)
    loops.spawn(membership.run(), "prewarm")
    try:
        yield
    finally:
        if shared is not None:
            await shared.stop()
        await loops.close()
        await app[app_keys.TASKS].close()
        if exact is not None:
            await exact.close()
        await pool.close()
        await session.close()
        telemetry.shutdown()


async def _every(interval_s: float, action: Callable[[], object]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        action()
