"""HTTP handlers for the inference API, the gateway's health, and the listener.

Contract:
- ``POST /v1/chat/completions``, ``/v1/completions``, ``/generate``, ``/v1/embeddings``:
  read the body (413 over ``max_payload_size``), parse it once (400 with the field named),
  pass admission (429/503), then hand it to the router. The client's bytes reach the
  worker untouched except for the ``rid`` the gateway needs to abort.
- ``GET /v1/models``: the workers' model cards, fetched live and deduplicated by id.
- ``GET /health`` and ``/readiness``: 200 while a worker is routable, 503 otherwise;
  ``GET /liveness``: 200 while the process serves, whatever the workers (restart probes).
- The middleware renders every error as OpenAI-style JSON with ``x-request-id``, logs one
  line per error (5xx at WARNING, 4xx at INFO), checks keys (``gateway.http.auth``: client
  keys on the API, the admin key on admin routes, probes open unless configured) and
  applies the per-key rate limit (``gateway.http.ratelimit``, API routes only); the router
  swaps the client's credentials for the worker's (``gateway.forward.credentials``)
  as it builds the upstream headers. No line is logged per successful request; keys and
  prompts are never logged.
- While active probes flag every worker, a well-formed API request gets a fast 503 with
  ``Retry-After`` instead of being tried on each dead worker in turn.
- The listener passes through ``gateway.http.connguard`` (connection cap, a deadline for
  every request head); aiohttp bounds header sizes and idle keep-alive; bodies are read
  within a deadline (408). On SIGTERM the listener closes and in-flight requests get
  ``shutdown_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import HttpVersion10, web

from gateway.config import GatewayConfig
from gateway.errors import GatewayError, error_response, render
from gateway.forward.relay import ClientGone
from gateway.http import app_keys
from gateway.http.auth import ANONYMOUS, Authenticator, collect_keys, path_scope
from gateway.http.connguard import NOT_IMPLEMENTED_TYPE, ConnectionGuard, GuardedSite
from gateway.http.ratelimit import RateLimiter
from gateway.routing.request import ApiKind, RequestError, RouteRequest, parse_request
from gateway.workers.registry import HealthFlag, WorkerRegistry

log = logging.getLogger(__name__)

REQUEST_ID = web.RequestKey("gateway_request_id", str)  # the request's id, set first
API_PATHS: dict[str, ApiKind] = {
    "/v1/chat/completions": ApiKind.CHAT,
    "/v1/completions": ApiKind.COMPLETIONS,
    "/generate": ApiKind.GENERATE,
    "/v1/embeddings": ApiKind.EMBEDDINGS,
}
OPEN_PATHS = frozenset({"/health", "/readiness", "/liveness", "/metrics"})
_REQUEST_ID = re.compile(r"[!-~]{1,128}")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def request_id_of(request: web.Request, header_names: tuple[str, ...]) -> str:
    """The client's request id (the first of ``header_names`` present) if it is 1 to 128
    visible ASCII characters, else a fresh one: it is echoed in a header and logged, so
    nothing else is taken. The worker's rid is the gateway's own, never this one."""
    headers = request.headers
    for name in header_names:
        value = headers.get(name)
        if value:
            if _REQUEST_ID.fullmatch(value):
                return value
            break
    return os.urandom(16).hex()  # as unique as uuid4().hex, a few times cheaper


# Failed key checks per client address: a burst, then one per second (key guessing).
FAILED_KEYS_PER_S = 1.0
FAILED_KEYS_BURST = 20


def make_middleware(config: GatewayConfig) -> Any:
    header_names = config.server.request_id_headers
    auth = make_authenticator(config)
    limiter = RateLimiter(config.server.rate_limit_per_s, config.server.rate_limit_burst)
    failures = RateLimiter(FAILED_KEYS_PER_S, FAILED_KEYS_BURST)
    guarded = auth.enabled or limiter.enabled  # else the hot path skips both

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = request_id_of(request, header_names)
        request[REQUEST_ID] = request_id
        try:
            if request.version < HttpVersion10:  # a request line without a version
                raise GatewayError(400, "HTTP/0.9 requests are not served")
            if guarded:
                _admit(request, auth, limiter, failures)
            return await handler(request)
        except GatewayError as exc:
            _log_error(request_id, request, exc.status, exc.message)
            return render(exc, headers={"x-request-id": request_id})
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            status, message = _http_error(exc, request)
            _log_error(request_id, request, status, message)
            response = error_response(
                status,
                message,
                err_type=NOT_IMPLEMENTED_TYPE.get(status),
                headers={"x-request-id": request_id, **_allow(exc)},
            )
            if status == 501:  # after CONNECT the parser reads the rest as a tunnel
                response.force_close()
            return response

    return middleware


def make_authenticator(config: GatewayConfig) -> Authenticator:
    """Client and admin keys from every configured source (flag, list, env, files).
    Without an admin key, ``server.api_key`` (when set) is the only client key allowed on
    the admin routes: it is the key workers receive (``gateway.http.auth``)."""
    s = config.server
    clients = collect_keys(
        single=s.api_key, listed=s.api_keys, env_var=s.api_keys_env, file=s.api_keys_file
    )
    admins = collect_keys(single=s.admin_api_key, file=s.admin_api_keys_file)
    shared = (s.api_key or "").strip()
    fallback = (shared,) if shared else None
    return Authenticator(clients, admins, protect_probes=s.protect_probes, admin_fallback=fallback)


def _admit(
    request: web.Request, auth: Authenticator, limiter: RateLimiter, failures: RateLimiter
) -> None:
    """Keys (failed checks bounded per address), then the rate limit; GatewayError
    401/403/429."""
    address = "addr:" + (request.remote or "")
    wait = failures.wait(address)
    if wait is not None:
        raise GatewayError(429, "too many failed key checks from this address", retry_after=wait)
    try:
        principal = auth.check(request.path, request.headers)
    except GatewayError as exc:
        if exc.status == 401:
            failures.take(address)
        raise
    if limiter.enabled and path_scope(request.path) == "api":
        if principal == ANONYMOUS:
            principal = address
        wait = limiter.take(principal)
        if wait is not None:
            raise GatewayError(429, "rate limit exceeded for this API key", retry_after=wait)


def _http_error(exc: web.HTTPException, request: web.Request) -> tuple[int, str]:
    """Status and message for aiohttp's routing errors (405 keeps its ``Allow``)."""
    if exc.status == 404 and request.method == "CONNECT":
        # an authority-form target has no path to route: the gateway is no forward proxy
        return 501, "the CONNECT method is not implemented: the gateway is not a proxy"
    if exc.status == 404:
        return 404, f"no route for {request.method} {request.path}"
    if exc.status == 405:
        return 405, f"method {request.method} is not allowed on {request.path}"
    if exc.status == 413:
        return 413, "request body is larger than the gateway's max_payload_size"
    return exc.status, exc.reason


def _allow(exc: web.HTTPException) -> dict[str, str]:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else {}


def _log_error(request_id: str, request: web.Request, status: int, message: str) -> None:
    level = logging.WARNING if status >= 500 and status != 501 else logging.INFO
    log.log(
        level, "request %s %s %s: %d %s", request_id, request.method, request.path, status, message
    )


# --- API handlers ---------------------------------------------------------------------


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise GatewayError(413, f"request body of {length} bytes exceeds the limit of {limit}")
    try:
        if request.content.is_eof():  # the whole body came with the head: no wait, no timer
            return await request.read()
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise GatewayError(413, f"request body exceeds the limit of {limit} bytes") from None
    except TimeoutError:
        raise GatewayError(408, f"the request body did not arrive within {timeout_s:g} s") from None


async def api_handler(request: web.Request) -> web.StreamResponse:
    app = request.app
    kind = API_PATHS[request.path]
    server_cfg = app[app_keys.CONFIG].server
    body = await _read_body(request, server_cfg.max_payload_size, server_cfg.client_body_timeout_s)
    try:
        req = parse_request(kind, body, request.headers, app[app_keys.SETTINGS])
    except RequestError as exc:
        raise GatewayError(
            exc.status, exc.message, param=exc.param, err_type=exc.err_type
        ) from None
    registry = app[app_keys.REGISTRY]
    if not registry.ready() and _all_down(registry):  # fail fast, not worker by worker
        raise GatewayError(503, "every worker is failing its health checks", retry_after=1.0)
    admission = app[app_keys.ADMISSION]
    if not admission.limited:  # the common case: no context manager on the hot path
        return await _route(app, request, req)
    await admission.acquire()
    try:
        return await _route(app, request, req)
    finally:
        admission.release()


def _all_down(registry: WorkerRegistry) -> bool:
    """True when active probes flagged every worker (or it drains): nothing will answer.
    Unchecked (just added) or only ejected workers are still tried."""
    workers = list(registry)
    return bool(workers) and all(
        HealthFlag.CHECK_FAILED in w.flags or HealthFlag.DRAINING in w.flags for w in workers
    )


async def _route(
    app: web.Application, request: web.Request, req: RouteRequest
) -> web.StreamResponse:
    try:
        return await app[app_keys.ROUTER].handle(request, req, request[REQUEST_ID])
    except ClientGone as gone:
        return gone.response  # aiohttp ignores the closed transport from here


async def liveness(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def readiness(request: web.Request) -> web.Response:
    registry = request.app[app_keys.REGISTRY]
    ready = registry.ready()
    body = {
        "status": "ok" if ready else "unavailable",
        "workers": len(registry),
        "healthy_workers": registry.healthy_count(),
    }
    headers = {} if ready else {"Retry-After": "1"}
    return web.Response(
        status=200 if ready else 503,
        body=orjson.dumps(body),
        content_type="application/json",
        headers=headers,
    )


async def models(request: web.Request) -> web.Response:
    app = request.app
    session = app[app_keys.SESSION]
    workers = app[app_keys.REGISTRY].candidates()
    timeout = aiohttp.ClientTimeout(total=app[app_keys.CONFIG].health.timeout_s)
    cards = await asyncio.gather(*(_model_cards(session, w.url, timeout) for w in workers))
    seen: dict[str, Any] = {}
    for worker, found in zip(workers, cards, strict=True):
        if not found and worker.metadata.model:
            found = [{"id": worker.metadata.model, "object": "model", "owned_by": "sglang"}]
        for card in found:
            seen.setdefault(card["id"], card)
    return web.Response(
        body=orjson.dumps({"object": "list", "data": list(seen.values())}),
        content_type="application/json",
    )


async def _model_cards(
    session: aiohttp.ClientSession, url: str, limits: aiohttp.ClientTimeout
) -> list[dict[str, Any]]:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError):
        async with session.get(url + "/v1/models", timeout=limits, allow_redirects=False) as resp:
            if resp.status == 200:
                data = orjson.loads(await resp.read()).get("data")
                if isinstance(data, list):
                    return [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
    return []


def add_routes(app: web.Application) -> None:
    for path in API_PATHS:
        app.router.add_post(path, api_handler)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", readiness)
    app.router.add_get("/readiness", readiness)
    app.router.add_get("/liveness", liveness)


# --- serving ----------------------------------------------------------------------------


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on host:port (0: ephemeral); returns the runner and the bound port."""
    # handler_cancellation: a client that disconnects cancels its handler, so a
    # non-streaming request is aborted on the worker at once, not after the answer.
    s = app[app_keys.CONFIG].server
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=s.keepalive_timeout_s,
        max_line_size=s.max_header_size,
        max_field_size=s.max_header_size,
        shutdown_timeout=s.shutdown_grace_s,
    )
    await runner.setup()
    guard = ConnectionGuard(s.max_connections, s.header_timeout_s)
    # several gateway processes share the port (gateway/multiprocess.py)
    site = GuardedSite(runner, host, port, guard, backlog=2048, reuse_port=s.processes > 1)
    await site.start()
    sockets = runner.addresses
    bound = sockets[0][1] if sockets else port
    return runner, int(bound)
