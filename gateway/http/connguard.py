"""Connection-level limits in front of aiohttp's protocol: a cap on open client
connections and a deadline for every request head (slowloris).

Contract: :class:`ConnectionGuard` wraps the server's protocol factory
(:meth:`ConnectionGuard.wrap`). Each accepted connection is counted while open
(``open``). Past ``max_connections`` (0: no cap) a new connection gets a complete
``503`` JSON answer with ``Retry-After`` and ``Connection: close`` and never reaches
aiohttp. Every request head (up to the blank line) must be complete within
``header_timeout_s`` (0: none): for a connection's first request counted from the
accept, for later ones on a kept-alive connection from the first byte that arrives while
aiohttp waits for the next request. Too slow: a ``408`` JSON answer with
``Connection: close``, then the connection is closed (``timed_out`` counts them). The
idle time before that first byte is aiohttp's keep-alive timeout. Counters are plain
attributes, read by tests and metrics; nothing here is module-level state.

Errors aiohttp answers itself, outside the application and its middleware (a request it
cannot parse: a method its parser does not know, a malformed request line or header, a
line over ``max_header_size``; a handler that raised), are rendered by
:class:`JsonErrorsHandler` as OpenAI-style JSON like every other error, without echoing
the request: a method the parser does not know gets ``501`` (RFC 9110 §9.1, no route can
be known), the rest keep aiohttp's status. Methods the parser knows (``TRACE``,
``PROPFIND``, ...) reach the router: a known path answers ``405`` with ``Allow``.

Why from the first byte and not from the previous response's end: the latter would close
every kept-alive connection idle for ``header_timeout_s``, making the keep-alive timeout
meaningless. Counting from the first byte bounds what slowloris needs (a head that never
completes) just as tightly: a connection then holds at most ``keepalive_timeout_s`` of
silence plus ``header_timeout_s`` of dribbling before it must send a whole request, and
aiohttp's keep-alive timer, which runs from the previous response's end while no whole
request has come, closes it at ``keepalive_timeout_s`` anyway. So dribbling never holds a
connection longer than an idle client may, and each head gets ``header_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, BadStatusLine, LineTooLong

from gateway.errors import error_body, error_response

log = logging.getLogger("gateway.http.handlers")
# 501 here is the client's choice of method: OpenAI's type for a bad request
NOT_IMPLEMENTED_TYPE = {501: "invalid_request_error"}

_HEAD_END = b"\r\n\r\n"


def _whole_head(data: bytes) -> bool:
    """``data``, the first piece of a request, holds its whole head (blank lines before
    the request line are no head's end)."""
    if data[:1] in (b"\r", b"\n"):
        data = data.lstrip(b"\r\n")
    return _HEAD_END in data


def _busy_response() -> bytes:
    body = error_body(503, "the gateway has too many open connections; retry shortly")
    return _raw_response("503 Service Unavailable", body, "Retry-After: 1\r\n")


def _too_slow_response() -> bytes:
    body = error_body(408, "the request head did not arrive in time")
    return _raw_response("408 Request Timeout", body)


def _raw_response(status: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


class ConnectionGuard:
    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0
        self.timed_out = 0
        self._busy = _busy_response()
        self._too_slow = _too_slow_response()

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory that applies the guard around ``factory``'s protocols."""

        def make() -> asyncio.Protocol:
            return _Guarded(self, factory)

        return make


class _Guarded(asyncio.Protocol):
    """Delegates to the real protocol, except for refused or timed-out connections."""

    def __init__(self, guard: ConnectionGuard, factory: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._factory = factory
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance check
        guard = self._guard
        self._transport = cast(asyncio.Transport, transport)
        if guard.max_connections and guard.open >= guard.max_connections:
            guard.refused += 1
            self._transport.write(guard._busy)
            self._transport.close()
            return
        guard.open += 1
        self._counted = True
        self._start_head_deadline()
        self._inner = self._factory()
        self._inner.connection_made(transport)

    def _start_head_deadline(self) -> None:
        if self._guard.header_timeout_s > 0:
            self._tail = b""
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._guard.header_timeout_s, self._too_slow)

    def _waiting_for_request(self) -> bool:
        """True while aiohttp waits for the next request head: its request loop awaits
        ``_waiter`` (the same test as aiohttp's own keep-alive timer). A private
        attribute: tests/reliability/test_connection_limits.py pins the behaviour."""
        waiter = getattr(self._inner, "_waiter", None)
        return waiter is not None and not waiter.done()

    def _too_slow(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing() or not self._waiting_for_request():
            return  # closed already, or aiohttp got a whole head the scan did not see
        self._guard.timed_out += 1
        transport.write(self._guard._too_slow)  # nothing else is being written: idle
        transport.close()

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        waiting = self._waiting_for_request()
        # a kept-alive connection's next request begins; a head whole in its first piece
        # (the common case) met its deadline already: no timer
        if self._timer is None and waiting and not _whole_head(data):
            self._start_head_deadline()
        if self._timer is not None:
            # blank lines before a request line (a server skips them) begin no head: their
            # CRLFs must not pass for its end (the tail is empty until a head begins)
            seen = self._tail + data if self._tail else data.lstrip(b"\r\n")
            if _HEAD_END in seen:
                self._timer.cancel()
                self._timer = None
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)
        if self._timer is not None and waiting and not self._waiting_for_request():
            # aiohttp got a whole head the scan did not see end here (its start arrived
            # with the previous request): this deadline is met, not left for an idle time
            self._timer.cancel()
            self._timer = None

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._counted:
            self._counted = False
            self._guard.open -= 1
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def __getattr__(self, name: str) -> Any:  # anything else aiohttp may ask of it
        return getattr(self._inner, name)


class JsonErrorsHandler(web.RequestHandler):
    """aiohttp's connection handler, with its own error answers in the gateway's JSON."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            # aiohttp's own: logs with the traceback, refuses once a response has begun
            super().handle_error(request, status, exc, message)
            text = "the gateway failed to handle the request"
        else:
            if request.writer.output_size > 0:
                raise ConnectionError("a response has begun: no room for an error")
            status, text = _protocol_error(status, exc)
            # a bad status line is mostly non-HTTP traffic (TLS, scanners): debug only
            level = logging.DEBUG if isinstance(exc, BadStatusLine) else logging.INFO
            log.log(level, "unparseable request from %s: %d %s", request.remote, status, text)
        response = error_response(status, text, err_type=NOT_IMPLEMENTED_TYPE.get(status))
        response.force_close()
        return response


def _protocol_error(status: int, exc: BaseException | None) -> tuple[int, str]:
    """Status and message for a request aiohttp's parser refused (never its bytes)."""
    if isinstance(exc, BadHttpMethod):
        return 501, "the request method is not one the gateway implements"
    if isinstance(exc, LineTooLong):
        return status, "a request line or header line is longer than the gateway allows"
    return status, "malformed HTTP request"


def json_errors_factory(server: web.Server) -> Callable[[], asyncio.Protocol]:
    """Protocol factory like ``server`` itself, building :class:`JsonErrorsHandler`."""

    def make() -> asyncio.Protocol:
        return JsonErrorsHandler(server, loop=server._loop, **server._kwargs)

    return make


class GuardedSite(web.BaseSite):
    """A TCP site like ``web.TCPSite`` whose connections pass through ``guard`` first."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        backlog: int = 2048,
        reuse_port: bool = False,
    ) -> None:
        # the shutdown grace is the runner's (web.AppRunner(shutdown_timeout=...))
        super().__init__(runner, backlog=backlog)
        self._guard_host = host
        self._guard_port = port
        self._reuse_port = reuse_port  # SO_REUSEPORT: several processes on one port
        self.guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._guard_host}:{self._guard_port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        factory = json_errors_factory(server)
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.wrap(factory),
            self._guard_host,
            self._guard_port,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port or None,
        )
