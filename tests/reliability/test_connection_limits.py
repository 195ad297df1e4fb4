"""Connection limits (``gateway.http.connguard``): a cap on open connections answered with a
503 JSON error, and slowloris clients (a request head that never ends) cut off, on a
new connection and on every later request of a kept-alive one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from gateway.http.connguard import ConnectionGuard, GuardedSite

Eventually = Callable[..., Awaitable[None]]  # the ``eventually`` fixture (tests/conftest.py)


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _boom(_: web.Request) -> web.Response:
    raise RuntimeError("a bug")


@pytest.fixture
async def guarded() -> AsyncIterator[tuple[ConnectionGuard, int]]:
    app = web.Application()
    app.router.add_get("/", _ok)
    app.router.add_get("/boom", _boom)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    guard = ConnectionGuard(max_connections=3, header_timeout_s=0.5)
    site = GuardedSite(runner, "127.0.0.1", 0, guard)
    await site.start()
    port = int(runner.addresses[0][1])
    try:
        yield guard, port
    finally:
        await runner.cleanup()


async def _get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


async def test_over_the_cap_is_503_then_room_again(
    guarded: tuple[ConnectionGuard, int], eventually: Eventually
) -> None:
    guard, port = guarded
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    await eventually(lambda: guard.open == 3, 5, "three connections counted")
    answer = await _get(port)
    assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer
    assert b'"code":503' in answer and guard.refused == 1
    for _, writer in idle:
        writer.close()
    await eventually(lambda: guard.open == 0, 5, "closed connections uncounted")
    assert (await _get(port)).startswith(b"HTTP/1.1 200")


async def test_slowloris_is_cut_off(
    guarded: tuple[ConnectionGuard, int], eventually: Eventually
) -> None:
    guard, port = guarded
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the head never ends
    for _ in range(3):
        await asyncio.sleep(0.1)
        writer.write(b"X-Slow: 1\r\n")
    data = await asyncio.wait_for(reader.read(), 5)  # closed by the gateway
    assert data.startswith(b"HTTP/1.1 408") and b"Connection: close" in data
    assert data.endswith(b'"code":408}}')
    assert guard.timed_out == 1
    await eventually(lambda: guard.open == 0, 5, "the slow connection uncounted")
    writer.close()
    assert (await _get(port)).startswith(b"HTTP/1.1 200")  # whole heads still pass


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One whole response (head and Content-Length body) from a kept-alive connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def test_slow_second_head_on_a_kept_alive_connection_is_cut_off(
    guarded: tuple[ConnectionGuard, int], eventually: Eventually
) -> None:
    guard, port = guarded  # header_timeout_s=0.5; aiohttp's keep-alive timeout: an hour
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0.8)  # idle longer than the head deadline: still kept alive
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the third head never ends
    answer = b""
    for _ in range(50):  # a header line every 0.1 s for up to 5 s
        await asyncio.sleep(0.1)
        if reader.at_eof() or writer.is_closing():
            break
        writer.write(b"X-Slow: 1\r\n")
        with contextlib.suppress(TimeoutError):
            answer += await asyncio.wait_for(reader.read(4096), 0.01)
    answer += await asyncio.wait_for(reader.read(), 5)
    assert answer.startswith(b"HTTP/1.1 408"), answer  # not the keep-alive timeout's close
    assert guard.timed_out == 1
    await eventually(lambda: guard.open == 0, 5, "the slow connection uncounted")
    writer.close()


async def test_a_head_split_across_a_pipelined_request_leaves_no_deadline_behind(
    guarded: tuple[ConnectionGuard, int],
) -> None:
    guard, port = guarded  # header_timeout_s=0.5
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # the first request whole and the second's head but its last byte, in one write
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r")
    assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0.05)
    writer.write(b"\n")
    assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(1.0)  # idle for twice the head deadline: kept alive, no 408
    assert not reader.at_eof() and guard.timed_out == 0
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    writer.close()


async def test_a_handler_crash_is_a_json_500(guarded: tuple[ConnectionGuard, int]) -> None:
    _, port = guarded
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)  # aiohttp closes after its own errors
    writer.close()
    assert data.startswith(b"HTTP/1.1 500") and b"Content-Type: application/json" in data
    assert data.endswith(b'"code":500}}') and b"a bug" not in data
