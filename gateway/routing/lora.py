"""LoRA adapters on the request path: which workers may take a request naming one, and
the load call when none of them has it loaded.

Contract:
- The adapter a request names is :meth:`gateway.routing.request.RouteRequest.target`'s;
  the workers' loaded adapters are the registry's (``Worker.adapters``, re-read by the
  health checker from ``/v1/models``); :meth:`WorkerRegistry.candidates` already keeps only
  the workers holding the adapter whenever one of them is healthy.
- SGLang 0.5.23 answers 400 ("Got LoRA adapter that has never been loaded") to a request
  naming an adapter it never loaded, and reloads by itself one it loaded before (then
  evicted or unloaded); the gateway cannot see the latter, so when no candidate holds the
  adapter, ``lora.unloaded``:
  - ``load``: the candidates are the LoRA-enabled ones (the policy picks among them by
    prefix and load as usual); a chosen worker that lacks the adapter is sent
    ``POST /load_lora_adapter {"lora_name", "lora_path"}`` first, with the path the adapter
    was last seen loaded from on any worker ("already loaded" counts as success). Its answer
    (``loaded_adapters``) becomes that worker's adapter set at once;
  - ``reject``, or an adapter never seen on any worker, or no LoRA-enabled worker: OpenAI's
    404 ``model_not_found`` naming the adapter.
- Hardening (workers and clients are hostile, docs/SECURITY.md): the path loaded is
  ``lora.paths``' when the operator names the adapter, else a worker's only with
  ``lora.paths_from_workers`` and only while no two workers disagree on it; a load goes
  only to workers serving the base model the adapter was seen on; one load per adapter
  at a time (concurrent requests for it wait for that load, on that worker); loads are
  rate-bounded fleet-wide (``lora.load_rate_per_s``, ``lora.load_burst``: 503 beyond);
  a load's answer is read up to ``MAX_LOAD_ANSWER`` bytes, and a 200 whose
  ``loaded_adapters`` lacks the adapter (or ``success: false``) is a failed load.
- The time a load takes is counted in the choice: each candidate lacking the adapter is
  offered with the estimated load time (``WorkerView.setup_s``; the running mean of the
  loads the gateway timed, doubled on a worker whose adapter slots are full: the load
  evicts an adapter in use). With ``lora.replicate`` (off by default) and a policy that
  weighs it (``min_ttft``), the workers that lack an adapter its holders have are offered
  too, so an idle worker loading it can beat a hot adapter's busy holders: the adapter is
  then replicated (within the load rate).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import aiohttp
import orjson

from gateway.config import LoraConfig
from gateway.errors import GatewayError, one_line
from gateway.workers.registry import Worker, WorkerRegistry, adapter_name_ok

log = logging.getLogger(__name__)

LOAD_PATH = "/load_lora_adapter"
MAX_LOAD_ANSWER = 1 << 20  # bytes of a load's answer read; beyond, the load failed
_SHOWN = 128  # characters of a client-named adapter quoted back in an error


def _shown(adapter: str) -> str:
    """A client-named adapter as quoted back (and so logged): cut, its control characters
    and line separators escaped (a CR or LF would forge a log line)."""
    cut = adapter if len(adapter) <= _SHOWN else adapter[:_SHOWN] + "…"
    return one_line(cut)


def adapter_not_found(adapter: str, why: str = "is not loaded on any worker") -> GatewayError:
    """OpenAI's answer to an adapter no worker can serve: 404, ``model_not_found``."""
    return GatewayError(
        404,
        f"The LoRA adapter `{_shown(adapter)}` {why}.",
        param="model",
        err_type="invalid_request_error",
        code="model_not_found",
    )


DEFAULT_LOAD_S = 1.0  # an adapter load's duration until the gateway has timed one
_LOAD_EWMA = 0.2  # weight of each newly timed load in the running estimate


@dataclass
class AdapterLoads:
    """The gateway's load calls: those in flight, by (worker id, adapter), the token
    bucket bounding how many start, and how long one takes (the running mean of the
    loads it timed, ``DEFAULT_LOAD_S`` before the first). One per router (it owns it)."""

    inflight: dict[tuple[str, str], asyncio.Task[str | None]] = field(default_factory=dict)
    tokens: float = -1.0  # -1: full (set at first use)
    stamp: float = 0.0
    load_s: float = DEFAULT_LOAD_S

    def _refill(self, config: LoraConfig, now: float) -> None:
        if self.tokens < 0:
            self.tokens = float(config.load_burst)
        else:
            elapsed = max(0.0, now - self.stamp)
            self.tokens = min(config.load_burst, self.tokens + elapsed * config.load_rate_per_s)
        self.stamp = now

    def available(self, config: LoraConfig, now: float) -> bool:
        """Whether a load could start now (the bucket is not taken from)."""
        if config.load_rate_per_s <= 0:
            return True
        self._refill(config, now)
        return self.tokens >= 1.0

    def take(self, config: LoraConfig, now: float) -> bool:
        if config.load_rate_per_s <= 0:
            return True
        self._refill(config, now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def timed(self, seconds: float) -> None:
        """A successful load took ``seconds``: fold it into the estimate."""
        self.load_s += _LOAD_EWMA * (max(0.0, seconds) - self.load_s)


@functools.lru_cache(maxsize=4)
def configured_paths(entries: tuple[str, ...]) -> Mapping[str, str]:
    """``lora.paths`` ("NAME=PATH" entries, validated at load) as name → path."""
    pairs = (entry.partition("=") for entry in entries)
    return MappingProxyType({name: path for name, _, path in pairs})


def _source(
    adapter: str, config: LoraConfig, registry: WorkerRegistry
) -> tuple[str | None, str | None, str]:
    """(the path to load ``adapter`` from, the base model it belongs to, why none)."""
    configured = configured_paths(config.paths).get(adapter)
    if configured:
        return configured, None, ""
    known = registry.adapter_source(adapter) if adapter_name_ok(adapter) else None
    if known is None:
        return None, None, "is not loaded on any worker"
    if not config.paths_from_workers:
        return None, None, "is not loaded on any worker and has no configured path"
    if known.conflicted:
        return None, None, "is not loaded on any worker and workers disagree on its path"
    return known.path, known.parent, ""


def lora_candidates(
    workers: Sequence[Worker],
    adapter: str,
    config: LoraConfig,
    registry: WorkerRegistry,
    loads: AdapterLoads,
    others: Sequence[Worker] = (),
) -> tuple[list[Worker], str | None, dict[str, float]]:
    """(the candidates for a request naming ``adapter``, the path to load it from on a
    chosen worker that lacks it: None when every candidate holds it, and the estimated
    load time per candidate that lacks it). Raises the 404, or 503 when the load rate is
    spent. ``others``: workers lacking the adapter to offer beside its holders (for a
    policy that weighs the load time: a hot adapter's busy holders against an idle worker
    that would load it, which replicates it), when a load could start now."""
    if all(adapter in w.adapters for w in workers):
        if not others or config.unloaded != "load" or not loads.available(config, registry.clock()):
            return list(workers), None, {}
        path, parent, _ = _source(adapter, config, registry)
        able = [w for w in others if _may_load(w, parent)] if path is not None else []
        if not able:
            return list(workers), None, {}
        return [*workers, *able], path, {w.id: _load_cost(w, loads) for w in able}
    if config.unloaded == "reject":
        raise adapter_not_found(adapter)
    path, parent, why = _source(adapter, config, registry)
    if path is None:
        raise adapter_not_found(adapter, why)
    able = [w for w in workers if _may_load(w, parent)]
    if not able:
        raise adapter_not_found(adapter)
    loading = [w for w in able if (w.id, adapter) in loads.inflight]
    if loading:  # it will be there soon: wait for that load rather than start another
        return loading, path, {}
    if not loads.take(config, registry.clock()):
        raise GatewayError(
            503,
            "LoRA adapter loads are rate-limited; retry shortly",
            err_type="server_error",
            code="lora_load_rate_limited",
            retry_after=1.0,
        )
    return able, path, {w.id: _load_cost(w, loads) for w in able if adapter not in w.adapters}


def _load_cost(worker: Worker, loads: AdapterLoads) -> float:
    """The time a load on ``worker`` costs: one load, and a second when its adapter
    slots are full (``max_loaded_loras``), since the load evicts an adapter that was
    kept because it is used, so its next request loads it again."""
    bound = worker.metadata.max_loaded_loras
    full = bound is not None and len(worker.adapters) >= bound
    return loads.load_s * (2.0 if full else 1.0)


def adapter_candidates(
    registry: WorkerRegistry,
    workers: Sequence[Worker],
    excluded: Sequence[str],
    model: str | None,
    adapter: str,
    config: LoraConfig,
    loads: AdapterLoads,
    weighs_setup: bool,
) -> tuple[list[Worker], str | None, dict[str, float]]:
    """:func:`lora_candidates` of ``workers`` (the registry's candidates for ``model`` and
    ``adapter``, minus ``excluded``), offered beside its holders the workers lacking the
    adapter when the policy weighs the load time (``weighs_setup``) and loads are allowed:
    the live router's and the offline replay's one call."""
    others: list[Worker] = []
    if config.replicate and config.unloaded == "load" and weighs_setup:
        others = [w for w in registry.candidates(excluded, model) if adapter not in w.adapters]
    return lora_candidates(workers, adapter, config, registry, loads, others)


def replica_load(
    workers: Sequence[Worker], adapter: str, config: LoraConfig, loads: AdapterLoads, now: float
) -> None:
    """A load of ``adapter`` is about to start on a chosen worker lacking it: when its
    holders were among the candidates ``workers`` (a replica), the load rate counts it
    too (:func:`lora_candidates` took a token for a first load only)."""
    if any(adapter in w.adapters for w in workers):
        loads.take(config, now)


def _may_load(worker: Worker, parent: str | None) -> bool:
    """A worker the gateway may load an adapter of base model ``parent`` onto."""
    return worker.metadata.lora_enabled and (parent is None or worker.serves(parent))


async def load_adapter(
    session: aiohttp.ClientSession,
    worker: Worker,
    adapter_path: tuple[str, str],
    config: LoraConfig,
    registry: WorkerRegistry,
    headers: Mapping[str, str],
    loads: AdapterLoads,
) -> str | None:
    """Load the adapter ``(name, path)`` on ``worker``; None when it is there now, else
    why not (in the gateway's words: what the worker said is logged, never relayed).
    Concurrent calls for the same worker and adapter share one load, which runs to its
    end (``lora.load_timeout_s``) even if the request that started it is cancelled."""
    key = (worker.id, adapter_path[0])
    task = loads.inflight.get(key)
    if task is None:
        task = asyncio.ensure_future(
            _load(session, worker, adapter_path, config, registry, dict(headers))
        )
        loads.inflight[key] = task
        started = time.monotonic()

        def done(finished: asyncio.Task[str | None]) -> None:
            if loads.inflight.get(key) is finished:
                del loads.inflight[key]
            if (
                not finished.cancelled()
                and finished.exception() is None
                and finished.result() is None
            ):
                loads.timed(time.monotonic() - started)

        task.add_done_callback(done)
    return await asyncio.shield(task)


async def _read_bounded(resp: aiohttp.ClientResponse) -> bytes | None:
    raw = bytearray()
    async for chunk in resp.content.iter_chunked(65536):
        raw += chunk
        if len(raw) > MAX_LOAD_ANSWER:
            return None
    return bytes(raw)


async def _load(
    session: aiohttp.ClientSession,
    worker: Worker,
    adapter_path: tuple[str, str],
    config: LoraConfig,
    registry: WorkerRegistry,
    headers: Mapping[str, str],
) -> str | None:
    adapter, path = adapter_path
    body = {"lora_name": adapter, "lora_path": path}
    try:
        async with session.post(
            worker.url + LOAD_PATH,
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=config.load_timeout_s),
            allow_redirects=False,
        ) as resp:
            raw = await _read_bounded(resp)
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"{LOAD_PATH} failed: {type(exc).__name__}"
    if raw is None:
        return f"{LOAD_PATH} answered over {MAX_LOAD_ANSWER} bytes"
    answer: object = None
    with contextlib.suppress(orjson.JSONDecodeError):
        answer = orjson.loads(raw)
    fields = answer if isinstance(answer, dict) else {}
    message = fields.get("error_message")
    already = isinstance(message, str) and "already loaded" in message
    if (status != 200 or fields.get("success") is False) and not already:
        shown = message[:200] if isinstance(message, str) else raw[:200]
        log.warning("worker %s refused to load adapter %r: %d %r", worker.id, adapter[:128],
                    status, shown)  # fmt: skip
        return f"{LOAD_PATH} answered {status}"
    loaded = fields.get("loaded_adapters")
    if isinstance(loaded, dict) and all(isinstance(v, str) for v in loaded.values()):
        if adapter not in loaded:
            return f"{LOAD_PATH} answered {status} without the adapter in loaded_adapters"
        registry.set_adapters(worker, {str(k): v for k, v in loaded.items()})
    else:
        registry.set_adapters(worker, {**worker.adapters, adapter: path})
    return None if adapter in worker.adapters else f"{LOAD_PATH}: the adapter was not kept"
