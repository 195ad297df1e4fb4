"""Red team of the request path's fast paths: the SSE relay's coalesced writes and its
``[DONE]`` byte test (c087f26), the shared stall and idle tickers (a44393b, c885574), the
head deadline skipped for a whole kept-alive head (216a1c6), the chunked body's wake-up
(77159d7) and the prefill gate (``prefix_index.prefill_wait_s``), attacked by scripted
raw-socket workers and raw-socket clients. Every answer is parsed as HTTP/1.1 by hand
(status line, framing, chunk sizes): it must be well formed, an OpenAI-style JSON error
or a stream ending in one SGLang error event then ``[DONE]``; every wait is bounded, and
no lease, gate place, task or client connection is left behind."""

from __future__ import annotations

import asyncio
import gc
import socket
from typing import Any

import orjson
import pytest
from aiohttp import web
from scripted_worker import Answer, Exchange, StartWorker, raw_exchange

from gateway.forward.sse import parse
from gateway.http import app_keys
from gateway.http.connguard import ConnectionGuard
from gateway.routing.decisions import DecisionOutcome
from loadtests.harness.inprocess import GatewayHandle, run_gateway

API = b"/v1/chat/completions"
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
LATE = b'data: {"choices":[{"delta":{"content":"late"}}]}\n\n'
USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":1,'
    b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
)
DONE = b"data: [DONE]\n\n"
END = b"0\r\n\r\n"
LIMIT_S = 0.4  # stream idle, client write stall and head deadlines of these gateways
FAST: dict[str, Any] = {
    "worker_kind": "sglang",
    "server__stream_idle_timeout_s": LIMIT_S,
    "server__client_write_timeout_s": LIMIT_S,
    "server__header_timeout_s": LIMIT_S,
    "server__client_body_timeout_s": LIMIT_S,
}


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def body(stream: bool = True, content: str = "hi") -> bytes:
    return orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}
    )


def post(data: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (API, extra, len(data), data)
    )


def port(gw: GatewayHandle) -> int:
    return int(gw.url.rsplit(":", 1)[1])


class Answered:
    """One HTTP/1.1 response as a strict client reads it."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    @property
    def events(self) -> list[bytes]:
        return [e for e in self.body.split(b"\n\n") if e]

    def stream_ok(self) -> None:
        """A complete stream: one ``[DONE]``, last, and no error event."""
        assert self.status == 200, (self.status, self.body[-300:])
        assert self.body.endswith(b"[DONE]\n\n"), self.body[-300:]
        assert [e.data for e in parse(self.body)].count("[DONE]") == 1, self.body[-300:]
        assert b'"error"' not in self.body

    def stream_error(self, code: int) -> None:
        """A stream that broke: its last events are one error event (``code``), ``[DONE]``."""
        assert self.status == 200, (self.status, self.body[-300:])
        events = self.events
        assert events[-1] == DONE.strip(), self.body[-300:]
        error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == code, error
        assert sum(b'"error"' in e for e in events) == 1

    def json_error(self, status: int | None = None) -> dict[str, Any]:
        """An OpenAI-style JSON error answer."""
        assert self.status >= 400 and (status is None or self.status == status), self.status
        assert self.headers.get("content-type", "").startswith("application/json")
        error: dict[str, Any] = orjson.loads(self.body)["error"]
        assert isinstance(error["message"], str) and "type" in error
        return error


async def read_answer(reader: asyncio.StreamReader, within_s: float = 5.0) -> Answered:
    async with asyncio.timeout(within_s):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        # aiohttp answers a request it cannot parse as HTTP/1.0 (no version known yet)
        assert lines[0].startswith(("HTTP/1.1 ", "HTTP/1.0 ")), lines[0]
        status = int(lines[0].split(" ")[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, colon, value = line.partition(":")
                assert colon and name == name.strip(), line
                assert name.lower() not in headers or name.lower() == "set-cookie", line
                headers[name.lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            assert "content-length" not in headers
            out = b""
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line[:-2], 16)
                data = await reader.readexactly(size + 2)
                assert data.endswith(b"\r\n")
                if size == 0:
                    assert data == b"\r\n"  # the gateway sends no trailers
                    break
                out += data[:-2]
        else:
            out = await reader.readexactly(int(headers["content-length"]))
    return Answered(status, headers, out)


async def ask(gw: GatewayHandle, data: bytes | None = None, within_s: float = 5.0) -> Answered:
    reader, writer = await asyncio.open_connection("127.0.0.1", port(gw))
    try:
        writer.write(data if data is not None else post(body()))
        await writer.drain()
        return await read_answer(reader, within_s)
    finally:
        writer.close()


def script(*pieces: bytes, pause_s: float = 0.03, keep: bool = True) -> Answer:
    """A worker writing ``pieces`` one by one (``pause_s`` apart: separate TCP reads)."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        for index, piece in enumerate(pieces):
            if index:
                await asyncio.sleep(pause_s)
            writer.write(piece)
            await writer.drain()
        return keep

    return answer


def silent_after(*pieces: bytes) -> Answer:
    """A worker writing ``pieces`` then staying silent, its connection open, until cut."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"".join(pieces))
        await writer.drain()
        while not writer.transport.is_closing():
            await asyncio.sleep(0.05)
            try:
                writer.write(b"")
                await writer.drain()
            except ConnectionError:
                break
        return False

    return answer


def idle(gw: GatewayHandle) -> bool:
    return all(
        w.in_flight == 0 and w.queued_prefill_tokens == 0 and w.decoding_requests == 0
        for w in gw.registry
    )


async def settled(gw: GatewayHandle, within_s: float = 3.0) -> None:
    """Every lease released (bounded)."""
    for _ in range(int(within_s / 0.02)):
        if idle(gw):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("a lease is still held")


async def last_outcome(gw: GatewayHandle) -> DecisionOutcome:
    for _ in range(150):
        decisions = list(gw.app[app_keys.DECISIONS].latest(1))
        if decisions and decisions[0].outcome is not None and idle(gw):
            return decisions[0].outcome
        await asyncio.sleep(0.02)
    raise AssertionError("the request was not recorded, or its lease is still held")


def open_client_connections() -> int:
    return sum(g.open for g in gc.get_objects() if isinstance(g, ConnectionGuard))


def _stack(task: asyncio.Task[Any]) -> list[str]:
    out = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            out.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out


def request_tasks() -> list[asyncio.Task[Any]]:
    """The tasks serving client requests (aiohttp's handler tasks)."""
    return [t for t in asyncio.all_tasks() if "_handle_request" in repr(t.get_coro())]


async def no_leaks(within_s: float = 3.0) -> None:
    """No request handler and no client connection is left (bounded)."""
    for _ in range(int(within_s / 0.05)):
        if not request_tasks() and not open_client_connections():
            return
        await asyncio.sleep(0.05)
    stacks = [_stack(t) for t in request_tasks()]
    raise AssertionError(f"left: {stacks}, {open_client_connections()} client connections")


# --- c087f26: the [DONE] byte test, the coalesced writes, the cut after [DONE] ----------

SPLIT_STREAMS: dict[str, tuple[list[bytes], bytes]] = {
    # name: (the pieces the worker writes, the event stream the client must get)
    "done split across reads": (
        [HEAD + chunk(EVENT + b"data: [DO"), chunk(b"NE]\n"), chunk(b"\n") + END],
        EVENT + DONE,
    ),
    "done split inside its chunk frame": (
        [HEAD + chunk(EVENT) + b"e\r\ndata: [D", b"ONE]\n\n\r\n", END],
        EVENT + DONE,
    ),
    "done without a space": (
        [HEAD + chunk(EVENT + b"data:[DONE]\n\n") + END],
        EVENT + b"data:[DONE]\n\n",
    ),
    "crlf line ends, the cr and lf in two reads": (
        [
            HEAD + chunk(EVENT.replace(b"\n", b"\r\n") + b"data: [DONE]\r"),
            chunk(b"\n\r"),
            chunk(b"\n") + END,
        ],
        EVENT + DONE,
    ),
    "done inside a json string, then the real one": (
        [HEAD + chunk(b'data: {"text":"data: [DONE]"}\n\n'), chunk(DONE) + END],
        b'data: {"text":"data: [DONE]"}\n\n' + DONE,
    ),
    "done as a line of a longer event is no end": (
        [HEAD + chunk(b"data: a\ndata: [DONE]\n\n"), chunk(DONE) + END],
        b"data: a\ndata: [DONE]\n\n" + DONE,
    ),
    "events after done in the same piece": (
        [HEAD + chunk(EVENT + DONE + LATE + DONE) + END],
        EVENT + DONE,
    ),
    "events after done, later": (
        [HEAD + chunk(EVENT + DONE), chunk(LATE) + END],
        EVENT + DONE,
    ),
    "done as the body's unterminated last event": (
        [HEAD + chunk(EVENT + b"data: [DONE]") + END],
        EVENT + DONE,
    ),
    "trailers after done": (
        [HEAD + chunk(EVENT + DONE) + b"0\r\nX-Trailer: 1\r\n\r\n"],
        EVENT + DONE,
    ),
    "chunk extensions": (
        [HEAD + b"%x;ext=1\r\n%s\r\n" % (len(EVENT + DONE), EVENT + DONE) + END],
        EVENT + DONE,
    ),
    "first event incomplete in the first piece": (
        [HEAD + chunk(b'data: {"choi'), chunk(b'ces":[]}\n\n' + DONE) + END],
        b'data: {"choices":[]}\n\n' + DONE,
    ),
    "a head alone, then the events": ([HEAD, chunk(EVENT + DONE) + END], EVENT + DONE),
    # a chunk per byte, in one piece then over reads: every piece must wake the reader
    "one-byte chunks in one piece": (
        [HEAD + b"".join(chunk(bytes([c])) for c in EVENT + DONE) + END],
        EVENT + DONE,
    ),
    "one-byte chunks over reads": (
        [HEAD, *(chunk(bytes([c])) for c in EVENT + DONE), END],
        EVENT + DONE,
    ),
}


@pytest.mark.parametrize("name", list(SPLIT_STREAMS))
async def test_streams_end_where_done_is_whatever_the_reads(
    scripted: StartWorker, name: str
) -> None:
    pieces, expected = SPLIT_STREAMS[name]
    worker = await scripted(script(*pieces))
    async with run_gateway([worker.url], **FAST) as gw:
        for _ in range(2):  # and the connection stays usable for the next request
            answer = await ask(gw)
            answer.stream_ok()
            assert answer.body == expected
            assert (await last_outcome(gw)).status == 200
        await no_leaks()
    assert not worker.aborts


BROKEN_STREAMS: dict[str, tuple[list[bytes], int]] = {
    "ends without done": ([HEAD + chunk(EVENT) + END], 502),
    "ends with done only inside a json string": (
        [HEAD + chunk(b'data: {"t":"[DONE]"}\n\n') + END],
        502,
    ),
    "a malformed chunk size": ([HEAD + chunk(EVENT), b"zz\r\nxx\r\n"], 502),
    "a chunk longer than its size": ([HEAD + chunk(EVENT) + b"2\r\nabcdef\r\n"], 502),
    "the connection closes mid-chunk": ([HEAD + chunk(EVENT) + b"40\r\ndata: {"], 502),
}


@pytest.mark.parametrize("name", list(BROKEN_STREAMS))
async def test_a_broken_stream_ends_with_one_error_event_then_done(
    scripted: StartWorker, name: str
) -> None:
    pieces, code = BROKEN_STREAMS[name]
    worker = await scripted(script(*pieces, keep=False))
    async with run_gateway([worker.url], **FAST) as gw:
        answer = await ask(gw)
        answer.stream_error(code)
        assert answer.body.startswith(pieces[0][len(HEAD) :].split(b"\r\n")[1])
        await settled(gw)
        await no_leaks()


async def test_usage_split_across_reads_is_still_learnt(scripted: StartWorker) -> None:
    half = len(USAGE) // 2
    worker = await scripted(
        script(
            HEAD + chunk(EVENT + USAGE[:7]),
            chunk(USAGE[7:half]),
            chunk(USAGE[half:] + b"data: [DO"),
            chunk(b"NE]\n\n") + END,
        )
    )
    async with run_gateway([worker.url], **FAST) as gw:
        answer = await ask(gw)
        answer.stream_ok()
        assert answer.body == EVENT + USAGE + DONE
        outcome = await last_outcome(gw)
        assert outcome.reported_cached_tokens == 32 and outcome.reported_prompt_tokens == 40


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "5"),
        ("max_tokens", -1),
        ("max_tokens", 1.5),
        ("temperature", "hot"),
        ("top_p", [1]),
        ("user", 5),
        ("seed", "7"),
        ("sampling_params", "x"),
    ],
)
async def test_a_mistyped_field_is_a_json_400_never_forwarded(
    scripted: StartWorker, field: str, value: Any
) -> None:
    worker = await scripted(script(HEAD + chunk(EVENT + DONE) + END))
    async with run_gateway([worker.url], **FAST) as gw:
        data = orjson.loads(body())
        data[field] = value
        answer = await ask(gw, post(orjson.dumps(data)))
        answer.json_error(400)
        null = orjson.loads(body())
        null[field] = None  # absent and null are alike: not checked, forwarded
        (await ask(gw, post(orjson.dumps(null)))).stream_ok()
        assert len(worker.inference) == 1


# --- c885574: one idle ticker for every answer --------------------------------------


async def test_a_worker_silent_after_its_head_gets_a_json_504(scripted: StartWorker) -> None:
    """No event at all: nothing reached the client, so it gets a JSON error, in time."""
    worker = await scripted(silent_after(HEAD))
    async with run_gateway([worker.url], **FAST) as gw:
        answer = await ask(gw, within_s=LIMIT_S * 1.25 + 2.0)
        answer.json_error(504)
        await settled(gw)
        await no_leaks()


async def test_a_worker_silent_mid_event_is_cut_with_an_error_event(
    scripted: StartWorker,
) -> None:
    worker = await scripted(silent_after(HEAD + chunk(EVENT + b'data: {"choi')))
    async with run_gateway([worker.url], **FAST) as gw:
        answer = await ask(gw, within_s=LIMIT_S * 1.25 + 2.0)
        answer.stream_error(504)
        assert answer.body.startswith(EVENT) and answer.body.count(b"choi") == 1
        await settled(gw)
        await no_leaks()


async def test_the_shared_idle_ticker_cuts_only_the_silent_streams(
    scripted: StartWorker,
) -> None:
    """Eight streams at once on one loop: four workers fall silent mid-stream, four
    send an event every third of the limit for over twice the limit. Only the silent
    ones are cut; the others complete."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        silent = b"silent" in exchange.body
        writer.write(HEAD + chunk(EVENT))
        await writer.drain()
        for _ in range(8):
            await asyncio.sleep(LIMIT_S / 3)
            if silent:
                continue
            writer.write(chunk(EVENT))
            await writer.drain()
        if silent:
            await asyncio.sleep(LIMIT_S * 3)  # cut long before
            return False
        writer.write(chunk(DONE) + END)
        await writer.drain()
        return True

    worker = await scripted(answer)
    async with run_gateway([worker.url], **FAST) as gw:
        kinds = ["silent", "talks"] * 4
        answers = await asyncio.gather(
            *(ask(gw, post(body(content=k)), within_s=8.0) for k in kinds)
        )
        for kind, got in zip(kinds, answers, strict=True):
            if kind == "silent":
                got.stream_error(504)
            else:
                got.stream_ok()
                assert got.body.count(EVENT) == 9
        await settled(gw)
        await no_leaks()


# --- a44393b: one stall ticker for every client write --------------------------------

BIG_EVENT = b"data: " + b"x" * (256 * 1024) + b"\n\n"


def flood(events: int, tail: list[bytes]) -> Answer:
    """A worker streaming ``events`` big events (MiBs: more than the sockets hold), then
    ``tail``; it notes whether the gateway closed its connection."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD)
        try:
            for _ in range(events):
                writer.write(chunk(BIG_EVENT))
                await writer.drain()
            for piece in tail:
                await asyncio.sleep(0.05)
                writer.write(piece)
                await writer.drain()
            await asyncio.sleep(LIMIT_S * 4)
        except ConnectionError:
            pass
        return False

    return answer


def small_receive_buffer() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    return sock


@pytest.mark.parametrize(
    ("events", "tail"),
    [
        (40, [chunk(DONE) + END]),  # the stream ends while the client is stalled
        (40, [chunk(EVENT)]),  # the stream goes on
        (40, [chunk(DONE), END]),  # [DONE], then the body's end apart
        (40, [b"zz\r\n"]),  # the worker breaks while the client is stalled
    ],
    ids=["done-and-end", "more", "done-then-end", "worker-breaks"],
)
async def test_a_client_that_stops_reading_is_cut_and_its_lease_freed(
    scripted: StartWorker, events: int, tail: list[bytes]
) -> None:
    worker = await scripted(flood(events, tail))
    async with run_gateway([worker.url], **FAST) as gw:
        sock = small_receive_buffer()
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port(gw)))
        await loop.sock_sendall(sock, post(body()))
        try:
            await settled(gw, within_s=10.0)  # the client never reads: it is cut
            await no_leaks()
        finally:
            sock.close()


def trickle(size: int, count: int) -> Answer:
    """A worker writing ``count`` events of ``size`` bytes, [DONE], then apart its body's
    end (so the gateway's last write is the chunked encoding's end alone)."""
    event = b"data: " + b"y" * (size - 8) + b"\n\n"

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD)
        try:
            for _ in range(count):
                writer.write(chunk(event))
                await writer.drain()
                await asyncio.sleep(0)
            writer.write(chunk(DONE))
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(END)
            await writer.drain()
            await asyncio.sleep(LIMIT_S * 4)
        except ConnectionError:
            pass
        return False

    return answer


def small_send_buffers() -> None:
    """The gateway's client sockets send at most a few KiB ahead (as a slow link would)."""
    for obj in gc.get_objects():
        if isinstance(obj, web.RequestHandler) and obj.transport is not None:
            sock = obj.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


@pytest.mark.parametrize("kib", [100, 110, 120, 125])
async def test_a_client_stalled_at_the_streams_end_is_cut(scripted: StartWorker, kib: int) -> None:
    """The last watched write returns (aiohttp drains every 64 KiB only), the transport
    is paused with the rest; the stream's end (write_eof drains) must be watched too."""
    worker = await scripted(trickle(1024, kib))
    async with run_gateway([worker.url], **FAST) as gw:
        sock = small_receive_buffer()
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port(gw)))
        await asyncio.sleep(0.05)
        small_send_buffers()
        await loop.sock_sendall(sock, post(body()))
        try:
            await settled(gw, within_s=LIMIT_S * 1.25 + 3.0)
            await no_leaks()
        finally:
            sock.close()


# --- 216a1c6 and the connection guard ------------------------------------------------


async def dribble(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    for index in range(len(data)):
        writer.write(data[index : index + 1])
        await writer.drain()
        await asyncio.sleep(every_s)


@pytest.mark.parametrize(
    "prefix", [b"", b"\r\n\r\n", b"\r\n\r\nP"], ids=["plain", "blank-lines", "blank-lines-and-p"]
)
async def test_slowloris_on_a_kept_alive_connection_gets_a_408(
    scripted: StartWorker, prefix: bytes
) -> None:
    """A fast first request, then the next head a byte every tenth of the deadline (its
    first piece may be blank lines, which a server skips before a request line)."""
    worker = await scripted(script(HEAD + chunk(EVENT + DONE) + END))
    async with run_gateway([worker.url], **FAST) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port(gw))
        try:
            writer.write(post(body()))
            (await read_answer(reader)).stream_ok()
            if prefix:
                writer.write(prefix)  # one piece holding a blank line
                await writer.drain()
                await asyncio.sleep(0.05)
            rest = post(body())[1:] if prefix.endswith(b"P") else post(body())
            dribbler = asyncio.create_task(dribble(writer, rest, LIMIT_S / 10))
            try:
                answer = await read_answer(reader, within_s=LIMIT_S * 5)
            finally:
                dribbler.cancel()
                await asyncio.gather(dribbler, return_exceptions=True)
            answer.json_error(408)
        finally:
            writer.close()
        await no_leaks()


async def test_pipelined_requests_in_one_piece_are_answered_in_order(
    scripted: StartWorker,
) -> None:
    worker = await scripted(script(HEAD + chunk(EVENT + DONE) + END))
    async with run_gateway([worker.url], **FAST) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port(gw))
        try:
            plain = post(body(stream=False))
            writer.write(post(body()) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post(body()))
            await writer.drain()
            first = await read_answer(reader)
            first.stream_ok()
            health = await read_answer(reader)
            assert health.status == 200
            (await read_answer(reader)).stream_ok()
            assert plain
        finally:
            writer.close()
        await no_leaks()


async def test_a_huge_head_in_one_piece_gets_a_json_error(scripted: StartWorker) -> None:
    worker = await scripted(script(HEAD + chunk(EVENT + DONE) + END))
    async with run_gateway([worker.url], **FAST) as gw:
        huge = post(
            body(), extra=b"".join(b"X-Pad-%d: %s\r\n" % (i, b"y" * 8000) for i in range(40))
        )
        raw = await raw_exchange(port(gw), huge, timeout_s=3.0)
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        answer = await read_answer(reader)
        answer.json_error()
        long_line = post(body(), extra=b"X-Long: " + b"y" * 20000 + b"\r\n")
        raw = await raw_exchange(port(gw), long_line, timeout_s=3.0)
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        (await read_answer(reader)).json_error()
        assert not worker.inference


async def test_a_body_shorter_than_declared_gets_a_json_408(scripted: StartWorker) -> None:
    worker = await scripted(script(HEAD + chunk(EVENT + DONE) + END))
    async with run_gateway([worker.url], **FAST) as gw:
        data = body()
        head = post(data)
        short = head[: len(head) - len(data)] + data[:-5]
        reader, writer = await asyncio.open_connection("127.0.0.1", port(gw))
        try:
            writer.write(short)
            await writer.drain()
            (await read_answer(reader, within_s=LIMIT_S * 3 + 2.0)).json_error(408)
        finally:
            writer.close()
        assert not worker.inference
        await no_leaks()


async def test_content_length_with_chunked_is_refused(scripted: StartWorker) -> None:
    worker = await scripted(script(HEAD + chunk(EVENT + DONE) + END))
    async with run_gateway([worker.url], **FAST) as gw:
        data = body()
        smuggle = (
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (API, chunk(data) + END)
        )
        raw = await raw_exchange(port(gw), smuggle, timeout_s=3.0)
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        (await read_answer(reader)).json_error(400)
        assert not worker.inference


# --- the prefill gate (prefix_index.prefill_wait_s; off by default) -------------------

PROMPT = " ".join(f"step{i}" for i in range(1200))  # ~2,600 tokens: dozens of blocks
GATE_WAIT_S = 2.0
GATED: dict[str, Any] = {
    **FAST,
    "server__stream_idle_timeout_s": 10.0,
    "policy__name": "min_ttft",
    "prefix_index__prefill_wait_s": GATE_WAIT_S,
}


def sibling() -> bytes:
    return post(body(content=PROMPT))


def gate(gw: GatewayHandle) -> Any:
    held = gw.router._prefill
    assert held is not None
    return held


async def gate_waiting(gw: GatewayHandle, count: int, within_s: float = 3.0) -> None:
    held = gate(gw)
    for _ in range(int(within_s / 0.02)):
        if sum(held.waiting(w.id) for w in gw.registry) == count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not {count} held: {[held.waiting(w.id) for w in gw.registry]}")


def gate_empty(gw: GatewayHandle) -> bool:
    return not gate(gw)._workers


def first_byte_after(delay_s: float, first: Answer | None = None) -> Answer:
    """A worker answering a whole stream ``delay_s`` after each request (its prefill);
    ``first``, if given, answers the first request instead."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 1 and first is not None:
            return await first(exchange, writer, n)
        await asyncio.sleep(delay_s)
        writer.write(HEAD + chunk(EVENT + USAGE + DONE) + END)
        await writer.drain()
        return True

    return answer


async def test_a_client_gone_while_held_leaves_the_gate(scripted: StartWorker) -> None:
    worker = await scripted(first_byte_after(1.0))
    async with run_gateway([worker.url], **GATED) as gw:
        leader = asyncio.create_task(ask(gw, sibling()))
        await asyncio.sleep(0.2)  # the leader is in prefill
        reader, writer = await asyncio.open_connection("127.0.0.1", port(gw))
        writer.write(sibling())
        await writer.drain()
        await gate_waiting(gw, 1)
        writer.close()  # gone while held
        await gate_waiting(gw, 0, within_s=1.0)
        (await leader).stream_ok()
        assert len(worker.inference) == 1  # the one that left never reached the worker
        await settled(gw)
        await no_leaks()
        assert gate_empty(gw)
        assert reader is not None


async def test_a_leader_whose_worker_dies_before_its_first_byte_releases_its_waiters(
    scripted: StartWorker,
) -> None:
    async def dies(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        await asyncio.sleep(0.3)
        return False  # the connection closes before any byte

    worker = await scripted(first_byte_after(0.05, first=dies))
    async with run_gateway([worker.url], **GATED) as gw:
        leader = asyncio.create_task(ask(gw, sibling()))
        await asyncio.sleep(0.1)
        waiters = [asyncio.create_task(ask(gw, sibling())) for _ in range(4)]
        await gate_waiting(gw, 4)
        # released at the leader's failure, long before their bound
        answers = await asyncio.wait_for(asyncio.gather(*waiters), GATE_WAIT_S * 0.9)
        for answer in answers:
            answer.stream_ok()
        (await leader).json_error()
        await settled(gw)
        await no_leaks()
        assert gate_empty(gw)
        assert gate(gw).stats.timed_out == 0


@pytest.mark.slow
async def test_two_hundred_siblings_at_once_are_all_answered(scripted: StartWorker) -> None:
    worker = await scripted(first_byte_after(0.2))
    async with run_gateway([worker.url], **GATED) as gw:
        answers = await asyncio.wait_for(
            asyncio.gather(*(ask(gw, sibling(), within_s=20.0) for _ in range(200))), 25.0
        )
        for answer in answers:
            answer.stream_ok()
        await settled(gw)
        await no_leaks()
        assert gate_empty(gw)
        stats = gate(gw).stats
        print("200 siblings:", stats)
        assert stats.held > 0


async def test_the_same_prompt_in_a_loop_is_never_held_forever(scripted: StartWorker) -> None:
    worker = await scripted(first_byte_after(0.02))
    async with run_gateway([worker.url], **GATED) as gw:
        clients = [[asyncio.create_task(ask(gw, sibling())) for _ in range(3)] for _ in range(10)]
        for round_ in clients:  # three at once, ten times over, each round while the last ends
            for answer in await asyncio.wait_for(asyncio.gather(*round_), GATE_WAIT_S + 3.0):
                answer.stream_ok()
        await settled(gw)
        await no_leaks()
        assert gate_empty(gw)
        assert gate(gw).stats.timed_out == 0


class _Idle(asyncio.Protocol):
    """aiohttp's protocol as the guard sees it between two requests: waiting for a head."""

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = asyncio.get_running_loop().create_future()
        self.got = b""

    def data_received(self, data: bytes) -> None:
        self.got += data


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += bytes(data)

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize(
    "pieces",
    [
        [b"\r\n\r\nP"],  # blank lines and a request line's first byte in one piece
        [b"\r\n", b"\r\nPOST / HTTP/1.1\r\n"],  # blank lines over two pieces
        [b"\r\n\r\n", b"\r\n\r\n", b"G"],
    ],
)
async def test_blank_lines_before_a_request_line_do_not_meet_its_head_deadline(
    pieces: list[bytes],
) -> None:
    """A server skips blank lines before a request line (aiohttp does): their CRLFs are
    no head's end, so the deadline of the head that follows them stays armed (before, it
    was met there, and the next byte started another one)."""
    guard = ConnectionGuard(0, 60.0)
    protocol: Any = guard.wrap(_Idle)()
    transport = _Transport()
    protocol.connection_made(transport)
    protocol._timer.cancel()  # the accept's deadline: this is a kept-alive connection's
    protocol._timer = None
    for piece in pieces:
        protocol.data_received(piece)
        assert protocol._timer is not None, piece
    protocol.data_received(b"ET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert protocol._timer is None  # a whole head met it
    protocol.connection_lost(None)
    assert guard.open == 0
