"""Connection-level limits in front of aiohttp's protocol: a cap on open client
connections and a deadline for a new connection's first request head (slowloris).

Contract: :class:`ConnectionGuard` wraps the server's protocol factory
(:meth:`ConnectionGuard.wrap`). Each accepted connection is counted while open
(``open``). Past ``max_connections`` (0: no cap) a new connection gets a complete
``503`` JSON answer with ``Retry-After`` and ``Connection: close`` and never reaches
aiohttp. A new connection whose first request head (up to the blank line) has not
arrived within ``header_timeout_s`` (0: none) is closed; later requests on a kept-alive
connection are bounded by aiohttp's keep-alive timeout instead. Counters are plain
attributes, read by tests and metrics; nothing here is module-level state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import orjson
from aiohttp import web

_HEAD_END = b"\r\n\r\n"


def _busy_response() -> bytes:
    body = orjson.dumps(
        {
            "error": {
                "message": "the gateway has too many open connections; retry shortly",
                "type": "service_unavailable",
                "param": None,
                "code": 503,
            }
        }
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Retry-After: 1\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
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
        if guard.header_timeout_s > 0:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(guard.header_timeout_s, self._too_slow)
        self._inner = self._factory()
        self._inner.connection_made(transport)

    def _too_slow(self) -> None:
        self._timer = None
        self._guard.timed_out += 1
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if self._timer is not None:
            if _HEAD_END in self._tail + data:
                self._timer.cancel()
                self._timer = None
            else:
                self._tail = (self._tail + data)[-3:]
        self._inner.data_received(data)

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
    ) -> None:
        # the shutdown grace is the runner's (web.AppRunner(shutdown_timeout=...))
        super().__init__(runner, backlog=backlog)
        self._guard_host = host
        self._guard_port = port
        self.guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._guard_host}:{self._guard_port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        factory: Callable[[], asyncio.Protocol] = server
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.wrap(factory),
            self._guard_host,
            self._guard_port,
            backlog=self._backlog,
            reuse_address=True,
        )
