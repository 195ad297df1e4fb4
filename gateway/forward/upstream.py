"""A lean HTTP/1.1 client for the request path: one POST to one worker, kept-alive.

Why not ``aiohttp.ClientSession`` here: measured on this project's 2-core machine it costs
about 190 us of CPU per request against about 45 us for a plain stream client, and the
gateway's own work is a fraction of that. The session remains for everything else
(probes, load polls, aborts, model lists), where its features matter more than its cost.

Contract:
- :meth:`UpstreamPool.request` sends ``POST path`` with the given headers and body and
  returns the response head (:class:`UpstreamResponse`), or raises :class:`UpstreamError`
  with ``kind="connect"``: nothing was answered (refused, unreachable, connect timeout,
  hung up before the status line). An idle kept-alive connection that turns out closed
  before any answer is replaced by a fresh one once, transparently.
- Every wait (connect, head, body) ends at the request's ``deadline`` (loop time) with
  ``TimeoutError`` (for the body: one timer per response cuts the connection). The head
  must also come within ``first_byte_timeout_s`` of sending (0: no such bound), else
  :class:`FirstByteTimeout` (a ``TimeoutError``). A body silent for
  ``read_idle_timeout_s`` (checked four times per period, so cut between 1x and 1.25x
  of it; 0: never) is cut and its pending read raises ``TimeoutError``.
- Bodies: ``Content-Length``, ``chunked``, or until close. :meth:`UpstreamResponse.readany`
  returns whatever body bytes are available (chunk framing removed), ``b""`` at the end;
  :meth:`read` returns the rest whole. Broken bodies raise :class:`UpstreamError`
  (``kind="dropped"``).
- A connection returns to its worker's idle pool only when its body was read to the end
  and neither side asked to close; :meth:`UpstreamResponse.close` drops it (used on client
  disconnect, so the worker sees the connection go). Idle connections older than
  ``idle_timeout_s`` are not reused (below aiohttp's 75 s server keep-alive, so a worker
  never closes one under our feet in the common case).
- The transport sets TCP_NODELAY (asyncio does for TCP streams), so small SSE events
  leave at once.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections import deque
from collections.abc import Iterable
from urllib.parse import urlsplit

_READ_SIZE = 64 * 1024
_MAX_LINE = 1024
# chunked decoder states
_SIZE, _DATA, _DATA_END, _TRAILER = 0, 1, 2, 3


class UpstreamError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "connect" | "dropped"


class FirstByteTimeout(TimeoutError):
    """The worker's response head did not arrive within ``first_byte_timeout_s``."""


class _Conn:
    __slots__ = ("idle_since", "reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0
        self.reused = False

    def usable(self, now: float, idle_timeout_s: float) -> bool:
        return (
            not self.writer.is_closing()
            and not self.reader.at_eof()
            and now - self.idle_since < idle_timeout_s
        )

    def close(self) -> None:
        self.writer.close()


class _Target:
    """One worker's address, pre-encoded, and its idle connections."""

    __slots__ = ("host", "host_header", "idle", "port", "ssl", "url")

    def __init__(self, base_url: str) -> None:
        self.url = base_url
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.ssl = parts.scheme == "https"
        self.port = parts.port or (443 if self.ssl else 80)
        self.host_header = f"Host: {parts.netloc}\r\n".encode("latin-1")
        self.idle: deque[_Conn] = deque()


class UpstreamPool:
    def __init__(
        self,
        connect_timeout_s: float,
        max_idle_per_worker: int = 256,
        idle_timeout_s: float = 30.0,
        *,
        first_byte_timeout_s: float = 0.0,
        read_idle_timeout_s: float = 0.0,
    ) -> None:
        self._connect_timeout = connect_timeout_s
        self._first_byte = first_byte_timeout_s
        self._read_idle = read_idle_timeout_s
        self._max_idle = max_idle_per_worker
        self._idle_timeout = idle_timeout_s
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl_module.SSLContext | None = None

    def _target(self, base_url: str) -> _Target:
        target = self._targets.get(base_url)
        if target is None:
            target = self._targets[base_url] = _Target(base_url)
        return target

    def forget(self, base_url: str) -> None:
        """Close a removed worker's idle connections."""
        target = self._targets.pop(base_url, None)
        if target is not None:
            for conn in target.idle:
                conn.close()

    async def close(self) -> None:
        for url in list(self._targets):
            self.forget(url)

    async def request(
        self,
        base_url: str,
        path: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
        deadline: float,
    ) -> UpstreamResponse:
        target = self._target(base_url)
        head = _request_head(target, path, headers, len(body))
        conn = self._take(target)
        if conn is not None:
            try:
                return await self._exchange(target, conn, head, body, deadline)
            except UpstreamError:
                pass  # the idle connection was closed by the worker: once more, fresh
        conn = await self._connect(target, deadline)
        return await self._exchange(target, conn, head, body, deadline)

    def _take(self, target: _Target) -> _Conn | None:
        now = asyncio.get_running_loop().time()
        idle = target.idle
        while idle:
            conn = idle.pop()  # most recent first: the likeliest still open
            if conn.usable(now, self._idle_timeout):
                conn.reused = True
                return conn
            conn.close()
        return None

    def give_back(self, target: _Target, conn: _Conn) -> None:
        if self._targets.get(target.url) is not target or len(target.idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        target.idle.append(conn)

    async def _connect(self, target: _Target, deadline: float) -> _Conn:
        loop = asyncio.get_running_loop()
        limit = min(deadline, loop.time() + self._connect_timeout)
        ssl_ctx: ssl_module.SSLContext | None = None
        if target.ssl:
            if self._ssl is None:
                self._ssl = ssl_module.create_default_context()
            ssl_ctx = self._ssl
        try:
            async with asyncio.timeout_at(limit):
                reader, writer = await asyncio.open_connection(
                    target.host, target.port, ssl=ssl_ctx, limit=_READ_SIZE
                )
        except TimeoutError:
            if loop.time() >= deadline:
                raise
            raise UpstreamError("connect", "connecting to the worker timed out") from None
        except OSError as exc:
            raise UpstreamError("connect", f"the worker is unreachable: {exc}") from None
        return _Conn(reader, writer)

    async def _exchange(
        self, target: _Target, conn: _Conn, head: bytes, body: bytes, deadline: float
    ) -> UpstreamResponse:
        try:
            conn.writer.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.writer.write(body)
            loop = asyncio.get_running_loop()
            head_by = (
                min(deadline, loop.time() + self._first_byte) if self._first_byte else deadline
            )
            async with asyncio.timeout_at(head_by):
                await conn.writer.drain()
                raw = await conn.reader.readuntil(b"\r\n\r\n")
                while raw.startswith(b"HTTP/1.1 1") and not raw.startswith(b"HTTP/1.1 101"):
                    raw = await conn.reader.readuntil(b"\r\n\r\n")  # interim 1xx: skip
        except TimeoutError:  # an OSError too: caught first, it is not a hang-up
            conn.close()
            if head_by < deadline:
                raise FirstByteTimeout("the worker sent no response head in time") from None
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            conn.close()
            raise UpstreamError(
                "connect", f"the worker hung up before answering: {exc!r}"
            ) from None
        except asyncio.LimitOverrunError:
            conn.close()
            raise UpstreamError("connect", "the worker's response head is too large") from None
        except BaseException:
            conn.close()
            raise
        response = UpstreamResponse(self, target, conn, raw, deadline)
        if self._read_idle:
            response.watch_idle(self._read_idle)
        return response


def _request_head(
    target: _Target, path: str, headers: Iterable[tuple[str, str]], length: int
) -> bytes:
    lines = [f"POST {path} HTTP/1.1\r\n".encode("latin-1"), target.host_header]
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
    lines.append(f"Content-Length: {length}\r\n\r\n".encode("latin-1"))
    return b"".join(lines)


class UpstreamResponse:
    """The worker's answer: status and headers parsed, body read on demand."""

    __slots__ = (
        "_buf",
        "_chunk_left",
        "_conn",
        "_done",
        "_expired",
        "_idle_s",
        "_idle_timer",
        "_last_read",
        "_length",
        "_mode",
        "_pool",
        "_state",
        "_target",
        "_watchdog",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(
        self, pool: UpstreamPool, target: _Target, conn: _Conn, raw: bytes, deadline: float
    ) -> None:
        self._pool = pool
        self._target = target
        self._conn: _Conn | None = conn
        self._watchdog: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_s = 0.0
        self._last_read = 0.0
        self._expired = False
        lines = raw.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        try:
            self.status = int(status_line[1])
        except (IndexError, ValueError):
            conn.close()
            raise UpstreamError("connect", f"bad status line {lines[0][:80]!r}") from None
        self.headers: list[tuple[str, str]] = []
        length: int | None = None
        chunked = False
        self.keep_alive = status_line[0] == "HTTP/1.1"
        for line in lines[1:]:
            if not line:
                continue
            name, _, value = line.partition(":")
            name, value = name.strip(), value.strip()
            low = name.lower()
            if low == "content-length":
                length = int(value) if value.isdigit() else None
            elif low == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif low == "connection":
                self.keep_alive = value.lower() != "close" and (
                    self.keep_alive or value.lower() == "keep-alive"
                )
            self.headers.append((name, value))
        self._chunk_left = 0
        self._state = _SIZE
        self._buf = bytearray()
        if chunked:
            self._mode, self._length = "chunked", 0
        elif length is not None:
            self._mode, self._length = "length", length
        else:
            self._mode, self._length = "close", 0
            self.keep_alive = False
        self._done = self._mode == "length" and length == 0
        if self._done:
            self._finish()
        else:
            self._watchdog = asyncio.get_running_loop().call_at(deadline, self._expire)

    def watch_idle(self, idle_s: float) -> None:
        """Cut the body if no byte arrives for ``idle_s`` (see the module contract)."""
        if self._done or idle_s <= 0:
            return
        loop = asyncio.get_running_loop()
        self._idle_s = idle_s
        self._last_read = loop.time()
        self._idle_timer = loop.call_later(idle_s / 4, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self._done:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self._last_read >= self._idle_s:
            self._expire()
            return
        self._idle_timer = loop.call_later(self._idle_s / 4, self._idle_check)

    def _stop_timers(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def header(self, name: str) -> str | None:
        low = name.lower()
        for key, value in self.headers:
            if key.lower() == low:
                return value
        return None

    def _finish(self) -> None:
        self._done = True
        self._stop_timers()
        conn, self._conn = self._conn, None
        if conn is not None:
            if self.keep_alive:
                self._pool.give_back(self._target, conn)
            else:
                conn.close()

    def close(self) -> None:
        """Drop the connection (the worker sees it close); idempotent."""
        conn, self._conn = self._conn, None
        self._done = True
        self._stop_timers()
        if conn is not None:
            conn.close()

    def release(self) -> None:
        """Give up on the rest of the body: the connection cannot be reused."""
        if not self._done:
            self.close()

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while True:
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)

    async def readany(self) -> bytes:
        if self._done or self._conn is None:
            if self._expired:  # cut by a timer between two reads: still a timeout, once
                self._expired = False
                raise TimeoutError("the worker's answer outlived its deadline")
            return b""
        reader = self._conn.reader
        if self._idle_s:
            self._last_read = asyncio.get_running_loop().time()
        try:
            if self._mode == "length":
                data = await reader.read(min(self._length, _READ_SIZE))
                if not data:
                    raise asyncio.IncompleteReadError(b"", self._length)
                self._length -= len(data)
                if self._length == 0:
                    self._finish()
                return data
            if self._mode == "close":
                data = await reader.read(_READ_SIZE)
                if not data:
                    if self._expired:
                        raise asyncio.IncompleteReadError(b"", None)
                    self._finish()
                return data
            return await self._read_chunked(reader)
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            OSError,
            ValueError,
        ) as exc:
            self.close()
            if self._expired:
                self._expired = False  # reported once; later reads see the end
                raise TimeoutError("the worker's answer outlived the deadline") from None
            raise UpstreamError("dropped", f"the worker's body was cut short: {exc!r}") from None

    def _expire(self) -> None:
        """The deadline passed: cut the connection; the pending read turns into a timeout.
        One timer per response is far cheaper than a timeout context per read."""
        self._expired = True
        self.close()

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        """The next data of a chunked body: all that is decodable now, at least one byte,
        or ``b""`` at the end. Frames are decoded from our own buffer, so one network read
        carrying several chunks costs one call."""
        out = bytearray()
        while True:
            self._decode(out)
            if out or self._done:
                return bytes(out)
            data = await reader.read(_READ_SIZE)
            if not data:
                raise asyncio.IncompleteReadError(b"", None)
            self._buf += data

    def _decode(self, out: bytearray) -> None:
        buf = self._buf
        while buf:
            state = self._state
            if state == _DATA:
                take = min(self._chunk_left, len(buf))
                out += buf[:take]
                del buf[:take]
                self._chunk_left -= take
                if self._chunk_left:
                    return
                self._state = _DATA_END
            elif state == _DATA_END:
                if len(buf) < 2:
                    return
                del buf[:2]
                self._state = _SIZE
            else:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > _MAX_LINE:
                        raise ValueError("chunk size line too long")
                    return
                line = bytes(buf[:end])
                del buf[: end + 2]
                if state == _TRAILER:
                    if not line:
                        self._finish()
                        return
                    continue  # a trailer field: ignored
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._chunk_left, self._state = size, _DATA
