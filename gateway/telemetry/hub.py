"""Every metric and span of the gateway, behind named methods.

One :class:`Telemetry` per gateway (built by the composition root, never global). It owns
its own prometheus ``CollectorRegistry`` and, when tracing is on, its own OpenTelemetry
``TracerProvider``.

Request path (push, a few microseconds per request)::

    rt = telemetry.begin_request(request_id, route, model, request.headers)
    rt.decided(record)                    # after policy.select; a 2nd call is a retry
    headers.update(rt.upstream_headers()) # W3C traceparent, empty when tracing is off
    rt.first_byte()                       # first chunk from the worker (TTFT)
    rt.upstream_failed(worker, kind)      # an attempt failed
    rt.finish(status, reported_cached_tokens=n)

``begin_request`` also makes the request's telemetry the *current* one of its task
(:func:`current_request`), so code that does not hold ``rt`` (router hooks, see
``gateway.http.observe``) reaches it.

Fleet figures (in-flight, queued, health flags, engine load, index size, admission
rejections) are pulled at scrape time from a
:data:`~gateway.telemetry.snapshot.SnapshotProvider`; see ``telemetry_collector``.
Worker label values are bounded by the registry: series of a worker absent from the
snapshot are dropped at the next scrape, or at once by :meth:`Telemetry.forget_worker`.

Label sets are bounded: ``route`` by the gateway's routes, ``status`` by HTTP,
``policy``/``reason`` by the policies (``policies.base.REASONS``), ``kind`` by
:data:`UPSTREAM_ERROR_KINDS` (other values are counted as ``other``), ``model`` by
:meth:`Telemetry.model_label` (a served base model, at most :data:`MAX_MODEL_LABELS`
values since start, else ``other``).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry, generate_latest

from gateway.routing.decisions import DecisionOutcome, DecisionRecord
from gateway.telemetry.collector import FleetCollector
from gateway.telemetry.logs import set_request_id
from gateway.telemetry.metrics import CounterChild, HistogramChild
from gateway.telemetry.series import TTFT_BUCKETS, Capture, Metrics, ModelStats, WorkerStats
from gateway.telemetry.snapshot import FleetSnapshot, SnapshotProvider, empty_snapshot
from gateway.telemetry.tracing import SpanHandle, Tracing, TracingConfig
from gateway.telemetry.tuning import TuningTelemetry

NO_WORKER = "none"  # worker label of requests that never reached a worker
OTHER = "other"
UPSTREAM_ERROR_KINDS = frozenset({"connect", "timeout", "http_5xx", "http_429", "stream", OTHER})
# `model` label values besides `other`: the first served models seen, names of a sane size
MAX_MODEL_LABELS = 64
MAX_MODEL_LABEL_CHARS = 256

_NO_HEADERS: Mapping[str, str] = MappingProxyType({})
# The telemetry of the request the current task serves (per task, like the log request id).
_CURRENT: contextvars.ContextVar[RequestTelemetry | None] = contextvars.ContextVar(
    "gateway_request_telemetry", default=None
)


def current_request() -> RequestTelemetry | None:
    """The :class:`RequestTelemetry` begun in this task (or a parent task), if any."""
    return _CURRENT.get()


@dataclass(frozen=True, slots=True)
class TelemetryConfig:
    """Telemetry settings. ``metrics=False`` and no tracing makes the request path free."""

    metrics: bool = True
    tracing: TracingConfig = field(default_factory=TracingConfig)
    ttft_window: int = 512  # recent TTFT samples kept per worker for dashboard percentiles
    ttft_window_s: float = 60.0  # and only those younger than this


class RequestTelemetry:
    """Telemetry of one request; made by :meth:`Telemetry.begin_request`. Not reusable."""

    __slots__ = (
        "_first_byte", "_span", "_start", "_t", "finished", "model", "model_label", "record",
        "request_id", "retries", "route",
    )  # fmt: skip

    def __init__(
        self,
        t: Telemetry,
        request_id: str,
        route: str,
        model: str | None,
        span: SpanHandle | None,
    ) -> None:
        self._t = t
        self.route = route  # a bounded label: may be set until finish
        self._span = span
        self._start = time.perf_counter()
        self._first_byte: float | None = None
        self.request_id = request_id
        self.model = model
        self.model_label = OTHER  # the `model` label (Telemetry.model_label), set by the router
        self.record: DecisionRecord | None = None
        self.retries = 0
        self.finished = False

    def decided(self, record: DecisionRecord) -> None:
        """A policy chose ``record.worker``; counts the decision. Call once per attempt:
        every call after the first counts a retry."""
        if self.record is not None:
            self.retries += 1
            self._t._retry(self.route)
        self.record = record
        if self.model is None:
            self.model = record.model
        self._t._decision(record)

    def upstream_headers(self) -> Mapping[str, str]:
        """Headers to add to the upstream request (W3C trace context); empty when off."""
        if self._span is None:
            return _NO_HEADERS
        return Tracing.inject(self._span)

    def first_byte(self) -> None:
        """The worker's first byte arrived: fixes TTFT (first call wins)."""
        if self._first_byte is None:
            self._first_byte = time.perf_counter()

    def upstream_failed(self, worker: str, kind: str) -> None:
        """An attempt at ``worker`` failed with ``kind`` (:data:`UPSTREAM_ERROR_KINDS`)."""
        self._t.upstream_error(worker, kind)

    def finish(
        self,
        status: int,
        *,
        reported_cached_tokens: int | None = None,
        ttft_s: float | None = None,
    ) -> None:
        """The response is over. ``ttft_s`` overrides the :meth:`first_byte` mark.

        Only the first call counts; the outcome of the decision record is set when the
        record has none yet (the router may have set it already)."""
        if self.finished:
            return
        self.finished = True
        end = time.perf_counter()
        if ttft_s is None and self._first_byte is not None:
            ttft_s = self._first_byte - self._start
        duration = end - self._start
        record = self.record
        if record is not None and record.outcome is None:
            record.outcome = DecisionOutcome(
                status, ttft_s, reported_cached_tokens, self.retries, duration
            )
        self._t._finish(self, record, status, duration, ttft_s, reported_cached_tokens)
        span = self._span
        if span is not None:
            self._span = None
            _end_span(span, self, status, ttft_s, reported_cached_tokens)


def _end_span(
    span: SpanHandle,
    rt: RequestTelemetry,
    status: int,
    ttft_s: float | None,
    reported: int | None,
) -> None:
    """The span's attributes, all known now; then it is built and exported."""
    attrs: dict[str, Any] = {
        "gateway.request_id": rt.request_id,
        "http.route": rt.route,
        "http.response.status_code": status,
        "gateway.retries": rt.retries,
    }
    if rt.model is not None:
        attrs["gen_ai.request.model"] = rt.model
    record = rt.record
    if record is not None:
        attrs["gateway.policy"] = record.policy
        attrs["gateway.worker"] = record.worker
        attrs["gateway.reason"] = record.reason
        attrs["gateway.candidates"] = len(record.candidates)
        if record.left_out:  # a large fleet's shortlist: the candidates it did not show
            attrs["gateway.candidates_left_out"] = record.left_out
        attrs["gateway.matched_tokens"] = record.matched_tokens
        attrs["gateway.prompt_tokens"] = record.prompt_tokens
        if record.available_tokens is not None:
            attrs["gateway.available_tokens"] = record.available_tokens
        if record.matched_host_tokens:
            attrs["gateway.matched_host_tokens"] = record.matched_host_tokens
        out = record.outcome
        if out is not None and out.reported_host_tokens is not None:
            attrs["gateway.reported_host_tokens"] = out.reported_host_tokens
    if ttft_s is not None:
        attrs["gateway.ttft_s"] = ttft_s
    if reported is not None:
        attrs["gateway.reported_cached_tokens"] = reported
    rt._t._tracing.end(span, rt.route, attrs)


class _NoopRequestTelemetry(RequestTelemetry):
    """Used when metrics and tracing are both off: every method returns at once."""

    __slots__ = ()

    def decided(self, record: DecisionRecord) -> None:
        self.record = record

    def upstream_headers(self) -> Mapping[str, str]:
        return _NO_HEADERS

    def first_byte(self) -> None:
        return None

    def upstream_failed(self, worker: str, kind: str) -> None:
        return None

    def finish(
        self,
        status: int,
        *,
        reported_cached_tokens: int | None = None,
        ttft_s: float | None = None,
    ) -> None:
        self.finished = True


class Telemetry:
    """Metrics, traces and dashboard figures of one gateway."""

    def __init__(
        self,
        config: TelemetryConfig | None = None,
        *,
        snapshot: SnapshotProvider = empty_snapshot,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        self.config = config or TelemetryConfig()
        self.registry = CollectorRegistry()
        self._snapshot = snapshot
        # Registered first: each scrape prunes removed workers before the push series.
        self.registry.register(FleetCollector(self.snapshot, self._prune))
        self._m = Metrics(self.registry)
        self.tuning = TuningTelemetry(self.registry, TTFT_BUCKETS)
        self._tracing = Tracing(self.config.tracing, span_exporter)
        self._workers: dict[str, WorkerStats] = {}
        self._models: dict[str, ModelStats] = {}  # by `model` label value
        self._error_workers: set[str] = set()  # labelled by errors or ejections only
        self._decisions: dict[tuple[str, str], CounterChild] = {}
        self._match_ratio: dict[str, HistogramChild] = {}
        self.reason_counts: dict[tuple[str, str], int] = {}  # (policy, reason) -> decisions
        # routing capture of the whole gateway (per model: ModelStats.capture); read-only use
        self.capture = Capture(self._m.capture_tokens, self._m.capture_requests)
        self._quiet = not self.config.metrics and not self._tracing.enabled

    @property
    def tracing_enabled(self) -> bool:
        """Whether request spans are created."""
        return self._tracing.enabled

    # -- request path -----------------------------------------------------------------

    def begin_request(
        self,
        request_id: str,
        route: str,
        model: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> RequestTelemetry:
        """Start a request's telemetry; also binds ``request_id`` to this task's log lines.

        ``route`` must come from a bounded set (the handler's path template).
        """
        set_request_id(request_id)
        if self._quiet:
            rt: RequestTelemetry = _NoopRequestTelemetry(self, request_id, route, model, None)
        else:
            span = self._tracing.start(headers) if self._tracing.enabled else None
            rt = RequestTelemetry(self, request_id, route, model, span)
        _CURRENT.set(rt)
        return rt

    def model_label(self, model: str | None) -> str:
        """The ``model`` label of a request whose base model is ``model`` when a worker
        serves it (None: none does, or it names none): the name itself for the first
        :data:`MAX_MODEL_LABELS` names seen, else ``other``."""
        if model is None or model in self._models:
            return OTHER if model is None else model
        named = len(self._models) - (OTHER in self._models)
        if named >= MAX_MODEL_LABELS or len(model) > MAX_MODEL_LABEL_CHARS:
            return OTHER
        self._models[model] = ModelStats(model, self._m)
        return model

    def _model(self, label: str) -> ModelStats:
        ms = self._models.get(label)
        if ms is None:  # `other` (not one of the MAX_MODEL_LABELS names)
            ms = self._models[label] = ModelStats(label, self._m)
        return ms

    def _worker(self, worker: str) -> WorkerStats:
        ws = self._workers.get(worker)
        if ws is None:
            ws = self._workers[worker] = WorkerStats(worker, self._m, self.config.ttft_window)
        return ws

    def _decision(self, record: DecisionRecord) -> None:
        if not self.config.metrics:
            return
        key = (record.policy, record.reason)
        child = self._decisions.get(key)
        if child is None:
            child = self._decisions[key] = self._m.decisions.labels(*key)
        child.inc()
        self.reason_counts[key] = self.reason_counts.get(key, 0) + 1
        hist = self._match_ratio.get(record.policy)
        if hist is None:
            hist = self._match_ratio[record.policy] = self._m.match_ratio.labels(record.policy)
        hist.observe(record.match_ratio)

    def _finish(
        self,
        rt: RequestTelemetry,
        record: DecisionRecord | None,
        status: int,
        duration: float,
        ttft_s: float | None,
        reported: int | None,
    ) -> None:
        if not self.config.metrics:
            return
        ws = self._worker(NO_WORKER if record is None else record.worker)
        ms = self._model(rt.model_label)
        ws.count(rt.route, status)
        ms.count(rt.route, status)
        ws.duration.observe(duration)
        if ttft_s is not None:
            ws.observe_ttft(ttft_s)
            ms.observe_ttft(ttft_s)
        if record is not None and status < 400:
            ws.tokens(record.prompt_tokens, record.matched_tokens, reported)
            ms.tokens(record.prompt_tokens, record.matched_tokens, reported)
            out = record.outcome
            host = None if out is None else out.reported_host_tokens
            avail, matched = record.available_tokens, record.matched_tokens
            self.capture.add(avail, matched, reported, record.matched_host_tokens, host)
            ms.capture.add(avail, matched, reported, record.matched_host_tokens, host)
        if record is not None and record.slot_wait_s is not None:
            self._m.slot_waits.labels(record.policy).observe(record.slot_wait_s)

    def _retry(self, route: str) -> None:
        if self.config.metrics:
            self._m.retries.labels(route).inc()

    # -- events off the request path --------------------------------------------------

    def upstream_error(self, worker: str, kind: str) -> None:
        """A failed attempt at ``worker``; ``kind`` in :data:`UPSTREAM_ERROR_KINDS`."""
        if self.config.metrics:
            kind = kind if kind in UPSTREAM_ERROR_KINDS else OTHER
            self._error_workers.add(worker)
            self._m.upstream_errors.labels(worker, kind).inc()

    def worker_ejected(self, worker: str) -> None:
        """Outlier detection ejected ``worker``."""
        if self.config.metrics:
            self._error_workers.add(worker)
            self._m.ejections.labels(worker).inc()

    def forget_worker(self, worker: str) -> None:
        """Drop every series labelled with ``worker`` (it left the registry)."""
        self._workers.pop(worker, None)
        self._error_workers.discard(worker)
        for metric in self._m.per_worker:
            metric.remove_worker(worker)

    def _prune(self, snap: FleetSnapshot) -> None:
        known = {w.worker for w in snap.workers}
        known.add(NO_WORKER)
        labelled = self._workers.keys() | self._error_workers
        for worker in [w for w in labelled if w not in known]:
            self.forget_worker(worker)

    # -- reading ----------------------------------------------------------------------

    def use_snapshot(self, snapshot: SnapshotProvider) -> None:
        """Read fleet figures from ``snapshot`` from now on (set once the fleet is built)."""
        self._snapshot = snapshot

    def snapshot(self) -> FleetSnapshot:
        """The fleet as the snapshot provider sees it now."""
        return self._snapshot()

    def worker_stats(self) -> Mapping[str, WorkerStats]:
        """Per-worker push figures (read-only use)."""
        return self._workers

    def model_stats(self) -> Mapping[str, ModelStats]:
        """Per-``model``-label push figures (read-only use)."""
        return self._models

    def render_prometheus(self) -> bytes:
        """The registry in Prometheus text format (takes one fleet snapshot)."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Flush and stop span export. Idempotent."""
        self._tracing.shutdown()
