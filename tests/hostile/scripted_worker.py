"""The hostile tests' scripted raw-socket worker that misbehaves on cue, and helpers for
hostile clients. Everything listens on 127.0.0.1 and every wait is bounded.

The worker reads each request with h11 (a strict, independent HTTP/1.1 parser: what it
sees is what a real server behind the gateway would see, smuggled requests included) and
answers with whatever bytes the test's script writes: framing, lengths, interim heads,
early closes, slow drips, huge heads, redirects, encodings, CRLF event streams.
Probes (``GET``) get ``probe_answer`` (a plain 200 ``{}``); ``POST /abort_request`` is
recorded and answered 200, like SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import h11


@dataclass
class Exchange:
    """One request as the worker parsed it."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    connection: int  # which accepted connection (1, 2, ...) carried it

    def header(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.headers if k == low), None)


# (exchange, writer, n: its number among the worker's POSTs, from 1) -> keep the connection?
Answer = Callable[[Exchange, asyncio.StreamWriter, int], Awaitable[bool]]

PROBE_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def http_response(
    body: bytes, status: str = "200 OK", ctype: str = "application/json", extra: str = ""
) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
    return head.encode() + b"\r\n" + body


def chunked(pieces: list[bytes], ctype: str = "text/event-stream", extra: str = "") -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nTransfer-Encoding: chunked\r\n{extra}\r\n"
    frames = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)
    return head.encode() + frames + b"0\r\n\r\n"


@dataclass
class ScriptedWorker:
    answer: Answer
    exchanges: list[Exchange] = field(default_factory=list)
    aborts: list[bytes] = field(default_factory=list)
    protocol_errors: list[str] = field(default_factory=list)  # what h11 refused
    connections: int = 0
    posts: int = 0
    probe_answer: bytes = PROBE_OK
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    @property
    def inference(self) -> list[Exchange]:
        """The POSTs other than aborts."""
        return [e for e in self.exchanges if e.method == "POST" and e.target != "/abort_request"]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        pending = b""
        try:
            while True:
                exchange, pending = await self._read(reader, pending, number)
                if exchange is None:
                    return
                self.exchanges.append(exchange)
                if exchange.method != "POST":
                    writer.write(self.probe_answer)
                    await writer.drain()
                    continue
                if exchange.target == "/abort_request":
                    self.aborts.append(exchange.body)
                    writer.write(http_response(b""))
                    await writer.drain()
                    continue
                self.posts += 1
                if not await self.answer(exchange, writer, self.posts):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _read(
        self, reader: asyncio.StreamReader, pending: bytes, number: int
    ) -> tuple[Exchange | None, bytes]:
        conn = h11.Connection(h11.SERVER)
        if pending:  # b"" would tell h11 the connection closed
            conn.receive_data(pending)
        request: h11.Request | None = None
        body = b""
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                self.protocol_errors.append(str(exc))
                return None, b""
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                conn.receive_data(data)  # b"" is the end of the stream
                if not data and request is None:
                    return None, b""
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""
        assert request is not None
        headers = [(k.decode().lower(), v.decode("latin-1")) for k, v in request.headers]
        exchange = Exchange(
            request.method.decode(), request.target.decode("latin-1"), headers, body, number
        )
        return exchange, conn.trailing_data[0]


StartWorker = Callable[[Answer], Awaitable[ScriptedWorker]]


def replies(*raw: bytes, keep: bool = True) -> Answer:
    """An answer writing ``raw[n-1]`` to the n-th POST (the last one from then on)."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(raw[min(n, len(raw)) - 1])
        await writer.drain()
        return keep

    return answer


async def raw_exchange(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection to the gateway; everything it answers until it
    closes (or ``timeout_s``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(timeout_s):
                while chunk := await reader.read(65536):
                    out += chunk
        return out
    finally:
        writer.close()
