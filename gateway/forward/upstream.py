"""The request path's HTTP/1.1 client: one POST to one worker, kept-alive, framed by llhttp.

Why not ``aiohttp.ClientSession`` here: measured on this project's 2-core machine it costs
about 190 us of CPU per request against about 45 us for a plain stream client, and the
gateway's own work is a fraction of that (BENCHMARKS.md, "Upstream parser"). Why not the
hand-written framing this module had before: a worker's answer is input, and every
leniency in reading it was a way to desynchronise a kept-alive connection (issue 16).
Worker answers are parsed by llhttp (``httptools``, uvicorn's parser: Node's, fuzzed and
maintained) in its strict mode; this module only moves bytes and keeps the pool.
The session remains for everything else (probes, load polls, aborts, model lists).

Contract:
- :meth:`UpstreamPool.request` sends ``POST target`` with the given headers and body and
  returns the response head (:class:`UpstreamResponse`), or raises :class:`UpstreamError`
  with ``kind="connect"``: nothing usable was answered (refused, unreachable, connect
  timeout, hung up or answered something that is not HTTP/1.x before a final head). The
  request is written once: it is never sent again, on this connection or another, once
  its bytes were handed to a connection (the worker may have read it whole); a kept-alive
  connection is reused only if nothing arrived on it while idle (no byte, no close), as
  the loop delivered it or as it waits in the kernel (one ``poll(2)`` before reuse).
- The target must be origin-form (``/`` then visible ASCII), header names tokens and no
  value may hold CR, LF or NUL: else ``ValueError`` and nothing is sent.
- Every wait (connect, head, body) ends at the request's ``deadline`` (loop time) with
  ``TimeoutError``. The head must also come within ``first_byte_timeout_s`` of sending
  (the pool's, or the request's own: a model's; 0: no such bound), else
  :class:`FirstByteTimeout` (a ``TimeoutError``). A worker silent for
  ``read_idle_timeout_s`` while the gateway waits for it (checked four times per period,
  so cut between 1x and 1.25x of it; 0: never) is cut and the pending read raises
  ``TimeoutError``; time the gateway spends not reading (its buffer full because
  the client is slow: back-pressure) is not the worker's silence.
- Framing, by llhttp: ``Content-Length``, ``chunked``, or until close; no body for 1xx,
  204 and 304; interim 1xx heads are skipped; ``101`` and transfer codings other than
  ``chunked`` are refused; ``Transfer-Encoding`` with ``Content-Length``, duplicate or
  malformed lengths, bad chunk sizes, CR/LF/NUL inside header values, obs-fold and bare
  LF line ends are errors. A head over ``MAX_HEAD_BYTES`` or ``MAX_HEADERS`` fields is
  refused. :meth:`UpstreamResponse.readany` returns the body bytes available (framing
  removed), ``b""`` at the end; :meth:`read` returns the rest whole (bounded by its
  ``limit``). Broken bodies raise :class:`UpstreamError` (``kind="dropped"``).
- A connection returns to its worker's idle pool only when its answer was read to the
  end, llhttp says keep-alive (``Connection`` tokens, HTTP version, framing), and no byte
  followed the answer; :meth:`UpstreamResponse.close` drops it (used on client disconnect,
  so the worker sees the connection go). Idle connections older than ``idle_timeout_s``
  are not reused (below uvicorn's 5 s keep-alive, so a worker seldom closes one under our
  feet: such a race is reported as ``connect`` and the router decides, never resent here).
- Back-pressure: at most ``_HIGH_WATER`` body bytes are held per response; beyond it the
  socket stops being read until the consumer takes them.
- The transport sets TCP_NODELAY (asyncio and uvloop do for TCP), so small SSE events
  leave at once.

Cost: one ``httptools`` parser per response (a C object); callbacks per header and per
body piece; one deadline timer per response; one idle timer per loop for every body.

One module of ~640 lines on purpose: the connection's protocol, the pool and the response
share one per-connection state (the parser, the read pause, the reuse check), and the
rules above are only checkable where all three are in view.
"""

from __future__ import annotations

import asyncio
import re
import select
import ssl as ssl_module
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.forward.ticker import LoopTicker

MAX_HEAD_BYTES = 64 * 1024  # a worker's status line + headers (SGLang's are < 1 KiB)
MAX_HEADERS = 100
MAX_BODY_BYTES = 256 * 1024 * 1024
MAX_EVENT_BYTES = 8 * 1024 * 1024  # SGLang's /generate text (and ids) are cumulative
_HIGH_WATER = 128 * 1024  # body bytes held before the socket stops being read
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(r"/[!-~]*")  # origin-form: a slash, then visible ASCII only
_CHUNKED = "chunked"


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on one answer, kept by the pool and read by the relay."""

    max_body_bytes: int = MAX_BODY_BYTES  # a whole (non-streamed) answer
    max_event_bytes: int = MAX_EVENT_BYTES  # one SSE event
    client_stall_s: float = 0.0  # a client write that takes no byte this long: gone (0: no)


class UpstreamError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "connect" | "dropped"


class FirstByteTimeout(TimeoutError):
    """The worker's response head did not arrive within ``first_byte_timeout_s``."""


class _Trailing(Exception):
    """Bytes followed a complete answer: the connection is out of step, never reused."""


class _Conn(asyncio.Protocol):
    """One connection to a worker; feeds the current exchange's parser."""

    __slots__ = ("_poll", "closed", "exchange", "idle_since", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.exchange: UpstreamResponse | None = None
        self.idle_since = 0.0
        self.closed = False
        self._poll: select.poll | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance check
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(select, "poll"):
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN | select.POLLPRI)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # idle: a worker sends nothing between two answers
            self.close()
            return
        exchange._feed(data)

    def eof_received(self) -> bool:
        exchange = self.exchange
        if exchange is not None:
            exchange._eof()
        self.closed = True
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange = self.exchange
        if exchange is not None:
            exchange._eof()

    def usable(self, now: float, idle_timeout_s: float) -> bool:
        transport = self.transport
        return (
            not self.closed
            and transport is not None
            and not transport.is_closing()
            and now - self.idle_since < idle_timeout_s
            and not self._readable()
        )

    def _readable(self) -> bool:
        """Something (bytes or a close) waits in the kernel that the loop has not
        delivered yet: an idle connection must have nothing, so it is not reused. The same
        look urllib3 takes before reusing a connection (one poll(2), no wait); it closes
        the race with a worker that closes right after its answer (llama.cpp does after a
        stream, though it said keep-alive)."""
        return bool(self._poll is not None and self._poll.poll(0))

    def close(self) -> None:
        self.closed = True
        self.exchange = None
        if self.transport is not None:
            self.transport.close()


class _Target:
    """One worker's address, pre-encoded, and its idle connections."""

    __slots__ = ("host", "host_header", "idle", "port", "ssl", "url")

    def __init__(self, base_url: str) -> None:
        self.url = base_url
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.ssl = parts.scheme == "https"
        self.port = parts.port or (443 if self.ssl else 80)
        # host and port only: userinfo in a worker URL never reaches the wire
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = f"Host: {host}:{self.port}\r\n"
        self.idle: deque[_Conn] = deque()


class UpstreamPool:
    def __init__(
        self,
        connect_timeout_s: float,
        max_idle_per_worker: int = 256,
        idle_timeout_s: float = 4.0,
        *,
        first_byte_timeout_s: float = 0.0,
        read_idle_timeout_s: float = 0.0,
        client_write_timeout_s: float = 0.0,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self.limits = Limits(max_body_bytes, max_event_bytes, client_write_timeout_s)
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
        first_byte_timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """``first_byte_timeout_s``: this request's (0: none), None: the pool's."""
        target = self._target(base_url)
        head = request_head(target.host_header, path, headers, len(body))
        conn = self._take(target) or await self._connect(target, deadline)
        loop = asyncio.get_running_loop()
        first = self._first_byte if first_byte_timeout_s is None else first_byte_timeout_s
        head_by = min(deadline, loop.time() + first) if first else deadline
        response = UpstreamResponse(self, target, conn, deadline, head_by)
        transport = conn.transport
        assert transport is not None
        if len(body) < 65536:
            transport.write(head + body)
        else:  # no copy of a large body
            transport.writelines((head, body))
        await response._head_received()
        if self._read_idle:
            response.watch_idle(self._read_idle)
        return response

    def _take(self, target: _Target) -> _Conn | None:
        now = asyncio.get_running_loop().time()
        idle = target.idle
        while idle:
            conn = idle.pop()  # most recent first: the likeliest still open
            if conn.usable(now, self._idle_timeout):
                return conn
            conn.close()
        return None

    def give_back(self, target: _Target, conn: _Conn) -> None:
        conn.exchange = None
        if (
            conn.closed
            or self._targets.get(target.url) is not target
            or len(target.idle) >= self._max_idle
        ):
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
                _, conn = await loop.create_connection(_Conn, target.host, target.port, ssl=ssl_ctx)
        except TimeoutError:
            if loop.time() >= deadline:
                raise
            raise UpstreamError("connect", "connecting to the worker timed out") from None
        except OSError as exc:
            raise UpstreamError("connect", f"the worker is unreachable: {exc}") from None
        return conn


def request_head(
    host_header: str, target: str, headers: Iterable[tuple[str, str]], length: int
) -> bytes:
    """``POST target`` with ``headers``; ValueError (nothing sent) for a target that is not
    origin-form, a name that is not a token, or a value holding CR, LF or NUL."""
    if not _TARGET.fullmatch(target) or "#" in target:
        raise ValueError("the upstream target must be origin-form visible ASCII")
    lines = [f"POST {target} HTTP/1.1\r\n", host_header]
    for name, value in headers:
        if not _TOKEN.fullmatch(name):
            raise ValueError("an upstream header name is not an HTTP token")
        lines.append(f"{name}: {value}\r\n")
    lines.append(f"Content-Length: {length}\r\n\r\n")
    text = "".join(lines)
    # One scan for the whole head: each line above ends in exactly one CRLF (the last in
    # two), so any other CR or LF, or any NUL, came from a value: a smuggling attempt.
    ends = len(lines) + 1
    if "\x00" in text or text.count("\n") != ends or text.count("\r") != ends:
        raise ValueError("an upstream header value holds CR, LF or NUL")
    # the bytes the client sent: aiohttp decodes header bytes as UTF-8, surrogate-escaped
    return text.encode("utf-8", "surrogateescape")


class UpstreamResponse:
    """The worker's answer: llhttp's callbacks fill it; the relay reads it."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_conn",
        "_error",
        "_expired",
        "_framed",
        "_head_by",
        "_head_bytes",
        "_head_future",
        "_idle_s",
        "_idle_ticker",
        "_interim",
        "_last_data",
        "_loop",
        "_parser",
        "_paused",
        "_pool",
        "_target",
        "_timer",
        "_waiter",
        "deadline",
        "headers",
        "held_by_reader",
        "keep_alive",
        "limits",
        "status",
    )

    def __init__(
        self, pool: UpstreamPool, target: _Target, conn: _Conn, deadline: float, head_by: float
    ) -> None:
        self._pool = pool
        self.limits = pool.limits
        self.held_by_reader = False  # at a failure, the gateway was not waiting to read
        self._target = target
        self._conn: _Conn | None = conn
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self.deadline = deadline
        self._head_by = head_by
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.keep_alive = False
        self._head_bytes = 0
        self._interim = False
        self._framed = False  # Content-Length or chunked: an early close is a cut body
        self._head_future: asyncio.Future[None] | None = self._loop.create_future()
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._complete = False
        self._error: BaseException | None = None
        self._expired = False
        self._waiter: asyncio.Future[None] | None = None
        self._idle_s = 0.0
        self._idle_ticker: LoopTicker | None = None  # set while watched for silence
        self._last_data = self._loop.time()
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(head_by, self._expire)
        conn.exchange = self

    # --- llhttp callbacks (httptools calls them by name) ---------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            raise _Trailing()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.status:  # a trailer field of a chunked body: not relayed
            return
        if len(self.headers) >= MAX_HEADERS:
            raise UpstreamError("connect", "the worker's answer has too many header fields")
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status == 101:
            raise UpstreamError("connect", "the worker switched protocols unasked")
        if status < 200:  # interim (100 Continue, 103 Early Hints): its fields are dropped
            self._interim = True
            self.headers.clear()
            return
        framed = False
        for name, value in self.headers:
            low = name.lower()
            if low == "transfer-encoding":
                if value.strip().lower() != _CHUNKED:  # llhttp checked the syntax
                    raise UpstreamError("connect", "the worker used a transfer coding")
                framed = True
            elif low == "content-length":
                framed = True
        self._framed = framed
        self.status = status
        self._head_done(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn is not None:
            transport = self._conn.transport
            if transport is not None:
                self._paused = True
                transport.pause_reading()
        if self._waiter is not None:  # a chunked body: a call per piece, most find no reader
            self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.keep_alive = self._parser.should_keep_alive()  # read here: llhttp resets after
        self._complete = True
        self._wake()

    # --- from the connection -------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._idle_s:
            self._last_data = self._loop.time()
        if not self.status:  # llhttp has no bound of its own on a head
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(UpstreamError("connect", "the worker's response head is too large"))
                return
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, UpstreamError):
                self._fail(cause)
            elif self._complete:  # _Trailing: the answer is whole, the connection is not
                self._drop_conn()
            else:
                self._fail(self._malformed(exc))
            return
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("connect", "the worker switched protocols unasked"))
            return
        except httptools.HttpParserError as exc:
            if self._complete:  # garbage after a whole answer
                self._drop_conn()
            else:
                self._fail(self._malformed(exc))
            return
        if self._complete:
            self._release_conn()

    def _malformed(self, exc: Exception) -> UpstreamError:
        kind = "dropped" if self.status else "connect"
        return UpstreamError(kind, f"the worker's answer is malformed HTTP: {exc}")

    def _eof(self) -> None:
        """The worker closed: the end of a close-delimited body, else a cut answer."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.exchange = None
            conn.close()
        if self._complete or self._error is not None:
            return
        if self.status and not self._framed:
            self._complete = True  # read until close: this is its end
            self.keep_alive = False
            self._stop_timers()
            self._wake()
        elif self.status:
            self._fail(UpstreamError("dropped", "the worker's body was cut short"))
        else:
            self._fail(UpstreamError("connect", "the worker hung up before answering"))

    # --- state changes -------------------------------------------------------------

    def _head_done(self, error: BaseException | None) -> None:
        future, self._head_future = self._head_future, None
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
            if self._timer is not None and self._head_by < self.deadline:
                self._timer.cancel()
                self._timer = self._loop.call_at(self.deadline, self._expire)
        else:
            future.set_exception(error)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self._complete:
            self._error = error
            self.held_by_reader = self.status != 0 and self._waiter is None
        self._drop_conn()
        self._head_done(error)
        self._wake()

    def _drop_conn(self) -> None:
        self._stop_timers()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _release_conn(self) -> None:
        self._stop_timers()
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._paused and conn.transport is not None:
            # paused by this answer's body, which is all here: an idle connection must
            # read, so that a stray byte or a close is seen at once
            self._paused = False
            conn.transport.resume_reading()
        if self.keep_alive:
            self._pool.give_back(self._target, conn)
        else:
            conn.close()

    def _stop_timers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._idle_ticker is not None:
            self._idle_ticker.discard(self)
            self._idle_ticker = None

    def _expire(self) -> None:
        """The deadline (or the head's) passed: cut the connection; pending reads raise."""
        self._timer = None
        if self._complete:
            return
        self._expired = True
        error: TimeoutError = (
            FirstByteTimeout("the worker sent no response head in time")
            if not self.status and self._head_by < self.deadline
            else TimeoutError("the worker's answer outlived its deadline")
        )
        self._fail(error)

    # --- the consumer's side -------------------------------------------------------

    async def _head_received(self) -> None:
        future = self._head_future
        if future is not None:
            try:
                await future
            except BaseException:
                self.close()
                raise

    def watch_idle(self, idle_s: float) -> None:
        """Cut the body if the worker is silent for ``idle_s`` (see the module contract)."""
        if self._complete or self._error is not None or idle_s <= 0:
            return
        self._idle_s = idle_s
        self._last_data = self._loop.time()
        self._idle_ticker = LoopTicker.watch(self, idle_s / 4)

    def tick(self, now: float) -> bool:
        """One check of the worker's silence (by the loop's
        :class:`gateway.forward.ticker.LoopTicker`); False once there is nothing more to
        watch."""
        if self._complete or self._error is not None:
            return False
        if self._paused:
            self._last_data = now  # not reading: the silence is ours, not the worker's
        elif now - self._last_data >= self._idle_s:
            self._idle_ticker = None
            self._fail(TimeoutError("the worker was silent for too long"))
            return False
        return True

    def header(self, name: str) -> str | None:
        low = name.lower()
        for key, value in self.headers:
            if key.lower() == low:
                return value
        return None

    @property
    def ended(self) -> bool:
        """The body was read to its end: nothing buffered, nothing more to come."""
        return self._complete and not self._chunks and self._error is None

    @property
    def expired(self) -> bool:
        """The answer was cut by its deadline (or its head's)."""
        return self._expired

    def close(self) -> None:
        """Drop the connection (the worker sees it close); idempotent."""
        self._complete = self._complete or self._error is None
        self._drop_conn()
        self._head_done(UpstreamError("connect", "closed"))
        self._wake()

    def release(self) -> None:
        """Give up on the rest of the body: the connection cannot be reused."""
        if self._conn is not None:
            self.close()

    async def read(self, limit: int | None = None) -> bytes:
        """The rest of the body; UpstreamError ("dropped") once it exceeds ``limit``."""
        parts: list[bytes] = []
        size = 0
        while data := await self.readany():
            size += len(data)
            if limit is not None and size > limit:
                self.close()
                raise UpstreamError("dropped", f"the worker's answer exceeds {limit} bytes")
            parts.append(data)
        return b"".join(parts)

    async def readany(self) -> bytes:
        while True:
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self._last_data = self._loop.time()
                    if self._conn is not None and self._conn.transport is not None:
                        self._conn.transport.resume_reading()
                return data
            error = self._error
            if error is not None:
                self._error = None  # reported once; later reads see the end
                self._complete = True
                raise error
            if self._complete:
                return b""
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            except BaseException:
                self._waiter = None
                raise
