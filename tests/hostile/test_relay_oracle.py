"""Property tests with h11 as the oracle: generated worker answers (Content-Length, chunked
with extensions and trailers, close-delimited, interim 1xx heads, bodiless statuses,
``Connection: close``, bytes after the answer) split at every byte or at random points.

- the upstream parser, fed piece by piece without a network, must agree with h11 on the
  status, the body and whether the connection may be reused;
- the gateway, relaying the same answers from a scripted worker over real sockets, must
  give the client h11's body (event streams: h11's body with line ends normalised).
"""

from __future__ import annotations

import asyncio
import http.client
import queue
from dataclasses import dataclass
from typing import Any

import h11
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_worker import Exchange, StartWorker

from gateway.forward.upstream import UpstreamPool, UpstreamResponse, _Conn
from loadtests.harness.inprocess import run_gateway

TOKEN = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=8).map(lambda s: "x-" + s)
VALUE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=12)


@dataclass
class Answer:
    raw: bytes
    close_delimited: bool  # the worker closes to end it
    trailing: bool  # bytes follow the answer


@st.composite
def answers(draw: st.DrawFn, statuses: tuple[int, ...] = (200, 201, 204, 304, 400, 404)) -> Answer:
    status = draw(st.sampled_from(statuses))
    headers = draw(st.lists(st.tuples(TOKEN, VALUE), max_size=4))
    body = draw(st.binary(max_size=200))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    if status in (204, 304):
        body, framing = b"", "none"
    lines = [f"HTTP/1.1 {status} Whatever"] + [f"{k}: {v}" for k, v in headers]
    if draw(st.booleans()):
        lines.append("Connection: close")
    payload = body
    if framing == "length":
        lines.append(f"Content-Length: {len(body)}")
    elif framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
        payload = _chunked(draw, body)
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
    if draw(st.booleans()):
        raw = b"HTTP/1.1 100 Continue\r\n\r\n" + raw
    trailing = framing in ("length", "chunked") and draw(st.booleans())
    if trailing:
        raw += b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nSTOLEN"
    return Answer(raw, framing == "close", trailing)


def _chunked(draw: st.DrawFn, body: bytes) -> bytes:
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=5)))
    out = b""
    for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
        if b > a:
            ext = b";name=value" if draw(st.booleans()) else b""
            out += b"%x%s\r\n%s\r\n" % (b - a, ext, body[a:b])
    trailer = b"X-Trailer: t\r\n" if draw(st.booleans()) else b""
    return out + b"0\r\n" + trailer + b"\r\n"


@dataclass
class Parsed:
    status: int
    body: bytes
    reusable: bool


def oracle(answer: Answer) -> Parsed:
    """h11's reading of the answer to a POST."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(
        h11.Request(method="POST", target="/", headers=[("Host", "w"), ("Content-Length", "0")])
    )
    conn.send(h11.EndOfMessage())
    conn.receive_data(answer.raw)
    status, body = 0, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            assert answer.close_delimited
            conn.receive_data(b"")
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            break
    # h11 tells "Connection: close"; an answer ended by the close is never reusable
    reusable = conn.their_state is h11.DONE and not answer.close_delimited and not answer.trailing
    return Parsed(status, body, reusable)


class _Transport:
    """Enough of a transport for the parser's side of a connection."""

    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str) -> None:
        return None  # no socket: nothing for the pool to poll

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _ours(answer: Answer, pieces: list[bytes]) -> Parsed:
    pool = UpstreamPool(1.0)
    target = pool._target("http://127.0.0.1:9")
    conn = _Conn()
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    response = UpstreamResponse(pool, target, conn, loop.time() + 5, loop.time() + 5)
    for piece in pieces:
        conn.data_received(piece)
    if answer.close_delimited:
        conn.eof_received()
    await response._head_received()
    body = await response.read()
    # pooled and still usable (bytes arriving while idle close a pooled connection)
    reusable = list(target.idle) == [conn] and conn.usable(loop.time(), 60.0)
    return Parsed(response.status, body, reusable)


def _split(raw: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(raw)) for c in cuts})
    return [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True) if b > a]


@settings(max_examples=200, deadline=None)
@given(answers(), st.lists(st.integers(0, 400), max_size=10))
def test_parser_agrees_with_h11_at_random_splits(answer: Answer, cuts: list[int]) -> None:
    assert asyncio.run(_ours(answer, _split(answer.raw, cuts))) == oracle(answer)


@settings(max_examples=50, deadline=None)
@given(answers())
def test_parser_agrees_with_h11_a_byte_at_a_time(answer: Answer) -> None:
    pieces = [answer.raw[i : i + 1] for i in range(len(answer.raw))]
    assert asyncio.run(_ours(answer, pieces)) == oracle(answer)


# --- the gateway, over sockets ---------------------------------------------------------------


@st.composite
def streams(draw: st.DrawFn) -> tuple[Answer, bytes]:
    """An SSE answer (line ends LF, CRLF or CR, chunked or by length) and what the client
    must get: h11's body with line ends normalised to LF."""
    end = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    texts = draw(st.lists(st.text("abc xyz{}:", max_size=30), max_size=5))
    events = [b"data: " + orjson.dumps({"t": t}) + end + end for t in texts]
    body = b"".join(events) + b"data: [DONE]" + end + end
    if draw(st.booleans()):
        framing = b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(draw, body)
    else:
        framing = b"Content-Length: %d\r\n\r\n" % len(body) + body
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + framing
    expected = oracle(Answer(raw, False, False)).body
    return Answer(raw, False, False), expected.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


async def test_gateway_relays_what_h11_reads(scripted: StartWorker) -> None:
    scripts: queue.Queue[tuple[Answer, list[int]]] = queue.Queue()

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        raw_answer, cuts = scripts.get_nowait()
        for piece in _split(raw_answer.raw, cuts):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.001)  # separate reads, as far as the kernel lets us
        return not (raw_answer.trailing or raw_answer.close_delimited)

    worker = await scripted(answer)
    async with run_gateway([worker.url], worker_kind="sglang") as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        await asyncio.to_thread(_check_through_gateway, port, scripts)


def _post(port: int, stream: bool) -> tuple[int, bytes]:
    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": stream}
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _check_through_gateway(port: int, scripts: queue.Queue[Any]) -> None:
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(streams(), st.lists(st.integers(0, 300), max_size=6))
    def sse(sample: tuple[Answer, bytes], cuts: list[int]) -> None:
        answer, expected = sample
        scripts.put((answer, cuts))
        assert _post(port, stream=True) == (200, expected)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(answers(statuses=(200, 201, 400, 404)), st.lists(st.integers(0, 300), max_size=6))
    def whole(answer: Answer, cuts: list[int]) -> None:
        scripts.put((answer, cuts))
        truth = oracle(answer)
        assert _post(port, stream=False) == (truth.status, truth.body)

    sse()
    whole()
