"""Telemetry's adapters to the gateway core, so wiring it in is a few one-line calls.

- :func:`telemetry_middleware` begins each API request's telemetry (span parented on the
  client's ``traceparent``; route label = the API path) and finishes requests the router
  never saw (400, 401, 413, admission 429/503) with worker ``none``.
- :class:`TelemetryHooks` implements the router's ``RouterHooks``: the request's served
  base model (its ``model`` label), decisions, failed attempts, the end of a request
  (status, TTFT and reported cached tokens from the decision record's outcome) and the
  trace headers for the worker. Without the middleware it begins the request's
  telemetry itself at its first call.
- :class:`RegistrySnapshot` is the scrape-time :data:`SnapshotProvider`: it copies the
  registry's, the prefix index's and admission's figures. Reads only; O(workers).

Contract: the middleware must run inside the server's (after it stored the request id).
A client that went away is counted with status 499.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Protocol

from aiohttp import web

from gateway.errors import GatewayError
from gateway.forward.relay import ClientGone
from gateway.http.admission import Admission
from gateway.http.handlers import API_PATHS, REQUEST_ID
from gateway.routing.decisions import DecisionOutcome, DecisionRecord
from gateway.routing.request import ApiKind, RouteRequest
from gateway.routing.router import RouterHooks
from gateway.telemetry.hub import OTHER, RequestTelemetry, Telemetry, current_request
from gateway.telemetry.snapshot import FleetSnapshot, IndexFigures, WorkerSnapshot
from gateway.workers.registry import Worker, WorkerRegistry

STATUS_CLIENT_GONE = 499  # nginx's "client closed request"
_ROUTES: Mapping[ApiKind, str] = {kind: path for path, kind in API_PATHS.items()}
_NO_HEADERS: Mapping[str, str] = {}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def upstream_error_kind(kind: str, status: int) -> str:
    """The router's failure kind (connect/timeout/status/dropped) as a metric label."""
    if kind == "status":
        if status == 429:
            return "http_429"
        return "http_5xx" if status >= 500 else OTHER
    if kind == "dropped":
        return "stream"
    return kind if kind in ("connect", "timeout") else OTHER


def _exception_status(exc: BaseException) -> int:
    if isinstance(exc, GatewayError | web.HTTPException):
        return exc.status
    if isinstance(exc, ClientGone | asyncio.CancelledError):
        return STATUS_CLIENT_GONE
    return 500


def telemetry_middleware(telemetry: Telemetry, paths: Collection[str] = tuple(API_PATHS)) -> Any:
    """An aiohttp middleware for the API ``paths``; add it after the server's middleware."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in paths:
            return await handler(request)
        request_id = str(request.get(REQUEST_ID) or request.headers.get("x-request-id", "-"))
        rt = telemetry.begin_request(request_id, request.path, None, request.headers)
        try:
            response = await handler(request)
        except BaseException as exc:
            rt.finish(_exception_status(exc))
            raise
        rt.finish(response.status)  # a no-op when the router's hooks finished it
        return response

    return middleware


class TelemetryHooks(RouterHooks):
    """The router's hooks, feeding :class:`Telemetry`."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._t = telemetry

    def _request(self, request_id: str, model: str | None) -> RequestTelemetry:
        rt = current_request()
        if rt is None or rt.finished or rt.request_id != request_id:
            rt = self._t.begin_request(request_id, "unknown", model)
        return rt

    def decided(self, record: DecisionRecord) -> None:
        self._request(record.request_id, record.model).decided(record)
        self._t.tuning.decided(record)

    def model_served(self, request_id: str, model: str | None) -> None:
        self._request(request_id, None).model_label = self._t.model_label(model)

    def completed(self, req: RouteRequest, record: DecisionRecord) -> None:
        self._t.tuning.finished(record)
        self._t.tuning.trace.add(req, record)

    def attempt_failed(self, worker: Worker, kind: str, status: int) -> None:
        self._t.upstream_error(worker.id, upstream_error_kind(kind, status))
        rt = current_request()
        record = None if rt is None else rt.record
        if rt is not None and record is not None and record.outcome is None:
            # This attempt's record ends here: what the client would have got from it.
            shown = status if kind == "status" else 504 if kind == "timeout" else 502
            record.outcome = DecisionOutcome(status=shown, retries=rt.retries)

    def finished(
        self,
        kind: ApiKind,
        worker: Worker | None,
        status: int,
        record: DecisionRecord | None,
        duration_s: float,
    ) -> None:
        rt = current_request()
        if rt is None or rt.finished:
            if record is None:
                return  # nothing routed and nobody began this request: nothing to add
            rt = self._request(record.request_id, record.model)
        rt.route = _ROUTES.get(kind, rt.route)
        exc = sys.exception()
        if isinstance(exc, ClientGone | asyncio.CancelledError):
            status = STATUS_CLIENT_GONE
        elif isinstance(exc, GatewayError):  # raised mid-attempt (a body it cannot send)
            status = exc.status
        outcome = record.outcome if record is not None else None
        if outcome is not None and worker is not None and outcome.status >= 429:
            self._t.upstream_error(worker.id, upstream_error_kind("status", outcome.status))
        rt.finish(
            status,
            reported_cached_tokens=None if outcome is None else outcome.reported_cached_tokens,
            ttft_s=None if outcome is None else outcome.ttft_s,
        )

    def upstream_headers(self) -> Mapping[str, str]:
        """W3C trace headers for the current request's upstream call (empty when off)."""
        rt = current_request()
        return _NO_HEADERS if rt is None else rt.upstream_headers()


class IndexStatsSource(Protocol):
    """What the snapshot needs of ``gateway.routing.prefix_index.PrefixIndex``."""

    def stats(self, worker_id: str) -> Any: ...


class ModeSource(Protocol):
    """Exact mode's figures per worker (``gateway.exact.manager.KVEventsManager``)."""

    @property
    def fidelity(self) -> Mapping[tuple[str, str], Any]: ...

    def mode(self, worker_id: str) -> str: ...

    def reason(self, worker_id: str) -> str: ...


class TokenRatioSource(Protocol):
    """Characters per token learnt from the workers (``gateway.routing.tokens``)."""

    def worker_chars_per_token(self, worker_id: str) -> float: ...
    def model_ratios(self) -> dict[str, float]: ...


MODE_APPROXIMATE = "approximate"  # every worker's mode when exact mode is off
EXACT_OFF = "exact mode is off (kv_events.enabled: false)"


class RegistrySnapshot:
    """A :data:`SnapshotProvider` over the registry, the prefix index and admission."""

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        index: IndexStatsSource | None = None,
        admission: Admission | None = None,
        policy: str | None = None,
        modes: ModeSource | None = None,
        tokens: TokenRatioSource | None = None,
    ) -> None:
        self.registry = registry
        self.index = index
        self.admission = admission
        self.policy = policy
        self.modes = modes
        self.tokens = tokens

    def _worker(self, w: Worker, now: float) -> WorkerSnapshot:
        load = w.engine_load
        figures = None
        if self.index is not None:
            st = self.index.stats(w.id)
            cpt = None if self.tokens is None else self.tokens.worker_chars_per_token(w.id)
            figures = IndexFigures(
                st.blocks, st.approx_bytes, st.predicted_tokens, st.reported_tokens, cpt
            )
        return WorkerSnapshot(
            worker=w.id,
            url=w.url,
            healthy=w.healthy,
            health_flags={f.value: True for f in w.flags},
            in_flight=w.in_flight,
            queued=max(0, w.in_flight - w.decoding_requests),
            queued_prefill_tokens=w.queued_prefill_tokens,
            engine_running=None if load is None else load.running_requests,
            engine_waiting=None if load is None else load.waiting_requests,
            engine_token_usage=None if load is None else load.token_usage,
            engine_age_s=None if load is None else max(0.0, now - w.load_read_at),
            index=figures,
            index_mode=MODE_APPROXIMATE if self.modes is None else self.modes.mode(w.id),
            index_mode_reason=EXACT_OFF if self.modes is None else self.modes.reason(w.id),
            mode_fidelity=() if self.modes is None else self._fidelity(w.id),
            role=w.role,
        )

    def _fidelity(self, worker_id: str) -> list[tuple[str, int, int, int, int]]:
        assert self.modes is not None
        return [
            (mode, f.requests, f.predicted_tokens, f.true_predicted_tokens, f.reported_tokens)
            for (wid, mode), f in list(self.modes.fidelity.items())
            if wid == worker_id
        ]

    def __call__(self) -> FleetSnapshot:
        now = self.registry.clock()
        adm = self.admission
        return FleetSnapshot(
            workers=[self._worker(w, now) for w in self.registry.targets()],
            chars_per_token={} if self.tokens is None else self.tokens.model_ratios(),
            policy=self.policy,
            admission_in_flight=None if adm is None else adm.active,
            admission_queued=None if adm is None else adm.waiting,
            admission_rejections=None if adm is None else dict(adm.rejected),
        )
