"""The request path's I/O around the routing core: candidates → (``gateway.routing.decide``:
views, ``policy.select``, record, lease) → slot gate → send → relay → feedback, with
retries on a different worker.

Contract:
- Candidates are the registry's routable workers (or its panic set) minus the workers
  that already failed this request. The decision phases themselves (matching, selection,
  recording at dispatch, feedback to the index and cost model) are the routing core's,
  shared with the offline replay; this module keeps only what needs I/O.
- An attempt that fails before any byte reached the client (connect error, timeout while
  connecting, a 5xx or 429 answer, a stream dropped before its first event) is retried on
  another worker, at most ``max_retries`` times; never once streaming has begun, and never
  after the request timed out (its time budget is spent). When
  attempts run out the last failure is answered: the worker's own 5xx/429 as is, 502 for
  a worker that could not be reached, 504 for a timeout; 503 when no worker is routable.
- Every attempt's outcome feeds outlier detection; the final one feeds the cost model
  (TTFT of streamed requests) and index correction (the worker's reported cached tokens),
  and completes the request's :class:`~gateway.routing.decisions.DecisionRecord`.
- The lease is released exactly once on every path, including client disconnects, after
  which the upstream connection is closed and, for a worker kind with an abort endpoint
  (SGLang), the worker is sent ``/abort_request`` for the request's rid. Only such kinds
  get a ``rid`` added to the body; others get the client's body as is
  (``gateway.workers.kinds``).
- Hooks (:class:`RouterHooks`) let telemetry observe without the router knowing it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.forward import relay
from gateway.forward.credentials import WorkerCredentials
from gateway.forward.outbound import body_with_members, new_rid
from gateway.forward.upstream import UpstreamPool, UpstreamResponse
from gateway.routing.decide import Choice, ExactRequest, RoutingCore
from gateway.routing.decisions import DecisionLog, DecisionOutcome, DecisionRecord
from gateway.routing.lora import AdapterLoads, load_adapter, lora_candidates
from gateway.routing.request import DP_RANK_KEYS, ApiKind, RouteRequest
from gateway.routing.slot_gate import SlotGate
from gateway.workers.kinds import dp_rank_key, kind_named
from gateway.workers.outlier import (
    OUTCOME_5XX,
    OUTCOME_CONNECT_ERROR,
    OUTCOME_SUCCESS,
    OutlierDetector,
)
from gateway.workers.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

_NO_WORKER = "no worker is available to serve this request"
_TIMEOUTS = ("timeout", "first_byte_timeout")  # attempt failures that penalise as a 5xx


class PreparedExact(ExactRequest, Protocol):
    """A request's exact-mode view that tokenizes before the (synchronous) decision."""

    async def prepare_tokens(self, worker_ids: Sequence[str]) -> None: ...


class ExactSource(Protocol):
    """Exact mode (``gateway.exact.manager.KVEventsManager``): tokenizes a request once."""

    def prepare(self, kind: str, body: bytes) -> PreparedExact: ...


_NO_HEADERS: Mapping[str, str] = {}


class RouterHooks:
    """Telemetry's view of the request path; every method is a no-op here."""

    def decided(self, record: DecisionRecord) -> None:
        """A policy chose a worker (one call per attempt)."""

    def attempt_failed(self, worker: Worker, kind: str, status: int) -> None:
        """An attempt failed before any byte reached the client; a retry may follow."""

    def finished(
        self,
        kind: ApiKind,
        worker: Worker | None,
        status: int,
        record: DecisionRecord | None,
        duration_s: float,
    ) -> None:
        """The request is over (``worker`` is None when none was tried)."""

    def upstream_headers(self) -> Mapping[str, str]:
        """Extra headers for the worker (e.g. W3C ``traceparent``)."""
        return _NO_HEADERS

    def completed(self, req: RouteRequest, record: DecisionRecord) -> None:
        """A worker answered the request whole (``record.outcome`` is set)."""


@dataclass(frozen=True, slots=True)
class Forwarding:
    """How the router reaches workers: the pool for requests, the session and task
    spawner for fire-and-forget aborts, and what workers see of credentials."""

    pool: UpstreamPool
    session: aiohttp.ClientSession
    spawn: Callable[[Coroutine[Any, Any, None]], object]
    credentials: WorkerCredentials = field(
        default_factory=lambda: WorkerCredentials(None, gateway_checks_keys=False)
    )


@dataclass(slots=True)
class _Call:
    """One client request across its attempts."""

    request: web.Request
    req: RouteRequest
    request_id: str
    started: float
    exact: PreparedExact | None


class Router:
    def __init__(
        self,
        *,
        config: GatewayConfig,
        registry: WorkerRegistry,
        core: RoutingCore,
        outlier: OutlierDetector,
        forwarding: Forwarding,
        decisions: DecisionLog,
        hooks: RouterHooks | None = None,
        slots: SlotGate | None = None,
        exact: ExactSource | None = None,
    ) -> None:
        self.core = core
        self.registry = registry
        self.decisions = decisions
        self.hooks = hooks or RouterHooks()
        self._outlier = outlier
        self._fwd = forwarding
        self._drop = forwarding.credentials.drop  # the client's, when they must not go up
        self._worker_auth = forwarding.credentials.session_headers()
        self._slots = slots
        self._exact = exact
        self._max_attempts = 1 + config.retry.max_retries
        self._lora = config.lora
        self._loads = AdapterLoads()  # this router's adapter loads and their rate bound
        self._abort_timeout = config.server.abort_timeout_s
        self._request_timeout = config.server.request_timeout_s

    def _prepare_exact(self, req: RouteRequest) -> PreparedExact | None:
        if self._exact is None or not self.core.policies.uses_prefix_match:
            return None
        if req.kind is ApiKind.EMBEDDINGS:
            return None
        return self._exact.prepare(req.kind.value, req.body)

    # --- the request --------------------------------------------------------------

    async def handle(
        self, request: web.Request, req: RouteRequest, request_id: str
    ) -> web.StreamResponse:
        """Route, forward and relay one parsed request; raises GatewayError on failure."""
        self.core.estimate(req)
        call = _Call(request, req, request_id, time.perf_counter(), self._prepare_exact(req))
        excluded: list[str] = []
        failure: relay.AttemptFailed | None = None
        worker: Worker | None = None
        record: DecisionRecord | None = None
        status = 503
        try:
            model, adapter = req.model, None  # as before unless some worker serves LoRA
            if self._lora.affinity and self.registry.serves_lora():
                model, adapter = req.target(self.registry.served_names())
            if call.exact is not None:  # off the loop for a large body; a retry's fewer
                # candidates reuse these tokens
                ids = [w.id for w in self.registry.candidates((), model, adapter)]
                await call.exact.prepare_tokens(ids)
            for attempt in range(self._max_attempts):
                workers = self.registry.candidates(excluded, model, adapter)
                if not workers:
                    if attempt == 0 and _unknown_model(self.registry, model):
                        status = 404
                        raise _model_not_found(model)
                    break
                lora_path = None
                if adapter is not None:
                    try:
                        workers, lora_path = lora_candidates(
                            workers, adapter, self._lora, self.registry, self._loads
                        )
                    except GatewayError as exc:  # unknown adapter, loads rate-limited
                        status = exc.status
                        raise
                choice = self.core.choose(req, workers, self.registry.clock(), call.exact)
                worker = choice.worker
                record = DecisionRecord.from_decision(
                    request_id=request_id,
                    policy=choice.policy.name,
                    decision=choice.decision,
                    candidates=choice.views,
                    prompt_tokens=req.prompt_tokens,
                    model=req.model,
                )
                record.arm, record.shadows = choice.arm, choice.shadows
                record.estimated_ttft_s = choice.estimated_ttft_s
                self.decisions.add(record)
                self.hooks.decided(record)
                final = attempt == self._max_attempts - 1 or len(workers) == 1
                try:
                    if lora_path is not None and adapter not in worker.adapters:
                        await self._load_adapter(worker, adapter, lora_path)
                    response = await self._attempt(call, choice, record, final, attempt)
                except relay.AttemptFailed as exc:
                    failure = exc
                    excluded.append(worker.server.id)  # a DP rank's failure: its whole worker
                    self.hooks.attempt_failed(worker, exc.kind, exc.status)
                    if exc.kind == "timeout":
                        break  # the time budget is spent; another worker would start over
                    continue
                status = response.status
                return response
            status, error = _final_error(failure, request_id)
            if isinstance(error, web.Response):
                log.warning(
                    "request %s: workers failed; relaying the last answer, %d", request_id, status
                )
                return error
            raise error
        finally:
            elapsed = time.perf_counter() - call.started
            self.hooks.finished(req.kind, worker, status, record, elapsed)

    async def _attempt(
        self, call: _Call, choice: Choice, record: DecisionRecord, final: bool, attempt: int
    ) -> web.StreamResponse:
        """One attempt on one worker. Over 60 lines on purpose: the slot ticket, the lease
        and the upstream connection are each released on every exit, and one try/finally
        that shows all three is easier to check than three helpers that each hold one."""
        req, worker = call.req, choice.worker
        # the gateway's own rid: no client names (or aborts) another's work; a batch keeps
        # its body (SGLang wants a list of rids for one), so it is never aborted by rid
        rid = None if req.batch else new_rid()
        # held only for a policy that routes by the match (not for shadows' sake)
        gated = choice.indexed and choice.policy.uses_prefix_match
        slots = self._slots if gated else None
        # before the index records this prompt there: the gate compares it with the chains
        # the worker holds now (a slot-bound worker's, else nothing is held)
        ticket = slots.enter(worker.id, req.block_hashes) if slots is not None else None
        try:
            lease = self.core.dispatch(req, choice, self.registry.clock(), call.exact)
        except BaseException:
            if slots is not None and ticket is not None:
                slots.leave(ticket)
            raise
        record.index_mode = choice.index_mode
        upstream: UpstreamResponse | None = None
        extra = {
            "x-request-id": call.request_id,
            "x-gateway-worker": worker.url,
            "x-gateway-matched-tokens": str(record.matched_tokens),
        }
        try:
            if slots is not None and ticket is not None and ticket.waiting is not None:
                record.slot_wait_s = await slots.wait(ticket)  # counted in in-flight meanwhile
            sent_at = time.perf_counter()  # TTFT counts from dispatch, not from the head
            upstream = await self._send(call, worker, rid)
            response, outcome = await relay.relay(
                call.request,
                upstream,
                stream=req.stream,
                final=final,
                extra_headers=extra,
                started=sent_at,
                on_first_byte=lease.first_token,
            )
        except relay.AttemptFailed as exc:
            self._attempt_failed(worker, rid, exc, upstream)
            raise
        except (relay.ClientGone, asyncio.CancelledError):
            self._abort(worker, rid, upstream)
            raise
        finally:
            lease.release()
            if slots is not None and ticket is not None:
                slots.leave(ticket)
            if upstream is not None:
                upstream.release()
        self._outlier.record(
            worker.server, OUTCOME_5XX if outcome.status >= 500 else OUTCOME_SUCCESS
        )
        self.core.feedback(req, choice, lease, outcome, self.registry.clock(), call.exact)
        record.outcome = DecisionOutcome(
            status=outcome.status,
            ttft_s=outcome.ttft_s,
            reported_cached_tokens=outcome.cached_tokens,
            retries=attempt,
            duration_s=time.perf_counter() - call.started,
            reported_prompt_tokens=outcome.prompt_tokens,
            output_tokens=outcome.output_tokens,
        )
        self.hooks.completed(req, record)
        if outcome.failed_mid_stream:
            self._outlier.record(worker.server, OUTCOME_CONNECT_ERROR)
            log.warning("request %s: worker %s failed mid-stream", call.request_id, worker.url)
        return response

    async def _send(self, call: _Call, worker: Worker, rid: str | None) -> UpstreamResponse:
        req, request = call.req, call.request
        extra = self.hooks.upstream_headers()
        if self._worker_auth:
            extra = {**extra, **self._worker_auth}
        # never the client's request id upstream, even for a batch (which has no rid)
        headers = relay.upstream_headers(request.headers, rid or new_rid(), extra, self._drop)
        deadline = asyncio.get_running_loop().time() + self._request_timeout
        aborts = kind_named(worker.kind).abort_path is not None
        members: dict[str, object] = {}
        rewrite = False
        if aborts and rid is not None:
            members["rid"] = rid
            rewrite = req.rid is not None or req.rid_in_body
        if worker.dp_rank is not None:  # one DP rank of an SGLang worker: pin it there
            members[dp_rank_key(worker.metadata.version)] = worker.dp_rank
            rewrite = rewrite or req.dp_rank_in_body
        body = req.body
        if members:
            drop = DP_RANK_KEYS if worker.dp_rank is not None else ()
            body = body_with_members(body, members, rewrite=rewrite, drop=drop)
        return await relay.send(
            self._fwd.pool, worker.url, request.raw_path, body, headers, deadline
        )

    def _attempt_failed(
        self,
        worker: Worker,
        rid: str | None,
        exc: relay.AttemptFailed,
        upstream: UpstreamResponse | None,
    ) -> None:
        if exc.kind == "connect" or exc.kind == "dropped":
            self._outlier.record(worker.server, OUTCOME_CONNECT_ERROR)
        elif (exc.kind == "status" and exc.status >= 500) or exc.kind in _TIMEOUTS:
            self._outlier.record(worker.server, OUTCOME_5XX)  # a hang counts like a 5xx
        if exc.kind in ("dropped", *_TIMEOUTS):
            self._abort(worker, rid, upstream)  # it may still be working on it

    async def _load_adapter(self, worker: Worker, adapter: str | None, path: str) -> None:
        """``adapter`` onto ``worker`` before the request goes there (``routing.lora``); a
        refusal fails this attempt like a 502 (another worker is tried)."""
        assert adapter is not None
        why = await load_adapter(
            self._fwd.session,
            worker,
            (adapter, path),
            self._lora,
            self.registry,
            self._worker_auth,
            self._loads,
        )
        if why is not None:
            log.warning("worker %s: loading LoRA adapter %r: %s", worker.url, adapter[:128], why)
            raise relay.AttemptFailed("lora_load", why)

    def _abort(self, worker: Worker, rid: str | None, upstream: UpstreamResponse | None) -> None:
        if upstream is not None:
            upstream.close()  # the only abort llama.cpp honours (streamed requests only)
        path = kind_named(worker.kind).abort_path
        if path is not None and rid is not None:
            self._fwd.spawn(
                relay.abort(self._fwd.session, worker.url, rid, self._abort_timeout, path)
            )


def _unknown_model(registry: WorkerRegistry, model: str | None) -> bool:
    """A model no worker serves, when the gateway routes by model (several behind it)."""
    return model is not None and registry.multi_model() and not registry.serves_any(model)


def _model_not_found(model: str | None) -> GatewayError:
    """OpenAI's answer to an unknown model: 404, ``model_not_found``, naming it."""
    return GatewayError(
        404,
        f"The model `{model}` does not exist or is not served by any worker.",
        param="model",
        err_type="invalid_request_error",
        code="model_not_found",
    )


def _final_error(
    failure: relay.AttemptFailed | None, request_id: str
) -> tuple[int, GatewayError | web.Response]:
    """The answer once attempts ran out: the worker's own error, else ours."""
    if failure is None:
        return 503, GatewayError(503, _NO_WORKER, retry_after=1.0)
    if failure.kind == "status":
        headers = {
            k: v
            for k, v in failure.headers.items()
            if k.lower() not in relay.HOP_BY_HOP | {"date", "server"}
        }
        headers["x-request-id"] = request_id
        return failure.status, web.Response(
            status=failure.status, body=failure.body, headers=headers
        )
    if failure.kind in _TIMEOUTS:
        return 504, GatewayError(504, "the worker timed out")
    return 502, GatewayError(502, f"no worker could serve the request: {failure.message}")
