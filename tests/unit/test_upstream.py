"""The lean upstream client against a scripted raw TCP worker: framing, keep-alive,
stale connections, errors and deadlines."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from gateway.forward.upstream import UpstreamError, UpstreamPool

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


class Worker:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Coroutine[Any, Any, Worker]]]:
    workers: list[Worker] = []

    async def start(script: Script) -> Worker:
        worker = Worker(script)
        worker.server = await asyncio.start_server(worker._serve, "127.0.0.1", 0)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        assert worker.server is not None
        worker.server.close()
        await worker.server.wait_closed()


def _deadline(seconds: float = 5.0) -> float:
    return asyncio.get_running_loop().time() + seconds


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
    b'f\r\ndata: {"a":1}\n\n\r\n'
    b'f\r\ndata: {"b":2}\n\n\r\n'
    b"0\r\n\r\n"
)


async def test_chunked_any_split_and_keep_alive(serve: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            for i in range(0, len(CHUNKED), 7):  # framing split at awkward places
                writer.write(CHUNKED[i : i + 7])
                await writer.drain()
                await asyncio.sleep(0)

    worker = await serve(script)
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        for _ in range(3):
            resp = await pool.request(
                worker.url, "/v1/chat/completions", [("X-A", "1")], b'{"x":1}', _deadline()
            )
            assert resp.status == 200
            assert resp.header("content-type") == "text/event-stream"
            body = b""
            while chunk := await resp.readany():
                body += chunk
            assert body == b'data: {"a":1}\n\ndata: {"b":2}\n\n'
        assert worker.connections == 1  # kept alive and reused
    finally:
        await pool.close()


async def test_content_length_and_request_bytes(serve: Any) -> None:
    seen: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await _read_request(reader))
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\nnope!")
        await writer.drain()
        await reader.read()

    worker = await serve(script)
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        resp = await pool.request(
            worker.url, "/generate?x=1", [("x-request-id", "r1")], b'{"text":"hi"}', _deadline()
        )
        assert resp.status == 400 and await resp.read() == b"nope!"
    finally:
        await pool.close()
    head, _, body = seen[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /generate?x=1 HTTP/1.1\r\n")
    assert b"\r\nx-request-id: r1" in head and b"Content-Length: 13" in head
    assert body == b'{"text":"hi"}'


async def test_stale_idle_connection_is_replaced(serve: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        # then close without "Connection: close": the pooled connection goes stale

    worker = await serve(script)
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        for _ in range(3):
            resp = await pool.request(worker.url, "/", [], b"{}", _deadline())
            assert await resp.read() == b"ok"
            await asyncio.sleep(0.05)  # the worker's close arrives while idle: not reused
        assert worker.connections == 3
    finally:
        await pool.close()


async def test_refused_is_a_connect_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    pool = UpstreamPool(connect_timeout_s=1.0)
    with pytest.raises(UpstreamError) as info:
        await pool.request(f"http://127.0.0.1:{port}", "/", [], b"{}", _deadline())
    assert info.value.kind == "connect"


async def test_cut_body_is_dropped_and_deadline_is_timeout(serve: Any) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")
        await writer.drain()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(10)

    cutter, hanger = await serve(cut), await serve(hang)
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        resp = await pool.request(cutter.url, "/", [], b"{}", _deadline())
        assert await resp.readany() == b"ab"
        with pytest.raises(UpstreamError) as info:
            await resp.readany()
        assert info.value.kind == "dropped"
        with pytest.raises(TimeoutError):
            await pool.request(hanger.url, "/", [], b"{}", _deadline(0.2))
    finally:
        await pool.close()


async def test_close_delimited_body(serve: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        await writer.drain()

    worker = await serve(script)
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        resp = await pool.request(worker.url, "/", [], b"{}", _deadline())
        assert not resp.keep_alive and await resp.read() == b"all of it"
    finally:
        await pool.close()


async def test_body_past_the_deadline_is_timeout(serve: Any) -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
        await writer.drain()
        await asyncio.sleep(10)

    worker = await serve(slow)
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        resp = await pool.request(worker.url, "/", [], b"{}", _deadline(0.3))
        assert await resp.readany() == b"ab"
        with pytest.raises(TimeoutError):
            await resp.readany()
        assert await resp.readany() == b""  # closed: nothing more, no error
    finally:
        await pool.close()


async def test_interim_1xx_is_skipped(serve: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    worker = await serve(script)
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        resp = await pool.request(worker.url, "/", [], b"{}", _deadline())
        assert resp.status == 200 and await resp.read() == b"ok"
    finally:
        await pool.close()


async def test_large_body_paused_then_complete_leaves_a_reading_connection(serve: Any) -> None:
    body = b"x" * (150 << 10)  # past the high-water mark in one read: reading pauses

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    worker = await serve(script)
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        for _ in range(3):
            resp = await pool.request(worker.url, "/", [], b"{}", _deadline())
            await asyncio.sleep(0.05)  # the whole body arrives while nobody reads
            assert await resp.read() == body
        assert worker.connections == 1
    finally:
        await pool.close()


async def test_a_close_the_loop_has_not_delivered_yet_is_seen_before_reuse(serve: Any) -> None:
    writers: list[asyncio.StreamWriter] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writers.append(writer)
        await asyncio.sleep(5)

    worker = await serve(script)
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        resp = await pool.request(worker.url, "/", [], b"{}", _deadline())
        assert await resp.read() == b"ok"
        target = pool._target(worker.url)
        assert len(target.idle) == 1
        # a FIN, in the kernel at once on loopback; the loop has not run since to see it
        writers[0].get_extra_info("socket").shutdown(socket.SHUT_WR)
        assert pool._take(target) is None
    finally:
        await pool.close()
