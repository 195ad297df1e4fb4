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
- Listeners registered with :meth:`on_removed` learn of removed workers (connection pool,
  load endpoint); those registered with :meth:`on_target_removed` of every routing target
  that goes (prefix index, cost model, metrics): a removed worker's ranks and itself.
- A worker with data-parallel ranks (SGLang ``dp_size > 1``, from ``/server_info``) is
  routed to per rank: :meth:`WorkerRegistry.sync_ranks` gives it one :class:`RankWorker`
  per rank (id ``<worker id>@dp<rank>``), each with its own counters, engine load and
  prefix-index entries; what belongs to the server (URL, kind, health flags, outlier
  counters, metadata, adapters) a rank reads and writes on its worker. Candidates are
  the ranks of such workers; ``excluded`` takes a worker's id (all its ranks) or a
  rank's. Ranks that go (a worker removed, ``dp_size`` changed) are told to the target
  listeners, and so is the worker's own id when it gains or loses ranks (what was
  learnt of it as one target does not hold per rank).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.config.workerspec import rank_target_id, routed_ranks
from policies.base import EngineLoad, WorkerCost, WorkerView

log = logging.getLogger(__name__)

_DEFAULT_COST = WorkerCost()  # immutable: shared by every view without a cost


REGULAR = "regular"  # worker roles, sglang-router's worker_type names
PREFILL = "prefill"
DECODE = "decode"
ROLES = (REGULAR, PREFILL, DECODE)


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
    # HiCache's host-only tier in tokens (per DP rank, as capacity_tokens), from its
    # /server_info (``gateway.workers.replies.host_tier_tokens``); None: no host tier
    host_capacity_tokens: int | None = None
    page_size: int | None = None
    max_sequences: int | None = None  # prompts it keeps cached when slots bind (llama.cpp)
    lora_enabled: bool = False  # serves LoRA adapters (SGLang's enable_lora)
    max_loaded_loras: int | None = None  # adapters kept loaded (LRU beyond); None: not told
    dp_size: int = 1  # data-parallel ranks, each with its own radix cache (SGLang)
    # prefill/decode disaggregation as the worker's /server_info tells it (docs/PD.md)
    disaggregation_mode: str | None = None  # "prefill", "decode" or "null"
    bootstrap_port: int | None = None  # a prefill server's disaggregation_bootstrap_port
    version: str | None = None  # the engine's version, when told (SGLang's ``version``)


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
    """``http://127.0.0.1:18001`` → ``127.0.0.1-18001`` (``https-`` prefix for TLS). A
    host or path with characters outside ``[A-Za-z0-9._-]`` has them replaced and a
    digest of the original appended, so two URLs never share an id (``/a/b`` and
    ``/a_b``, ``[::1]`` and a host named ``1``)."""
    parts = urlsplit(url)
    host = _safe(parts.hostname or "") or "worker"
    wid = f"{host}-{parts.port}"
    path = _safe(parts.path.strip("/"))
    if path:
        wid = f"{wid}-{path}"
    return f"https-{wid}" if parts.scheme == "https" else wid


def _safe(part: str) -> str:
    cleaned = _ID_UNSAFE.sub("_", part).strip("_")
    if cleaned == part:
        return part
    return f"{cleaned}.{hashlib.sha256(part.encode()).hexdigest()[:8]}"


class Worker:
    """One worker's mutable state. Only the modules named in the module contract write it."""

    __slots__ = (
        "_at",
        "_columns",
        "_engine_load",
        "_in_flight",
        "_peer_in_flight",
        "_peer_queued",
        "_queued",
        "adapters",
        "added_at",
        "bootstrap_port",
        "consecutive_5xx",
        "consecutive_connect_errors",
        "decoding_requests",
        "dp_rank",
        "ejected_until",
        "flags",
        "health_failures",
        "health_successes",
        "id",
        "kind",
        "kind_known",
        "last_ejected_at",
        "load_read_at",
        "metadata",
        "peer_decoding_requests",
        "ranks",
        "role",
        "times_ejected",
        "url",
    )

    def __init__(
        self,
        url: str,
        now: float,
        kind: str | None = None,
        role: str = REGULAR,
        bootstrap_port: int | None = None,
    ) -> None:
        self.url = url
        # PD disaggregation: "prefill" or "decode" (docs/PD.md); "regular" otherwise
        self.role = role
        self.bootstrap_port = bootstrap_port  # a prefill worker's, as configured (or None)
        self.id = worker_id_for(url)
        # gateway.workers.kinds name; until an unknown kind is discovered, SGLang's ways
        self.kind = kind or "sglang"
        self.kind_known = kind is not None
        self.added_at = now
        self.flags: set[HealthFlag] = {HealthFlag.UNCHECKED}
        self._init_target()
        self.metadata = WorkerMetadata()
        # LoRA adapters loaded there, name → path (its /v1/models cards with a parent)
        self.adapters: dict[str, str] = {}
        # active checks: consecutive results since the last flip
        self.health_failures = 0
        self.health_successes = 0
        # outlier detection
        self.consecutive_connect_errors = 0
        self.consecutive_5xx = 0
        self.times_ejected = 0
        self.ejected_until = 0.0
        self.last_ejected_at = 0.0
        # data-parallel ranks, each a routing target (empty: the worker is one target)
        self.ranks: tuple[RankWorker, ...] = ()
        self.dp_rank: int | None = None  # set on a RankWorker only

    def _init_target(self) -> None:
        """What a routing target counts of its own (a worker's, or a DP rank's)."""
        # the registry's columns this target's load figures are kept in (see
        # ``FleetColumns``; None: in none) and its place there
        self._columns: FleetColumns | None = None
        self._at = 0
        self._in_flight = 0
        self._queued = 0
        self.decoding_requests = 0
        # the same three as other gateways last published them (gateway.peers.state);
        # a policy sees the sums
        self._peer_in_flight = 0
        self._peer_queued = 0
        self.peer_decoding_requests = 0
        self._engine_load: EngineLoad | None = None
        self.load_read_at = 0.0

    # The load figures a large fleet's shortlist reads for every candidate: each write
    # also updates the registry's columns (``FleetColumns``).

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, n: int) -> None:
        self._in_flight = n
        if self._columns is not None:
            self._columns.put(self)

    @property
    def peer_in_flight(self) -> int:
        return self._peer_in_flight

    @peer_in_flight.setter
    def peer_in_flight(self, n: int) -> None:
        self._peer_in_flight = n
        if self._columns is not None:
            self._columns.put(self)

    @property
    def queued_prefill_tokens(self) -> int:
        return self._queued

    @queued_prefill_tokens.setter
    def queued_prefill_tokens(self, n: int) -> None:
        self._queued = n
        if self._columns is not None:
            self._columns.put(self)

    @property
    def peer_queued_prefill_tokens(self) -> int:
        return self._peer_queued

    @peer_queued_prefill_tokens.setter
    def peer_queued_prefill_tokens(self, n: int) -> None:
        self._peer_queued = n
        if self._columns is not None:
            self._columns.put(self)

    @property
    def engine_load(self) -> EngineLoad | None:
        return self._engine_load

    @engine_load.setter
    def engine_load(self, load: EngineLoad | None) -> None:
        self._engine_load = load
        if self._columns is not None:
            self._columns.put(self)

    @property
    def server(self) -> Worker:
        """The worker that owns this target: itself (a rank's: its worker)."""
        return self

    def targets(self) -> tuple[Worker, ...]:
        """Where requests to this worker are routed: its ranks, or itself."""
        return self.ranks or (self,)

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
        setup_s: float = 0.0,
    ) -> WorkerView:
        """The policy's picture of this worker at ``now``. Built per candidate per
        decision: positional arguments (keywords cost more), in field order."""
        load = self.engine_load
        if load is not None:
            age = now - self.load_read_at
            load = EngineLoad(
                load.running_requests,
                load.waiting_requests,
                load.waiting_uncached_tokens,
                load.token_usage,
                age if age > 0.0 else 0.0,  # age_s (no builtin max: per candidate)
            )
        return WorkerView(
            self.id,
            self.in_flight + self.peer_in_flight,
            self.queued_prefill_tokens + self.peer_queued_prefill_tokens,
            self.decoding_requests + self.peer_decoding_requests,
            self.metadata.capacity_tokens,
            load,
            matched_tokens,
            0,  # matched_host_tokens: set by the routing core when it knows tiers
            _DEFAULT_COST if cost is None else cost,
            free_sequences,
            setup_s,
        )

    def describe(self, now: float) -> dict[str, Any]:
        """Live state for ``GET /workers``."""
        load = self.engine_load
        targets = self.targets()
        return {
            "id": self.id,
            "url": self.url,
            "model": self.metadata.model,
            "kind": self.kind if self.kind_known else None,
            "worker_type": self.role,  # sglang-router's name
            "bootstrap_port": self.bootstrap_port if self.role == PREFILL else None,
            "healthy": self.healthy,
            "routable": self.healthy,
            "flags": sorted(f.value for f in self.flags),
            "is_healthy": self.healthy,  # sglang-router's field name
            "in_flight": sum(t.in_flight for t in targets),
            "load": sum(t.in_flight for t in targets),  # sglang-router's field name
            "queued_prefill_tokens": sum(t.queued_prefill_tokens for t in targets),
            "decoding_requests": sum(t.decoding_requests for t in targets),
            "capacity_tokens": self.metadata.capacity_tokens,
            "dp_size": self.metadata.dp_size,
            "dp_ranks": [r.describe_rank(now) for r in self.ranks] if self.ranks else None,
            "page_size": self.metadata.page_size,
            "max_sequences": self.metadata.max_sequences,
            "lora_adapters": sorted(self.adapters) if self.metadata.lora_enabled else None,
            "times_ejected": self.times_ejected,
            "ejected_for_s": max(0.0, self.ejected_until - now)
            if HealthFlag.EJECTED in self.flags
            else 0.0,
            "engine_load": _described_load(load, now - self.load_read_at),
        }


def _described_load(load: EngineLoad | None, age_s: float) -> dict[str, Any] | None:
    if load is None:
        return None
    return {
        "running_requests": load.running_requests,
        "waiting_requests": load.waiting_requests,
        "waiting_uncached_tokens": load.waiting_uncached_tokens,
        "token_usage": load.token_usage,
        "age_s": round(max(0.0, age_s), 3),
    }


def _of_server(name: str) -> Any:
    """A :class:`RankWorker` attribute that is its worker's (read and written there)."""

    def get(self: RankWorker) -> Any:
        return getattr(self.parent, name)

    def put(self: RankWorker, value: Any) -> None:
        setattr(self.parent, name, value)

    return property(get, put)


def views_of(
    workers: Sequence[Worker],
    now: float,
    matched_tokens: Mapping[str, int],
    cost: Callable[[str], WorkerCost],
    free_sequences: Callable[[str], int | None],
    setup_s: Mapping[str, float],
) -> list[WorkerView]:
    """The views of ``workers`` at ``now``: each the :meth:`Worker.view` with its
    ``matched_tokens`` (0 when absent), ``cost``, ``free_sequences`` and ``setup_s`` (0
    when absent). Built inline, for the routing core: this loop runs for every candidate
    of every decision, and a method call per worker cost as much as its view
    (BENCHMARKS.md, "Scale"). Keep it in step with :meth:`Worker.view`."""
    out: list[WorkerView] = []
    append, tokens, setup = out.append, matched_tokens.get, setup_s.get
    for w in workers:
        wid = w.id
        load = w._engine_load  # the properties' fields: read per candidate
        if load is not None:
            age = now - w.load_read_at
            load = EngineLoad(
                load.running_requests,
                load.waiting_requests,
                load.waiting_uncached_tokens,
                load.token_usage,
                age if age > 0.0 else 0.0,
            )
        append(
            WorkerView(
                wid,
                w._in_flight + w._peer_in_flight,
                w._queued + w._peer_queued,
                w.decoding_requests + w.peer_decoding_requests,
                w.metadata.capacity_tokens,
                load,
                tokens(wid, 0),
                0,
                cost(wid),
                free_sequences(wid),
                setup(wid, 0.0),
            )
        )
    return out


class FleetColumns:
    """The registry's workers' load figures as columns in fleet order (the order of
    ``WorkerRegistry.candidates`` when it filters none out), kept current by each
    worker's setters: the routing core's shortlist of a large fleet copies them instead
    of reading every worker per decision (``fleet_columns``; BENCHMARKS.md, "Scale").
    ``in_flight`` and ``queued`` are the sums a view shows (own + peers'); ``seen`` is
    the larger of ``queued`` and the engine's last reported uncached waiting tokens.
    Rebuilt on every membership change; ``ids`` and ``workers`` are never changed in
    place (a new object each rebuild)."""

    __slots__ = ("engine", "ids", "in_flight", "queued", "seen", "workers")

    def __init__(self, workers: list[Worker]) -> None:
        n = len(workers)
        self.workers = workers
        self.ids = [w.id for w in workers]
        self.in_flight = [0] * n
        self.queued = [0] * n
        self.seen = [0] * n
        self.engine: list[EngineLoad | None] = [None] * n
        for i, w in enumerate(workers):
            w._columns, w._at = self, i
            self.put(w)

    def put(self, w: Worker) -> None:
        """Write ``w``'s figures at its place."""
        at, queued, load = w._at, w._queued + w._peer_queued, w._engine_load
        self.in_flight[at] = w._in_flight + w._peer_in_flight
        self.queued[at] = queued
        self.engine[at] = load
        uncached = (load.waiting_uncached_tokens if load is not None else None) or 0
        self.seen[at] = queued if uncached < queued else uncached

    def detach(self) -> None:
        for w in self.workers:
            if w._columns is self:
                w._columns = None


def fleet_columns(workers: Sequence[Worker]) -> FleetColumns | None:
    """The registry's columns when ``workers`` are exactly its workers in its order (a
    candidate list nothing was filtered out of), else None."""
    columns = workers[0]._columns if workers else None
    if columns is None or len(columns.workers) != len(workers) or columns.workers != workers:
        return None
    return columns


class RankWorker(Worker):
    """One data-parallel rank of a worker: a routing target with its own id, counters
    (leases), engine load and index entries; the rest is its worker's (module contract)."""

    __slots__ = ("parent",)

    # the server's own state, shared by all its ranks
    url = _of_server("url")
    kind = _of_server("kind")
    kind_known = _of_server("kind_known")
    role = _of_server("role")
    bootstrap_port = _of_server("bootstrap_port")
    added_at = _of_server("added_at")
    flags = _of_server("flags")
    metadata = _of_server("metadata")
    adapters = _of_server("adapters")
    health_failures = _of_server("health_failures")
    health_successes = _of_server("health_successes")
    consecutive_connect_errors = _of_server("consecutive_connect_errors")
    consecutive_5xx = _of_server("consecutive_5xx")
    times_ejected = _of_server("times_ejected")
    ejected_until = _of_server("ejected_until")
    last_ejected_at = _of_server("last_ejected_at")

    def __init__(self, parent: Worker, rank: int) -> None:
        # Worker.__init__ is not called: it would write the server's attributes above
        self.parent = parent
        self.id = rank_target_id(parent.id, rank)
        self.dp_rank = rank
        self.ranks = ()
        self._init_target()

    @property
    def server(self) -> Worker:
        return self.parent

    def describe_rank(self, now: float) -> dict[str, Any]:
        """This rank's own figures, for its worker's ``GET /workers`` entry."""
        return {
            "id": self.id,
            "dp_rank": self.dp_rank,
            "in_flight": self.in_flight,
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "decoding_requests": self.decoding_requests,
            "engine_load": _described_load(self.engine_load, now - self.load_read_at),
        }


class WorkerRegistry:
    """The set of workers, keyed by id; builds the candidate list for each request."""

    def __init__(
        self,
        panic_threshold: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        dp_aware: bool = True,
    ) -> None:
        self._workers: dict[str, Worker] = {}
        self._dp_aware = dp_aware  # False: a DP worker stays one target (rank-blind)
        self._panic_threshold = panic_threshold
        self._removed_listeners: list[Callable[[Worker], None]] = []
        self._target_listeners: list[Callable[[Worker], None]] = []
        self.clock = clock
        # every LoRA adapter seen loaded on a worker: what a load call needs once no
        # worker holds it any more (bounded: the oldest are forgotten)
        self._adapter_paths: dict[str, AdapterSource] = {}
        self._ranks: dict[str, RankWorker] = {}  # rank target id → rank
        self._columns = FleetColumns([])  # the workers' load figures (``FleetColumns``)

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def on_removed(self, listener: Callable[[Worker], None]) -> None:
        """``listener(worker)`` once a worker is removed."""
        self._removed_listeners.append(listener)

    def on_target_removed(self, listener: Callable[[Worker], None]) -> None:
        """``listener(target)`` for each routing target that goes (module contract)."""
        self._target_listeners.append(listener)

    def add(
        self,
        url: str,
        kind: str | None = None,
        role: str = REGULAR,
        bootstrap_port: int | None = None,
    ) -> tuple[Worker, bool]:
        """Register ``url`` (already validated) of ``kind`` (None: discover it) in
        ``role``; returns (worker, created)."""
        wid = worker_id_for(url)
        existing = self._workers.get(wid)
        if existing is not None:
            return existing, False
        worker = Worker(url, self.clock(), kind, role, bootstrap_port)
        self._workers[wid] = worker
        self._rebuild_columns()
        return worker, True

    def _rebuild_columns(self) -> None:
        self._columns.detach()
        self._columns = FleetColumns(list(self._workers.values()))

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._rebuild_columns()
            self._drop_ranks(worker, 0)
            self._target_removed(worker)
            for listener in self._removed_listeners:
                listener(worker)
        return worker

    def _target_removed(self, target: Worker) -> None:
        for listener in self._target_listeners:
            listener(target)

    def _drop_ranks(self, worker: Worker, keep: int) -> None:
        """Forget ``worker``'s ranks from ``keep`` on (listeners told of each)."""
        gone, worker.ranks = worker.ranks[keep:], worker.ranks[:keep]
        for rank in gone:
            self._ranks.pop(rank.id, None)
            self._target_removed(rank)

    def sync_ranks(self, worker: Worker) -> bool:
        """Give ``worker`` one routing target per DP rank its metadata tells (none for
        one rank, or past ``MAX_ROUTED_DP_RANKS``); True if they changed. Ranks that go are
        forgotten by the removal listeners; the worker's own id stops being a target
        when it gains ranks (its index entries are forgotten the same way)."""
        want = routed_ranks(worker.metadata.dp_size) if self._dp_aware else 0
        have = len(worker.ranks)
        if want == have or worker.id not in self._workers:
            return False
        if want < have:
            self._drop_ranks(worker, want)
        else:
            if have == 0:
                self._target_removed(worker)  # what was learnt of it is per rank now
            added = tuple(RankWorker(worker, r) for r in range(have, want))
            worker.ranks += added
            self._ranks.update((r.id, r) for r in added)
        if not worker.ranks:
            self._target_removed(worker)  # back to one target: start it afresh too
        log.info("worker %s: %d data-parallel ranks routed to separately", worker.url, want)
        return True

    def get(self, worker_id: str) -> Worker | None:
        """A worker by id, or one of its DP ranks by its target id."""
        return self._workers.get(worker_id) or self._ranks.get(worker_id)

    def targets(self) -> Iterator[Worker]:
        """Every routing target: each worker's ranks, or the worker itself."""
        for worker in list(self._workers.values()):
            yield from worker.targets()

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
        self,
        excluded: Sequence[str] = (),
        model: str | None = None,
        adapter: str | None = None,
        role: str | None = None,
    ) -> list[Worker]:
        """Routable workers not in ``excluded``; every non-draining one in panic. With
        several models behind the gateway, only workers serving ``model`` (the health
        and panic rules apply among them). With ``adapter``, only the workers that have
        that LoRA adapter loaded, when one of them is healthy and not excluded (else all:
        the caller decides whether one may load it). With ``role`` (PD mode), only the
        workers of that role (the panic rule applies per role)."""
        workers: Sequence[Worker] = list(self._workers.values())
        if role is not None:
            workers = [w for w in workers if w.role == role]
        if model is not None and self.multi_model():
            workers = [w for w in workers if w.serves(model)]
        if adapter is not None:
            holding = [w for w in workers if adapter in w.adapters]
            if any(not w.flags and w.id not in excluded for w in holding):
                workers = holding
        healthy = [w for w in workers if not w.flags and w.id not in excluded]
        if healthy and len(healthy) >= self._panic_threshold * len(workers):
            return _targets(healthy, excluded)
        panic = [w for w in workers if not w.draining and w.id not in excluded]
        # Healthy ones first: a policy that breaks ties by order prefers them.
        panic.sort(key=lambda w: len(w.flags))
        return _targets(panic, excluded)

    def ready(self) -> bool:
        """True when at least one worker is healthy (the gateway's readiness); with PD
        workers, one healthy prefill and one healthy decode (sglang-router's rule)."""
        healthy = {w.role for w in self._workers.values() if not w.flags}
        if any(w.role != REGULAR for w in self._workers.values()):
            return {PREFILL, DECODE} <= healthy
        return bool(healthy)


def _targets(workers: list[Worker], excluded: Sequence[str]) -> list[Worker]:
    """``workers`` as routing targets: a worker with DP ranks becomes its ranks (those
    not excluded; all of them excluded: none of it)."""
    if not any(w.ranks for w in workers):
        return workers
    return [t for w in workers for t in w.targets() if t.id not in excluded]
