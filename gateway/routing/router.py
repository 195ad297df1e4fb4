"""The request path's I/O around the routing core: candidates → (``gateway.routing.decide``:
views, ``policy.select``, record, lease) → slot or prefill gate → send → relay → feedback, with
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
- A request whose base model falls under a ``models:`` entry (``gateway.routing.models``)
  is decided by that model's policy set and its attempts get that model's timeouts.
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
from gateway.config.workerspec import SGLANG
from gateway.errors import GatewayError
from gateway.forward import relay
from gateway.forward.credentials import WorkerCredentials
from gateway.forward.outbound import body_with_members, new_rid
from gateway.forward.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from gateway.routing import pd as pd_rules
from gateway.routing.decide import Choice, ExactRequest, RoutingCore
from gateway.routing.decisions import DecisionLog, DecisionOutcome, DecisionRecord
from gateway.routing.lease import Lease
from gateway.routing.lora import AdapterLoads, adapter_candidates, load_adapter, replica_load
from gateway.routing.models import ModelRoute, ModelRoutes
from gateway.routing.prefill_gate import PrefillGate
from gateway.routing.request import DP_RANK_KEYS, ApiKind, RouteRequest
from gateway.routing.slot_gate import SlotGate
from gateway.workers.kinds import dp_rank_key, kind_named
from gateway.workers.outlier import (
    OUTCOME_5XX,
    OUTCOME_CONNECT_ERROR,
    OUTCOME_SUCCESS,
    OutlierDetector,
)
from gateway.workers.registry import DECODE, PREFILL, Worker, WorkerRegistry

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

    def model_served(self, request_id: str, model: str | None) -> None:
        """The request's base model, when some worker serves it (else None); once, before
        its first decision."""

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
    attempt: int = 0  # the attempt under way (retries so far)
    route: ModelRoute | None = None  # the models: entry it falls under (its timeouts)


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
        prefill: PrefillGate | None = None,
        decode_core: RoutingCore | None = None,
    ) -> None:
        self.core = core
        # PD mode (docs/PD.md): ``core`` picks the prefill worker, this one the decode
        self.decode_core = decode_core
        self.registry = registry
        self.decisions = decisions
        self.hooks = hooks or RouterHooks()
        self._outlier = outlier
        self._fwd = forwarding
        self._drop = forwarding.credentials.drop  # the client's, when they must not go up
        self._worker_auth = forwarding.credentials.session_headers()
        self._slots = slots
        self._prefill = prefill  # SGLang workers: siblings wait for a prefill in progress
        self._exact = exact
        self._max_attempts = 1 + config.retry.max_retries
        self._lora = config.lora
        self._loads = AdapterLoads()  # this router's adapter loads and their rate bound
        self._abort_timeout = config.server.abort_timeout_s
        self._request_timeout = config.server.request_timeout_s
        self._models = ModelRoutes.from_config(config)  # per-model policy and timeouts

    def _prepare_exact(self, req: RouteRequest, model: str | None) -> PreparedExact | None:
        if self._exact is None or not self.core.policies_for(model).uses_prefix_match:
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
        call = _Call(request, req, request_id, time.perf_counter(), None)
        excluded: list[str] = []
        failure: relay.AttemptFailed | None = None
        worker: Worker | None = None
        record: DecisionRecord | None = None
        status = 503
        try:
            model, adapter = req.model, None  # as before unless some worker serves LoRA
            pd = self.decode_core is not None
            if self._lora.affinity and self.registry.serves_lora() and not pd:
                model, adapter = req.target(self.registry.served_names())
            call.route = self._models.resolve(model, self.registry)
            key = None if call.route is None else call.route.key  # its policy set's
            call.exact = self._prepare_exact(req, key)
            served = model is not None and self.registry.serves_any(model)
            self.hooks.model_served(request_id, model if served else None)
            if call.exact is not None:  # off the loop for a large body; a retry's fewer
                # candidates reuse these tokens
                ids = [w.id for w in self.registry.candidates((), model, adapter)]
                await call.exact.prepare_tokens(ids)
            for attempt in range(self._max_attempts):
                role = PREFILL if pd else None
                workers = self.registry.candidates(excluded, model, adapter, role)
                decode = self._choose_decode(req, excluded, model) if pd else None
                if not workers or (pd and decode is None):
                    if attempt == 0 and _unknown_model(self.registry, model):
                        status = 404
                        raise _model_not_found(model)
                    break
                lora_path: str | None = None
                setup: dict[str, float] = {}
                if adapter is not None:
                    weighs = self.core.policies_for(key).live.weighs_setup
                    try:
                        workers, lora_path, setup = adapter_candidates(
                            self.registry, workers, excluded, model, adapter, self._lora,
                            self._loads, weighs,
                        )  # fmt: skip
                    except GatewayError as exc:  # unknown adapter, loads rate-limited
                        status = exc.status
                        raise
                now = self.registry.clock()
                choice = self.core.choose(req, workers, now, call.exact, key, setup)
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
                record.available_tokens = choice.available_tokens  # routing capture
                record.left_out = choice.left_out  # by the shortlist of a large fleet
                record.estimated_ttft_s = choice.estimated_ttft_s
                if decode is not None:
                    d = decode.decision
                    record.decode = (d.worker_id, d.reason, decode.policy.name)
                self.decisions.add(record)
                self.hooks.decided(record)
                # the last try: attempts spent, or no other worker (PD: of either pool)
                final = attempt == self._max_attempts - 1 or (
                    len(workers) == 1 and (decode is None or len(decode.views) == 1)
                )
                call.attempt = attempt
                try:
                    if lora_path is not None and adapter not in worker.adapters:
                        assert adapter is not None  # a path comes only with an adapter
                        replica_load(workers, adapter, self._lora, self._loads, now)
                        await self._load_adapter(worker, adapter, lora_path)
                    if decode is not None:
                        response = await self._attempt_pd(call, choice, decode, record, final)
                    else:
                        response = await self._attempt(call, choice, record, final)
                except relay.AttemptFailed as exc:
                    failure = exc
                    # a DP rank's failure excludes its whole worker; PD: the side that failed
                    failed = self.registry.get(exc.worker or "") or worker
                    excluded.append(failed.server.id)
                    self.hooks.attempt_failed(failed, exc.kind, exc.status)
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
        self, call: _Call, choice: Choice, record: DecisionRecord, final: bool
    ) -> web.StreamResponse:
        """One attempt on one worker. Over 60 lines on purpose: the gates' places, the
        lease and the upstream connection are each released on every exit, and one
        try/finally that shows them all is easier to check than helpers that each hold one."""
        req, worker = call.req, choice.worker
        # the gateway's own rid: no client names (or aborts) another's work; a batch keeps
        # its body (SGLang wants a list of rids for one), so it is never aborted by rid
        rid = None if req.batch else new_rid()
        # held only for a policy that routes by the match (not for shadows' sake)
        gated = choice.indexed and choice.policy.uses_prefix_match
        slots = self._slots if gated else None
        prefill = self._prefill if gated and worker.kind == SGLANG else None
        # before the index records this prompt there: the gates compare it with the chains
        # the worker holds now (a slot-bound worker's: the slot gate; else the prefill
        # gate, with the match on it and the requests it has in prefill)
        ticket = slots.enter(worker.id, req.block_hashes) if slots is not None else None
        held = None
        if prefill is not None:
            held = prefill.enter(worker.id, req.block_hashes, choice.predicted_blocks)
        try:
            lease = self.core.dispatch(req, choice, self.registry.clock(), call.exact)
        except BaseException:
            if slots is not None and ticket is not None:
                slots.leave(ticket)
            if prefill is not None and held is not None:
                prefill.leave(held)
            raise
        on_first_byte: Callable[[], None] = lease.first_token
        if prefill is not None and held is not None:
            gate, place = prefill, held

            def prefilled() -> None:  # the prompt is cached there: its siblings go
                lease.first_token()
                gate.first_byte(place)

            on_first_byte = prefilled

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
            if prefill is not None and held is not None and held.waiting is not None:
                record.slot_wait_s = await prefill.wait(held)  # as the slot gate's
            sent_at = time.perf_counter()  # TTFT counts from dispatch, not from the head
            upstream = await self._send(call, worker, rid)
            response, outcome = await relay.relay(
                call.request,
                upstream,
                stream=req.stream,
                final=final,
                extra_headers=extra,
                started=sent_at,
                on_first_byte=on_first_byte,
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
            if prefill is not None and held is not None:
                prefill.leave(held)
            if upstream is not None:
                upstream.release()
        self._completed(call, choice, lease, outcome, record, worker)
        return response

    def _completed(
        self,
        call: _Call,
        choice: Choice,
        lease: Lease,
        outcome: relay.Outcome,
        record: DecisionRecord,
        answered: Worker,
    ) -> None:
        """A worker (``answered``: the decode in PD mode) answered whole: learn from it."""
        self._outlier.record(
            answered.server, OUTCOME_5XX if outcome.status >= 500 else OUTCOME_SUCCESS
        )
        self.core.feedback(call.req, choice, lease, outcome, self.registry.clock(), call.exact)
        tiers = outcome.cached_tiers  # cached_tokens_details (HiCache), when answered
        record.outcome = DecisionOutcome(
            status=outcome.status,
            ttft_s=outcome.ttft_s,
            reported_cached_tokens=outcome.cached_tokens,
            retries=call.attempt,
            duration_s=time.perf_counter() - call.started,
            reported_prompt_tokens=outcome.prompt_tokens,
            output_tokens=outcome.output_tokens,
            reported_device_tokens=None if tiers is None else tiers.device,
            reported_host_tokens=None if tiers is None else tiers.host,
        )
        self.hooks.completed(call.req, record)
        if outcome.failed_mid_stream:
            self._outlier.record(answered.server, OUTCOME_CONNECT_ERROR)
            log.warning("request %s: worker %s failed mid-stream", call.request_id, answered.url)

    # --- prefill/decode disaggregation (docs/PD.md) -------------------------------

    def _choose_decode(
        self, req: RouteRequest, excluded: Sequence[str], model: str | None
    ) -> Choice | None:
        """The decode worker of a PD pair, by the decode policy (None: none routable)."""
        assert self.decode_core is not None
        workers = self.registry.candidates(excluded, model, None, DECODE)
        if not workers:
            return None
        return self.decode_core.choose(req, workers, self.registry.clock())

    async def _attempt_pd(
        self, call: _Call, choice: Choice, decode: Choice, record: DecisionRecord, final: bool
    ) -> web.StreamResponse:
        """One attempt on a prefill/decode pair: the same body (with a fresh bootstrap
        room) to both at once; the decode's answer relayed, the prefill's read and
        dropped (its input logprobs merged when asked). Whichever side fails, both are
        aborted (each would otherwise wait for its partner, up to SGLang's 300 s) and
        the failure names its worker, so a retry takes a new pair without it. Over 60
        lines on purpose, like :meth:`_attempt`: both leases and both connections are
        released in the one ``finally`` below."""
        req, pw, dw = call.req, choice.worker, decode.worker
        rid = None if req.batch else new_rid()
        room = pd_rules.new_room(pw.dp_rank, len(pw.server.ranks))  # a DP rank's own room
        port = pw.bootstrap_port or pw.metadata.bootstrap_port
        plea = self.core.dispatch(req, choice, self.registry.clock(), call.exact)
        decode.views = []  # never dispatched: nothing per candidate outlives the decision
        dlea = Lease(dw, 0)  # a decode server computes no prompt: no prefill tokens
        record.index_mode = choice.index_mode
        extra = {
            "x-request-id": call.request_id,
            "x-gateway-worker": dw.url,
            "x-gateway-prefill-worker": pw.url,
            "x-gateway-matched-tokens": str(record.matched_tokens),
        }
        p_up: UpstreamResponse | None = None
        d_up: UpstreamResponse | None = None
        drain: asyncio.Task[bytes | None] | None = None
        try:
            members = [self._members(w, rid) for w in (pw, dw)]
            if req.batch:  # item i's KV is at rank (room + i) % ranks: the room places it
                members[0] = {k: v for k, v in members[0].items() if k not in DP_RANK_KEYS}
            bodies = [pd_rules.pair_body(req.body, pw.url, port, room, m) for m in members]
            sent_at = time.perf_counter()
            p_up, d_up = await self._send_pair(call, (pw, dw), rid, bodies)
            refused = await self._prefill_refused(p_up, pw)
            if refused is not None:
                p_up = None  # read whole and released
                self._abort(dw, rid, d_up)
                record.outcome = DecisionOutcome(
                    status=refused.status,
                    retries=call.attempt,
                    duration_s=time.perf_counter() - call.started,
                )
                refused.headers.update(extra)  # as every routed answer
                return refused
            self._outlier.record(pw.server, OUTCOME_SUCCESS)
            merging = pd_rules.wants_input_logprobs(req.kind, req.body)
            drain = asyncio.create_task(_read_prefill(p_up, keep=merging))
            transform = None
            if merging:
                answer = await asyncio.shield(drain)
                found = pd_rules.input_logprobs(answer) if answer else None
                transform = pd_rules.merger(found) if found else None

            def first_token() -> None:
                plea.first_token()
                dlea.first_token()

            response, outcome = await relay.relay(
                call.request,
                d_up,
                stream=req.stream,
                final=final,
                extra_headers=extra,
                started=sent_at,
                on_first_byte=first_token,
                transform=transform,
            )
        except relay.AttemptFailed as exc:
            exc.worker = exc.worker or dw.id  # the relay's failures are the decode's
            side, other = (pw, dw) if exc.worker == pw.id else (dw, pw)
            self._attempt_failed(side, rid, exc, p_up if side is pw else d_up)
            self._abort(other, rid, d_up if other is dw else p_up)
            raise
        except (relay.ClientGone, asyncio.CancelledError):
            self._abort(pw, rid, p_up)
            self._abort(dw, rid, d_up)
            raise
        finally:
            plea.release()
            dlea.release()
            if drain is not None and not drain.done():
                drain.cancel()  # the prefill answers before the decode's first token:
                # one still unread at the end is cut
            if p_up is not None:  # (by this: a drain cancelled before it ran closes nothing)
                p_up.release()
            if d_up is not None:
                d_up.release()
        self._completed(call, choice, plea, outcome, record, dw)
        return response

    async def _send_pair(
        self, call: _Call, pair: tuple[Worker, Worker], rid: str | None, bodies: list[bytes]
    ) -> tuple[UpstreamResponse, UpstreamResponse]:
        """Both sends at once; both heads, or the first failure (naming its worker) with
        the other send cancelled: a prefill whose decode is unreachable would otherwise
        hold its head (a non-streamed one comes with the whole answer) until SGLang's
        bootstrap timeout."""
        tasks = [
            asyncio.ensure_future(self._send(call, w, rid, b))
            for w, b in zip(pair, bodies, strict=True)
        ]
        waited = False
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            waited = True
        finally:  # the other send, when one failed (or this one was cancelled)
            for task in tasks:
                task.cancel()  # a no-op on a finished one
            await asyncio.gather(*tasks, return_exceptions=True)
            if not waited:  # cancelled (the client left): a head that came is closed too
                for task in tasks:
                    if not task.cancelled() and task.exception() is None:
                        task.result().close()
        heads: list[UpstreamResponse] = []
        failure: BaseException | None = None
        for task, side in zip(tasks, pair, strict=True):
            if task.cancelled():
                continue
            exc = task.exception()
            if isinstance(exc, relay.AttemptFailed) and exc.worker is None:
                exc.worker = side.id
            if exc is not None:
                failure = failure or exc
            else:
                heads.append(task.result())
        if failure is not None or len(heads) < 2:
            for head in heads:
                head.close()
            raise failure or asyncio.CancelledError()
        return heads[0], heads[1]

    async def _prefill_refused(
        self, upstream: UpstreamResponse, worker: Worker
    ) -> web.Response | None:
        """None when the prefill's head is a 2xx; else its answer ends the pair's attempt:
        a client error (4xx but 429) is relayed as is, anything else is this worker's
        failure (AttemptFailed naming it)."""
        status = upstream.status
        if 200 <= status < 300:
            return None
        try:
            body = await relay.read_whole(upstream)
        except relay.AttemptFailed as cut:  # cut or stalled: still this worker's failure
            cut.worker = worker.id
            raise
        upstream.release()
        if 400 <= status < 500 and status != 429:
            ctype = upstream.header("content-type") or "application/json"
            return web.Response(status=status, body=body, headers={"Content-Type": ctype})
        exc = relay.AttemptFailed(
            "status" if status >= 400 else "connect",
            f"the prefill worker answered {status}",
            status,
            body,
            {k: v for k, v in upstream.headers if k.lower() not in relay.HOP_BY_HOP},
        )
        exc.worker = worker.id
        raise exc

    @staticmethod
    def _members(worker: Worker, rid: str | None) -> dict[str, object]:
        """The members the gateway sets in a body for ``worker``: its rid, its DP rank."""
        members: dict[str, object] = {}
        if rid is not None and kind_named(worker.kind).abort_path is not None:
            members["rid"] = rid
        if worker.dp_rank is not None:
            members[dp_rank_key(worker.metadata.version)] = worker.dp_rank
        return members

    async def _send(
        self, call: _Call, worker: Worker, rid: str | None, body: bytes | None = None
    ) -> UpstreamResponse:
        """Send the request to ``worker`` (``body``: as given, else the client's with the
        gateway's members set); its response head, or AttemptFailed."""
        req, request = call.req, call.request
        extra = self.hooks.upstream_headers()
        if self._worker_auth:
            extra = {**extra, **self._worker_auth}
        # never the client's request id upstream, even for a batch (which has no rid)
        headers = relay.upstream_headers(request.headers, rid or new_rid(), extra, self._drop)
        route = call.route
        timeout = self._request_timeout if route is None else route.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        if body is None:
            body = req.body
            members = self._members(worker, rid)  # one DP rank of an SGLang worker: pinned
            if members:
                rewrite = ("rid" in members and (req.rid is not None or req.rid_in_body)) or (
                    worker.dp_rank is not None and req.dp_rank_in_body
                )
                drop = DP_RANK_KEYS if worker.dp_rank is not None else ()
                body = body_with_members(body, members, rewrite=rewrite, drop=drop)
        first_byte = None if route is None else route.first_byte_timeout_s
        return await relay.send(
            self._fwd.pool, worker.url, request.raw_path, body, headers, deadline, first_byte
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


async def _read_prefill(upstream: UpstreamResponse, keep: bool) -> bytes | None:
    """The prefill's answer read to its end, the connection released: returned when
    ``keep`` (its input logprobs are merged; bounded by the pool's body limit), else
    dropped chunk by chunk as it arrives (nothing of it is held); None if it failed or
    was not kept. Cancelled: the connection is closed."""
    try:
        if keep:
            return await upstream.read(upstream.limits.max_body_bytes)
        while await upstream.readany():
            pass
        return None
    except (UpstreamError, TimeoutError, aiohttp.ClientError, OSError):
        return None
    finally:
        upstream.release()
