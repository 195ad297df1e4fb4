"""The shared state's adapters to the gateway core, so wiring it in takes a few lines.

- :class:`ReplicatingIndex` is what the router gets as its prefix index when Redis is
  configured: ``match`` and ``correct`` go to the local index; ``record`` records locally
  and queues the recording for the peers (O(1), no I/O). It also serves the shared
  state's reads of the local index (``workers``, ``blocks``, peers' ``record``).
- :class:`RegistryFleet` is the shared state's view of the worker registry: local load
  figures out, peers' summed figures in (onto each worker's ``peer_*`` counters, which
  ``Worker.view`` adds to its own), and the worker set as ``url → "state kind"``.
- :class:`SharedStateCollector` exports the shared state's figures to Prometheus at
  scrape time (``gateway_shared_state_*``).
- :func:`wire_shared_state` is what the composition root calls: with ``redis.url`` set it
  builds the shared state, keeps it under the app key :data:`SHARED_STATE`, registers
  its metrics, and returns a :class:`SharedRuntime` (the router's index, start, stop);
  without, None.

Contract: used from the event loop's thread only, like everything they adapt.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gateway.config import RedisConfig, validate_worker_url
from gateway.config.allowlist import HostAllowList, NotAllowed
from gateway.config.workerspec import KIND_NAMES
from gateway.http import app_keys
from gateway.http.admin import ALLOWLIST
from gateway.peers.codec import LoadFigures
from gateway.peers.state import ACTIVE, DRAINING, SharedSettings, SharedState
from gateway.routing.decide import PrefixMatcher
from gateway.workers.registry import HealthFlag, Worker, WorkerRegistry

log = logging.getLogger(__name__)

SHARED_STATE = web.AppKey("shared_state", SharedState)
_NO_LOAD: LoadFigures = (0, 0, 0)


class LocalIndex(PrefixMatcher, Protocol):
    """The local prefix index, as ``gateway.routing.prefix_index.PrefixIndex`` offers it: what the
    router needs of it, plus what replication reads."""

    def record(
        self, block_hashes: Sequence[int], worker_id: str, now: float | None = None, *,
        pin: bool = True, held: int | None = None,
    ) -> None: ...  # fmt: skip
    def workers(self) -> list[str]: ...
    def blocks(self, worker_id: str) -> Sequence[int]: ...


class ReplicatingIndex:
    """The local prefix index, with recordings also queued for the peers."""

    def __init__(self, index: LocalIndex) -> None:
        self._index = index
        self._shared: SharedState | None = None

    def attach(self, shared: SharedState) -> None:
        """Start queueing recordings for ``shared`` (built after this adapter)."""
        self._shared = shared

    def match(self, block_hashes: Sequence[int]) -> Mapping[str, int]:
        return self._index.match(block_hashes)

    def record(
        self,
        block_hashes: Sequence[int],
        worker_id: str,
        now: float | None = None,
        *,
        held: int | None = None,
    ) -> None:
        self._index.record(block_hashes, worker_id, now, held=held)
        if self._shared is not None:
            self._shared.record(block_hashes, worker_id)

    def apply(self, block_hashes: Sequence[int], worker_id: str) -> None:
        """A peer's recording: local only, never sent back out, and not pinned (its end
        is never heard of here: a pin would hold its block list for ``pin_ttl_s``)."""
        self._index.record(block_hashes, worker_id, pin=False)

    def correct(
        self,
        worker_id: str,
        block_hashes: Sequence[int],
        predicted_blocks: int,
        reported_tokens: int,
        now: float | None = None,
    ) -> Any:
        return self._index.correct(worker_id, block_hashes, predicted_blocks, reported_tokens, now)

    def release(
        self, worker_id: str, block_hashes: Sequence[int], now: float | None = None
    ) -> None:
        self._index.release(worker_id, block_hashes, now)

    def free_sequences(self, worker_id: str) -> int | None:
        return self._index.free_sequences(worker_id)

    def workers(self) -> list[str]:
        return self._index.workers()

    def blocks(self, worker_id: str) -> Sequence[int]:
        return self._index.blocks(worker_id)


class PeerIndexTarget:
    """The shared state's index target: peers' recordings are applied, not re-queued."""

    def __init__(self, index: ReplicatingIndex) -> None:
        self._index = index

    def record(self, block_hashes: Sequence[int], worker_id: str) -> None:
        self._index.apply(block_hashes, worker_id)

    def workers(self) -> list[str]:
        return self._index.workers()

    def blocks(self, worker_id: str) -> Sequence[int]:
        return self._index.blocks(worker_id)


def _state_of(worker: Worker) -> str:
    state = DRAINING if worker.draining else ACTIVE
    return f"{state} {worker.kind}" if worker.kind_known else state


class RegistryFleet:
    """The registry as the shared state's fleet target (see the module contract).

    ``add_worker(url, kind)`` registers a worker the peers added (the composition root
    passes one that validates the URL and probes the worker at once)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        add_worker: Callable[[str, str | None], Worker | None],
    ) -> None:
        self._registry = registry
        self._add_worker = add_worker

    def local_load(self) -> dict[str, LoadFigures]:
        return {
            w.id: (w.in_flight, w.queued_prefill_tokens, w.decoding_requests)
            for w in self._registry.targets()  # a DP rank's figures are its own
        }

    def set_peer_load(self, load: Mapping[str, LoadFigures]) -> None:
        for w in self._registry.targets():
            figures = load.get(w.id, _NO_LOAD)
            w.peer_in_flight, w.peer_queued_prefill_tokens, w.peer_decoding_requests = figures

    def worker_states(self) -> dict[str, str]:
        return {w.url: _state_of(w) for w in self._registry}

    def apply_workers(self, states: Mapping[str, str], keep: frozenset[str]) -> None:
        registry = self._registry
        for worker in registry:
            if worker.url not in states and worker.url not in keep:
                registry.remove(worker.id)
        for url, value in states.items():
            if url in keep:
                continue
            state, _, kind = value.partition(" ")
            target = registry.find(url) or self._add_worker(url, kind or None)
            if target is None:
                continue
            if state == DRAINING:
                target.flags.add(HealthFlag.DRAINING)
            else:
                target.flags.discard(HealthFlag.DRAINING)

    def knows(self, worker_id: str) -> bool:
        return self._registry.get(worker_id) is not None


def _cumulative(counts: Sequence[int], bounds: Sequence[float]) -> list[tuple[str, float]]:
    buckets, running = [], 0
    for le, count in zip([repr(float(b)) for b in bounds] + ["+Inf"], counts, strict=True):
        running += count
        buckets.append((le, float(running)))
    return buckets


class SharedStateCollector:
    """``gateway_shared_state_*`` at scrape time (register on the telemetry registry)."""

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared

    def describe(self) -> Iterator[Metric]:
        return iter(())  # no name clash checks needed: the names are this module's

    def collect(self) -> Iterator[Metric]:
        s = self._shared
        yield GaugeMetricFamily(
            "gateway_shared_state_degraded",
            "1 while Redis is unreachable and routing uses local state only.",
            value=1.0 if s.degraded else 0.0,
        )
        dropped = CounterMetricFamily(
            "gateway_shared_state_dropped",
            "Items not shared because a bounded queue was full.",
            labels=["kind"],
        )
        for kind, count in s.dropped.items():
            dropped.add_metric([kind], count)
        yield dropped
        for name, doc, value in (
            ("published_records", "Recordings this gateway published.", s.published_records),
            ("applied_records", "Peers' recordings applied to the local index.", s.applied_records),
            ("reconnects", "Failed Redis round trips followed by a back-off.", s.reconnects),
        ):
            yield CounterMetricFamily(f"gateway_shared_state_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "gateway_shared_state_peers", "Other gateways seen publishing.", value=s.peer_count
        )
        lag = HistogramMetricFamily(
            "gateway_shared_state_replication_lag_seconds",
            "Recording at a peer to applied here (wall clocks).",
        )
        lag.add_metric([], _cumulative(s.lag.counts, s.lag_bounds), s.lag.sum)
        yield lag


def settings_from(cfg: RedisConfig, env: Mapping[str, str]) -> SharedSettings:
    """The shared state's settings; the password from ``cfg.password_env`` unless the URL
    carries one."""
    if cfg.url is None:
        raise ValueError("redis.url is not set")
    return SharedSettings(
        url=cfg.url,
        prefix=cfg.prefix,
        password=env.get(cfg.password_env) or None,
        gateway_id=cfg.gateway_id,
        tick_s=cfg.tick_s,
        load_ttl_s=cfg.load_ttl_s,
        stream_maxlen=cfg.stream_maxlen,
        snapshot_interval_s=cfg.snapshot_interval_s,
        queue_size=cfg.queue_size,
        timeout_s=cfg.timeout_s,
        backoff_max_s=cfg.backoff_max_s,
    )


def build_shared_state(
    cfg: RedisConfig,
    index: LocalIndex,
    registry: WorkerRegistry,
    probe: Callable[[Worker], object],
    env: Mapping[str, str] | None = None,
    *,
    allow: HostAllowList | None = None,
    spawn: Callable[[Coroutine[Any, Any, None]], object] | None = None,
) -> tuple[ReplicatingIndex, SharedState]:
    """The router's index and the shared state (not started: run ``state.run()``).

    ``probe(worker)`` is called for each worker a peer added, so it is checked at once.
    A peer's worker passes the same allow-list as ``POST /workers`` (``allow``): Redis
    is one more way to add a worker, not a way around the SSRF guard. A name that must be
    resolved first is checked in the background (``spawn``) and added once allowed."""
    replicating = ReplicatingIndex(index)
    resolving: set[str] = set()

    def register(url: str, kind: str | None) -> Worker:
        worker, created = registry.add(url, kind if kind in KIND_NAMES else None)
        if created:
            probe(worker)
        return worker

    async def resolve_then_add(url: str, kind: str | None) -> None:
        assert allow is not None
        try:
            await allow.check(url)
        except NotAllowed as exc:
            log.warning("shared state: ignoring worker %s: %s", url, exc)
        else:
            register(url, kind)
        finally:
            resolving.discard(url)

    def add_worker(url: str, kind: str | None) -> Worker | None:
        try:
            url = validate_worker_url(url)
        except ValueError as exc:
            log.warning("shared state: ignoring a worker: %s", exc)
            return None
        verdict = allow.decided(url) if allow is not None else True
        if verdict is None and spawn is not None and url not in resolving:
            resolving.add(url)
            spawn(resolve_then_add(url, kind))
        if not verdict:
            if verdict is False:
                log.warning("shared state: ignoring worker %s: outside the allow-list", url)
            return None
        return register(url, kind)

    settings = settings_from(cfg, os.environ if env is None else env)
    fleet = RegistryFleet(registry, add_worker)
    state = SharedState(settings, PeerIndexTarget(replicating), fleet)
    replicating.attach(state)
    return replicating, state


async def stop_shared_state(state: SharedState, task: asyncio.Task[Any], grace_s: float) -> None:
    """Stop the loop between round trips; cancel it only if it does not stop in time."""
    state.stop()
    done, _ = await asyncio.wait({task}, timeout=grace_s)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)


@dataclass
class SharedRuntime:
    """The shared state as the composition root runs it."""

    index: ReplicatingIndex  # the router's prefix index
    state: SharedState
    stop_grace_s: float
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.state.run(), name="shared")
        self.task.add_done_callback(_log_failure)

    async def stop(self) -> None:
        if self.task is not None:
            await stop_shared_state(self.state, self.task, self.stop_grace_s)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("shared state loop failed", exc_info=task.exception())


def wire_shared_state(
    app: web.Application,
    cfg: RedisConfig,
    index: LocalIndex,
    registry: WorkerRegistry,
    check_now: Callable[[Worker], Coroutine[Any, Any, object]],
) -> SharedRuntime | None:
    """Build the shared state when ``cfg.url`` is set (see the module contract)."""
    if cfg.url is None:
        return None
    tasks = app[app_keys.TASKS]
    replicating, state = build_shared_state(
        cfg,
        index,
        registry,
        lambda w: tasks.spawn(check_now(w), "probe"),
        allow=app.get(ALLOWLIST),
        spawn=lambda coro: tasks.spawn(coro, "allow-list"),
    )
    app[SHARED_STATE] = state
    app[app_keys.TELEMETRY].registry.register(SharedStateCollector(state))
    return SharedRuntime(replicating, state, stop_grace_s=max(2.0, 4 * cfg.timeout_s))
