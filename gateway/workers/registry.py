"""The workers and their runtime state: health flags, leases' counters, load, metadata.

Contract:
- A :class:`Worker` is created by :meth:`WorkerRegistry.add` and lives until removed; its
  id is derived from its URL (stable across restarts, safe in a URL path).
- Health is a set of :class:`HealthFlag` s, one per source, so sources never overwrite
  each other: a worker is *healthy* when it has none; *draining* excludes it from new
  requests whatever the others say.
- ``in_flight``, ``queued_prefill_tokens`` and ``decoding_requests`` are changed only by
  ``gateway.routing.lease.Lease``; the active checker and the outlier detector change the flags;
  the load poller changes ``engine_load``; the shared state (``gateway.peers.state``)
  changes ``peer_in_flight``, ``peer_queued_prefill_tokens`` and ``peer_decoding_requests``
  (other gateways' counts, added in :meth:`Worker.view`).
- :meth:`WorkerRegistry.candidates` applies the panic threshold: when too few workers are
  healthy it returns every non-draining worker, since then the health signals themselves
  are more likely wrong than the whole fleet.
- Listeners registered with :meth:`on_removed` learn of removals (prefix index, cost model).
"""

from __future__ import annotations

import enum
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from policies.base import EngineLoad, WorkerCost, WorkerView

log = logging.getLogger(__name__)


class HealthFlag(enum.Enum):
    """Why a worker is not healthy; each flag has exactly one source."""

    UNCHECKED = "unchecked"  # added, first active probe not yet passed
    CHECK_FAILED = "check_failed"  # active probes failed failure_threshold times
    EJECTED = "ejected"  # passive outlier detection
    DRAINING = "draining"  # operator asked: no new requests, in-flight ones finish


@dataclass(slots=True)
class WorkerMetadata:
    """What the worker tells about itself (read per kind: ``gateway.workers.kinds``)."""

    model: str | None = None  # the name it serves under (served_model_name, else its path)
    # every name a request may use for it (served name, model path, /v1/models ids)
    models: frozenset[str] = frozenset()
    capacity_tokens: int | None = None  # max_total_num_tokens
    page_size: int | None = None
    max_sequences: int | None = None  # prompts it keeps cached when slots bind (llama.cpp)
    lora_enabled: bool = False  # serves LoRA adapters (SGLang's enable_lora)


# LoRA adapters as workers report them (their /v1/models cards, their load answers): a
# hostile worker may report anything, so what is kept is bounded. Names and paths with a
# control character, or longer than these, are dropped; beyond MAX_WORKER_ADAPTERS the
# rest of a worker's list is ignored; the oldest of MAX_ADAPTER_PATHS are forgotten.
MAX_ADAPTER_NAME = 256
MAX_ADAPTER_PATH = 1024
MAX_WORKER_ADAPTERS = 1024
_MAX_ADAPTER_PATHS = 10_000
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def adapter_name_ok(name: object, limit: int = MAX_ADAPTER_NAME) -> bool:
    """A LoRA adapter name (or path, with its own ``limit``) the gateway keeps: a
    non-empty string of at most ``limit`` characters without control characters."""
    return isinstance(name, str) and 0 < len(name) <= limit and not _CONTROL.search(name)


@dataclass(frozen=True, slots=True)
class AdapterSource:
    """Where a LoRA adapter was seen loaded from: what a load call on another worker
    would use. ``conflicted``: two workers reported different paths for the name, so none
    is used (sticky: a worker cannot take over a name others hold by reporting a path of
    its own; the operator's ``lora.paths`` settles it)."""

    path: str
    parent: str | None  # the base model it was seen on (card's parent, else the worker's)
    conflicted: bool = False


_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def worker_id_for(url: str) -> str:
    """``http://127.0.0.1:18001`` → ``127.0.0.1-18001`` (``https-`` prefix for TLS)."""
    parts = urlsplit(url)
    host = _ID_UNSAFE.sub("_", parts.hostname or "").strip("_") or "worker"
    wid = f"{host}-{parts.port}"
    path = _ID_UNSAFE.sub("_", parts.path.strip("/"))
    if path:
        wid = f"{wid}-{path}"
    return f"https-{wid}" if parts.scheme == "https" else wid


class Worker:
    """One worker's mutable state. Only the modules named in the module contract write it."""

    __slots__ = (
        "adapters",
        "added_at",
        "consecutive_5xx",
        "consecutive_connect_errors",
        "decoding_requests",
        "ejected_until",
        "engine_load",
        "flags",
        "health_failures",
        "health_successes",
        "id",
        "in_flight",
        "kind",
        "kind_known",
        "last_ejected_at",
        "load_read_at",
        "metadata",
        "peer_decoding_requests",
        "peer_in_flight",
        "peer_queued_prefill_tokens",
        "queued_prefill_tokens",
        "times_ejected",
        "url",
    )

    def __init__(self, url: str, now: float, kind: str | None = None) -> None:
        self.url = url
        self.id = worker_id_for(url)
        # gateway.workers.kinds name; until an unknown kind is discovered, SGLang's ways
        self.kind = kind or "sglang"
        self.kind_known = kind is not None
        self.added_at = now
        self.flags: set[HealthFlag] = {HealthFlag.UNCHECKED}
        self.in_flight = 0
        self.queued_prefill_tokens = 0
        self.decoding_requests = 0
        # the same three as other gateways last published them (gateway.peers.state);
        # a policy sees the sums
        self.peer_in_flight = 0
        self.peer_queued_prefill_tokens = 0
        self.peer_decoding_requests = 0
        self.metadata = WorkerMetadata()
        # LoRA adapters loaded there, name → path (its /v1/models cards with a parent)
        self.adapters: dict[str, str] = {}
        self.engine_load: EngineLoad | None = None
        self.load_read_at = 0.0
        # active checks: consecutive results since the last flip
        self.health_failures = 0
        self.health_successes = 0
        # outlier detection
        self.consecutive_connect_errors = 0
        self.consecutive_5xx = 0
        self.times_ejected = 0
        self.ejected_until = 0.0
        self.last_ejected_at = 0.0

    @property
    def healthy(self) -> bool:
        return not self.flags

    @property
    def draining(self) -> bool:
        return HealthFlag.DRAINING in self.flags

    def serves(self, model: str) -> bool:
        """Whether a request for ``model`` may come here (by any name the worker told)."""
        meta = self.metadata
        return model == meta.model or model in meta.models

    def view(
        self,
        now: float,
        matched_tokens: int = 0,
        cost: WorkerCost | None = None,
        free_sequences: int | None = None,
    ) -> WorkerView:
        """The policy's picture of this worker at ``now``."""
        load = self.engine_load
        if load is not None:
            load = EngineLoad(
                running_requests=load.running_requests,
                waiting_requests=load.waiting_requests,
                waiting_uncached_tokens=load.waiting_uncached_tokens,
                token_usage=load.token_usage,
                age_s=max(0.0, now - self.load_read_at),
            )
        return WorkerView(
            id=self.id,
            in_flight=self.in_flight + self.peer_in_flight,
            queued_prefill_tokens=self.queued_prefill_tokens + self.peer_queued_prefill_tokens,
            decoding_requests=self.decoding_requests + self.peer_decoding_requests,
            capacity_tokens=self.metadata.capacity_tokens,
            engine_load=load,
            matched_tokens=matched_tokens,
            cost=cost if cost is not None else WorkerCost(),
            free_sequences=free_sequences,
        )

    def describe(self, now: float) -> dict[str, Any]:
        """Live state for ``GET /workers``."""
        load = self.engine_load
        return {
            "id": self.id,
            "url": self.url,
            "model": self.metadata.model,
            "kind": self.kind if self.kind_known else None,
            "healthy": self.healthy,
            "routable": self.healthy,
            "flags": sorted(f.value for f in self.flags),
            "is_healthy": self.healthy,  # sglang-router's field name
            "in_flight": self.in_flight,
            "load": self.in_flight,  # sglang-router's field name
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "decoding_requests": self.decoding_requests,
            "capacity_tokens": self.metadata.capacity_tokens,
            "page_size": self.metadata.page_size,
            "max_sequences": self.metadata.max_sequences,
            "lora_adapters": sorted(self.adapters) if self.metadata.lora_enabled else None,
            "times_ejected": self.times_ejected,
            "ejected_for_s": max(0.0, self.ejected_until - now)
            if HealthFlag.EJECTED in self.flags
            else 0.0,
            "engine_load": None
            if load is None
            else {
                "running_requests": load.running_requests,
                "waiting_requests": load.waiting_requests,
                "waiting_uncached_tokens": load.waiting_uncached_tokens,
                "token_usage": load.token_usage,
                "age_s": round(max(0.0, now - self.load_read_at), 3),
            },
        }


class WorkerRegistry:
    """The set of workers, keyed by id; builds the candidate list for each request."""

    def __init__(self, panic_threshold: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._workers: dict[str, Worker] = {}
        self._panic_threshold = panic_threshold
        self._removed_listeners: list[Callable[[Worker], None]] = []
        self.clock = clock
        # every LoRA adapter seen loaded on a worker: what a load call needs once no
        # worker holds it any more (bounded: the oldest are forgotten)
        self._adapter_paths: dict[str, AdapterSource] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def on_removed(self, listener: Callable[[Worker], None]) -> None:
        self._removed_listeners.append(listener)

    def add(self, url: str, kind: str | None = None) -> tuple[Worker, bool]:
        """Register ``url`` (already validated) of ``kind`` (None: discover it); returns
        (worker, created)."""
        wid = worker_id_for(url)
        existing = self._workers.get(wid)
        if existing is not None:
            return existing, False
        worker = Worker(url, self.clock(), kind)
        self._workers[wid] = worker
        return worker, True

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            for listener in self._removed_listeners:
                listener(worker)
        return worker

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def find(self, id_or_url: str) -> Worker | None:
        """By id, or by URL (as given to ``add``)."""
        worker = self._workers.get(id_or_url)
        if worker is None and "://" in id_or_url:
            worker = self._workers.get(worker_id_for(id_or_url.rstrip("/")))
        return worker

    def healthy_count(self) -> int:
        return sum(1 for w in self._workers.values() if not w.flags)

    def served_models(self) -> set[str]:
        """The models the workers said they serve (one name each: ``metadata.model``)."""
        return {w.metadata.model for w in self._workers.values() if w.metadata.model}

    def multi_model(self) -> bool:
        """More than one model behind the gateway: requests are routed by ``model``.
        With one (or none told), any ``model`` string goes to any worker, as a
        single-model SGLang fleet behind sglang-router accepts it."""
        return len(self.served_models()) > 1

    def serves_any(self, model: str) -> bool:
        return any(w.serves(model) for w in self._workers.values())

    def served_names(self) -> set[str]:
        """Every name a request may use for a model some worker serves."""
        names = self.served_models()
        for w in self._workers.values():
            names.update(w.metadata.models)
        return names

    def serves_lora(self) -> bool:
        """Some worker said it serves LoRA adapters (else requests' adapters are left
        to the workers, and a ``model`` with a colon is a model name as before)."""
        return any(w.metadata.lora_enabled for w in self._workers.values())

    def set_adapters(
        self,
        worker: Worker,
        adapters: Mapping[str, str],
        parents: Mapping[str, str] | None = None,
    ) -> None:
        """``worker`` has these LoRA adapters loaded now (name → path; ``parents``: name →
        the base model its card names). Bounded and filtered (``adapter_name_ok``); a
        path differing from the one another worker reported marks the name conflicted."""
        kept: dict[str, str] = {}
        for name, path in adapters.items():
            if len(kept) >= MAX_WORKER_ADAPTERS:
                log.warning("worker %s lists over %d LoRA adapters", worker.url, len(kept))
                break
            if adapter_name_ok(name) and adapter_name_ok(path, MAX_ADAPTER_PATH):
                kept[name] = path
        worker.adapters = kept
        for name, path in kept.items():
            parent = (parents or {}).get(name)
            if not adapter_name_ok(parent):
                parent = worker.metadata.model
            known = self._adapter_paths.pop(name, None)
            if known is None:
                known = AdapterSource(path, parent)
            elif known.path != path and not known.conflicted:
                log.warning(
                    "LoRA adapter %r: worker %s reports path %r, another %r; not loaded "
                    "anywhere by the gateway until lora.paths names it",
                    name,
                    worker.url,
                    path,
                    known.path,
                )
                known = AdapterSource(known.path, known.parent, conflicted=True)
            self._adapter_paths[name] = known
        while len(self._adapter_paths) > _MAX_ADAPTER_PATHS:
            del self._adapter_paths[next(iter(self._adapter_paths))]

    def adapter_source(self, name: str) -> AdapterSource | None:
        """Where ``name`` was seen loaded from, on any worker (None: never seen)."""
        return self._adapter_paths.get(name)

    def candidates(
        self, excluded: Sequence[str] = (), model: str | None = None, adapter: str | None = None
    ) -> list[Worker]:
        """Routable workers not in ``excluded``; every non-draining one in panic. With
        several models behind the gateway, only workers serving ``model`` (the health
        and panic rules apply among them). With ``adapter``, only the workers that have
        that LoRA adapter loaded, when one of them is healthy and not excluded (else all:
        the caller decides whether one may load it)."""
        workers: Sequence[Worker] = list(self._workers.values())
        if model is not None and self.multi_model():
            workers = [w for w in workers if w.serves(model)]
        if adapter is not None:
            holding = [w for w in workers if adapter in w.adapters]
            if any(not w.flags and w.id not in excluded for w in holding):
                workers = holding
        healthy = [w for w in workers if not w.flags and w.id not in excluded]
        if healthy and len(healthy) >= self._panic_threshold * len(workers):
            return healthy
        panic = [w for w in workers if not w.draining and w.id not in excluded]
        # Healthy ones first: a policy that breaks ties by order prefers them.
        panic.sort(key=lambda w: len(w.flags))
        return panic

    def ready(self) -> bool:
        """True when at least one worker is healthy (the gateway's readiness)."""
        return any(not w.flags for w in self._workers.values())
