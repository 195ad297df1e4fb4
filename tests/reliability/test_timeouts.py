"""The four timeouts towards workers and the client-side ones: connect, first byte
(retried elsewhere), idle between streamed chunks (504 error event), total; a slow
request body (408); the SIGTERM grace period (streams cut, exit 0)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
from aiohttp import ClientSession, web

from gateway.workers.registry import HealthFlag
from loadtests.harness.inprocess import run_gateway, sim_faults
from simulator.fleet import SimulatedFleet

Eventually = Callable[..., Awaitable[None]]  # the ``eventually`` fixture (tests/conftest.py)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8}


@pytest.fixture
async def stalling_worker() -> AsyncIterator[str]:
    """A worker that streams two events, then goes silent without closing."""

    async def ping(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(2):
            event = {"id": "x", "choices": [{"index": 0, "delta": {"content": str(i)}}]}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await asyncio.sleep(3600)
        return resp

    app = web.Application()
    app.router.add_get("/ping", ping)
    app.router.add_get("/health", ping)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_first_byte_timeout_retries_elsewhere_and_penalises(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls, server__first_byte_timeout_s=0.5) as gw:
        await sim_faults(client, fleet.urls[0], hang=True)
        started = time.monotonic()
        for _ in range(6):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-gateway-worker"] != fleet.urls[0]
        assert time.monotonic() - started < 10
        hung = gw.registry.find(fleet.urls[0])
        assert hung is not None
        assert hung.consecutive_5xx >= 1 or HealthFlag.EJECTED in hung.flags


async def test_stream_idle_timeout_ends_with_504_event(
    stalling_worker: str, client: ClientSession, eventually: Eventually
) -> None:
    async with run_gateway([stalling_worker], server__stream_idle_timeout_s=0.5) as gw:
        started = time.monotonic()
        async with client.post(
            gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as resp:
            assert resp.status == 200
            raw = await asyncio.wait_for(resp.read(), 10)
        assert time.monotonic() - started < 3.0  # 0.5 s of silence, cut within 0.625 s
        events = [e for e in raw.split(b"\n\n") if e]
        assert len(events) == 4 and events[-1] == b"data: [DONE]"
        assert orjson.loads(events[-2][6:])["error"]["code"] == 504
        await eventually(lambda: all(w.in_flight == 0 for w in gw.registry), 5, "in-flight 0")
        worker = gw.registry.find(stalling_worker)
        assert worker is not None and worker.times_ejected >= 1  # penalised


async def test_total_timeout_is_504(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls[:1], server__request_timeout_s=0.8) as gw:
        started = time.monotonic()
        payload = {**CHAT, "max_tokens": 100000, "ignore_eos": True, "stream": True}
        async with client.post(gw.url + "/v1/chat/completions", json=payload) as resp:
            raw = await asyncio.wait_for(resp.read(), 10)
        assert time.monotonic() - started < 4.0
        assert b'"code":504' in raw and raw.endswith(b"data: [DONE]\n\n")


async def test_connect_timeout_bounds_an_unroutable_worker(client: ClientSession) -> None:
    # A listener whose backlog is full never completes the handshake.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        port = s.getsockname()[1]
        fillers = []
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(("127.0.0.1", port))
            fillers.append(c)
        try:
            async with run_gateway(
                [f"http://127.0.0.1:{port}"], ready_within_s=0, server__connect_timeout_s=0.5
            ) as gw:
                started = time.monotonic()
                async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status in (502, 503, 504)
                assert time.monotonic() - started < 4.0
        finally:
            for c in fillers:
                c.close()


async def test_slow_request_body_is_408(fleet: SimulatedFleet) -> None:
    async with run_gateway(fleet.urls[:1], server__client_body_timeout_s=0.5) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        assert head.startswith(b"HTTP/1.1 408")
