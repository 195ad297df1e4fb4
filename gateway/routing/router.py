"""The request path: candidates → prefix match → ``policy.select`` → record → lease →
forward → relay → feedback, with retries on a different worker.

Contract:
- Candidates are the registry's routable workers (or its panic set) minus the workers
  that already failed this request.
- The prefix index is matched only when the policy says it uses the match
  (``Policy.uses_prefix_match``), and recorded at dispatch, before the worker answers, so
  a burst of requests sharing a prefix co-locates.
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
import random
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.forward import relay
from gateway.forward.credentials import WorkerCredentials
from gateway.forward.upstream import UpstreamPool, UpstreamResponse
from gateway.routing.decisions import DecisionLog, DecisionOutcome, DecisionRecord
from gateway.routing.lease import Lease
from gateway.routing.request import ApiKind, RouteRequest
from gateway.routing.slot_gate import SlotGate
from gateway.workers.kinds import kind_named
from gateway.workers.outlier import (
    OUTCOME_5XX,
    OUTCOME_CONNECT_ERROR,
    OUTCOME_SUCCESS,
    OutlierDetector,
)
from gateway.workers.registry import Worker, WorkerRegistry
from policies.base import Decision, Policy, RouteContext, WorkerCost, WorkerView, least_loaded

log = logging.getLogger(__name__)

_NO_WORKER = "no worker is available to serve this request"
_TIMEOUTS = ("timeout", "first_byte_timeout")  # attempt failures that penalise as a 5xx


class PrefixMatcher(Protocol):
    """What the router needs of the prefix index (``gateway.routing.prefix_index.PrefixIndex``)."""

    def match(self, block_hashes: Sequence[int]) -> Mapping[str, int]: ...
    def record(self, block_hashes: Sequence[int], worker_id: str) -> None: ...
    def correct(
        self,
        worker_id: str,
        block_hashes: Sequence[int],
        predicted_blocks: int,
        reported_tokens: int,
    ) -> Any: ...
    def release(self, worker_id: str, block_hashes: Sequence[int]) -> None: ...


class ExactRequest(Protocol):
    """Exact mode's view of one request (``gateway.exact.kv_events.ExactRequest``)."""

    def match(self, worker_ids: Sequence[str]) -> Mapping[str, int]: ...
    def dispatched(self, worker_id: str) -> None: ...
    def mode(self, worker_id: str) -> str: ...
    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None: ...


class ExactSource(Protocol):
    """Exact mode (``gateway.exact.kv_events.KVEventsManager``): tokenizes a request once."""

    def prepare(self, kind: str, body: bytes) -> ExactRequest: ...


class CostSource(Protocol):
    """What the router needs of the cost model (``gateway.routing.cost_model.CostModel``)."""

    def observe(
        self, worker_id: str, uncached_tokens: int, queued_tokens_ahead: int, ttft_s: float
    ) -> Any: ...
    def cost(self, worker_id: str) -> WorkerCost: ...


class NoCosts:
    """A cost source that knows nothing: policies fall back to their defaults."""

    def observe(
        self, worker_id: str, uncached_tokens: int, queued_tokens_ahead: int, ttft_s: float
    ) -> None:
        return None

    def cost(self, worker_id: str) -> WorkerCost:
        return _NO_COST


_NO_COST = WorkerCost()
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


class Router:
    def __init__(
        self,
        *,
        config: GatewayConfig,
        registry: WorkerRegistry,
        policy: Policy,
        index: PrefixMatcher,
        costs: CostSource,
        outlier: OutlierDetector,
        session: aiohttp.ClientSession,
        pool: UpstreamPool,
        decisions: DecisionLog,
        spawn: Callable[[Coroutine[Any, Any, None]], object],
        rng: random.Random,
        hooks: RouterHooks | None = None,
        exact: ExactSource | None = None,
        slots: SlotGate | None = None,
        credentials: WorkerCredentials | None = None,
    ) -> None:
        self.policy = policy
        self._exact = exact
        self._slots = slots
        creds = credentials or WorkerCredentials(None, gateway_checks_keys=False)
        self._drop = creds.drop  # the client's credentials, when they must not go upstream
        self._worker_auth = creds.session_headers()
        self.registry = registry
        self.decisions = decisions
        self.hooks = hooks or RouterHooks()
        self._index = index
        self._costs = costs
        self._outlier = outlier
        self._session = session
        self._spawn = spawn
        self._rng = rng
        self._max_attempts = 1 + config.retry.max_retries
        self._abort_timeout = config.server.abort_timeout_s
        self._request_timeout = config.server.request_timeout_s
        self._pool = pool

    # --- phases -------------------------------------------------------------------

    def _views(
        self, req: RouteRequest, workers: Sequence[Worker], exact: ExactRequest | None = None
    ) -> tuple[list[WorkerView], Mapping[str, int]]:
        """Candidates as the policy sees them, with this request's matched tokens; and the
        matched blocks per worker id (approximate index). Workers in exact mode get their
        matched tokens from the exact index instead (``exact``)."""
        now = self.registry.clock()
        matches: Mapping[str, int] = {}
        if self.policy.uses_prefix_match and req.block_hashes:
            matches = self._index.match(req.block_hashes)
        exact_tokens = exact.match([w.id for w in workers]) if exact is not None else {}
        # optional index capability (the in-process PrefixIndex has it): slot-bound workers
        free = getattr(self._index, "free_sequences", None)
        views = [
            w.view(
                now,
                exact_tokens[w.id]
                if w.id in exact_tokens
                else req.matched_tokens(matches.get(w.id, 0)),
                self._costs.cost(w.id),
                free(w.id) if free is not None else None,
            )
            for w in workers
        ]
        return views, matches

    def _prepare_exact(self, req: RouteRequest) -> ExactRequest | None:
        if self._exact is None or not self.policy.uses_prefix_match:
            return None
        if req.kind is ApiKind.EMBEDDINGS:
            return None
        return self._exact.prepare(req.kind.value, req.body)

    def _select(self, req: RouteRequest, views: Sequence[WorkerView]) -> Decision:
        if req.kind is ApiKind.EMBEDDINGS:
            # Embeddings hold no reusable cache: routed by load alone.
            return Decision(least_loaded(views, self._rng).id, "load")
        if len(views) == 1 and not self.policy.uses_prefix_match:
            return Decision(views[0].id, "only_candidate")
        ctx = RouteContext(
            prompt_tokens=req.prompt_tokens,
            candidates=views,
            rng=self._rng,
            routing_key=req.routing_key,
            prompt_chars=req.prompt_chars,
        )
        return self.policy.select(ctx)

    def _dispatch(
        self,
        req: RouteRequest,
        worker: Worker,
        record: DecisionRecord,
        exact: ExactRequest | None = None,
    ) -> Lease:
        if req.block_hashes and self.policy.uses_prefix_match:
            self._index.record(req.block_hashes, worker.id)  # at dispatch: siblings co-locate
        if exact is not None:
            record.index_mode = exact.mode(worker.id)
            exact.dispatched(worker.id)
        return Lease(worker, max(0, req.prompt_tokens - record.matched_tokens))

    def _feedback(
        self,
        req: RouteRequest,
        worker: Worker,
        lease: Lease,
        predicted_blocks: int,
        record: DecisionRecord,
        outcome: relay.Outcome,
        exact: ExactRequest | None = None,
    ) -> None:
        self._outlier.record(worker, OUTCOME_5XX if outcome.status >= 500 else OUTCOME_SUCCESS)
        reported = outcome.cached_tokens
        if req.block_hashes and self.policy.uses_prefix_match:
            if reported is not None:
                self._index.correct(worker.id, req.block_hashes, predicted_blocks, reported)
            else:
                self._index.release(worker.id, req.block_hashes)
        if exact is not None and reported is not None and record.index_mode is not None:
            exact.observe(worker.id, record.index_mode, record.matched_tokens, reported)
        if outcome.ttft_s is not None and outcome.status == 200:
            uncached = req.prompt_tokens - (
                reported if reported is not None else record.matched_tokens
            )
            self._costs.observe(worker.id, max(0, uncached), lease.queued_ahead, outcome.ttft_s)

    # --- the request --------------------------------------------------------------

    async def handle(
        self, request: web.Request, req: RouteRequest, request_id: str
    ) -> web.StreamResponse:
        """Route, forward and relay one parsed request; raises GatewayError on failure."""
        started = time.perf_counter()
        excluded: list[str] = []
        failure: relay.AttemptFailed | None = None
        worker: Worker | None = None
        record: DecisionRecord | None = None
        status = 503
        exact = self._prepare_exact(req)
        try:
            for attempt in range(self._max_attempts):
                workers = self.registry.candidates(excluded)
                if not workers:
                    break
                views, matches = self._views(req, workers, exact)
                decision = self._select(req, views)
                worker = self.registry.get(decision.worker_id) or workers[0]
                record = DecisionRecord.from_decision(
                    request_id=request_id,
                    policy=self.policy.name,
                    decision=decision,
                    candidates=views,
                    prompt_tokens=req.prompt_tokens,
                    model=req.model,
                )
                self.decisions.add(record)
                self.hooks.decided(record)
                final = attempt == self._max_attempts - 1 or len(workers) == 1
                try:
                    response = await self._attempt(
                        request,
                        req,
                        worker,
                        record,
                        request_id,
                        final,
                        started,
                        attempt,
                        matches.get(worker.id, 0),
                        exact,
                    )
                except relay.AttemptFailed as exc:
                    failure = exc
                    excluded.append(worker.id)
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
            self.hooks.finished(req.kind, worker, status, record, time.perf_counter() - started)

    async def _attempt(
        self,
        request: web.Request,
        req: RouteRequest,
        worker: Worker,
        record: DecisionRecord,
        request_id: str,
        final: bool,
        started: float,
        attempt: int,
        predicted_blocks: int,
        exact: ExactRequest | None = None,
    ) -> web.StreamResponse:
        rid = req.rid or request_id
        slots = self._slots if req.block_hashes and self.policy.uses_prefix_match else None
        # before the index records this prompt there: the gate compares it with the chains
        # the worker holds now (a slot-bound worker's, else nothing is held)
        ticket = slots.enter(worker.id, req.block_hashes) if slots is not None else None
        try:
            lease = self._dispatch(req, worker, record, exact)
        except BaseException:
            if slots is not None and ticket is not None:
                slots.leave(ticket)
            raise
        upstream: UpstreamResponse | None = None
        extra = {
            "x-request-id": request_id,
            "x-gateway-worker": worker.url,
            "x-gateway-matched-tokens": str(record.matched_tokens),
        }
        try:
            if slots is not None and ticket is not None and ticket.waiting is not None:
                record.slot_wait_s = await slots.wait(ticket)  # counted in in-flight meanwhile
            sent_at = time.perf_counter()  # TTFT counts from dispatch, not from the head
            upstream = await self._send(req, worker, rid, request)
            response, outcome = await relay.relay(
                request,
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
        self._feedback(req, worker, lease, predicted_blocks, record, outcome, exact)
        record.outcome = DecisionOutcome(
            status=outcome.status,
            ttft_s=outcome.ttft_s,
            reported_cached_tokens=outcome.cached_tokens,
            retries=attempt,
            duration_s=time.perf_counter() - started,
        )
        if outcome.failed_mid_stream:
            self._outlier.record(worker, OUTCOME_CONNECT_ERROR)
            log.warning("request %s: worker %s failed mid-stream", request_id, worker.url)
        return response

    async def _send(
        self, req: RouteRequest, worker: Worker, rid: str, request: web.Request
    ) -> UpstreamResponse:
        extra = self.hooks.upstream_headers()
        if self._worker_auth:
            extra = {**extra, **self._worker_auth}
        headers = relay.upstream_headers(request.headers, rid, extra, self._drop)
        deadline = asyncio.get_running_loop().time() + self._request_timeout
        aborts = kind_named(worker.kind).abort_path is not None
        body = req.body_with_rid(rid) if aborts else req.body
        return await relay.send(self._pool, worker.url, request.raw_path, body, headers, deadline)

    def _attempt_failed(
        self, worker: Worker, rid: str, exc: relay.AttemptFailed, upstream: UpstreamResponse | None
    ) -> None:
        if exc.kind == "connect" or exc.kind == "dropped":
            self._outlier.record(worker, OUTCOME_CONNECT_ERROR)
        elif (exc.kind == "status" and exc.status >= 500) or exc.kind in _TIMEOUTS:
            self._outlier.record(worker, OUTCOME_5XX)  # a hang counts like a 5xx
        if exc.kind in ("dropped", *_TIMEOUTS):
            self._abort(worker, rid, upstream)  # it may still be working on it

    def _abort(self, worker: Worker, rid: str, upstream: UpstreamResponse | None) -> None:
        if upstream is not None:
            upstream.close()  # the only abort llama.cpp honours (streamed requests only)
        path = kind_named(worker.kind).abort_path
        if path is not None:
            self._spawn(relay.abort(self._session, worker.url, rid, self._abort_timeout, path))


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
