"""Relay edge cases against a scripted worker: split events, drops inside an event,
drops before the first event (retried), cached-token feedback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from loadtests.harness.inprocess import run_gateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x" * 300}], "stream": True}


ABORTS = web.AppKey("aborts", list)


def _script(pieces: list[bytes], drop: bool, pause_s: float = 0.01) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(pause_s)
        if drop:
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def abort(request: web.Request) -> web.Response:
        request.app[ABORTS].append(await request.json())
        return web.Response(text="")

    app = web.Application()
    app[ABORTS] = []
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/ping", ok)
    app.router.add_post("/abort_request", abort)
    return app


@pytest.fixture
async def scripted() -> AsyncIterator[list[TestServer]]:
    servers: list[TestServer] = []
    yield servers
    for server in servers:
        await server.close()


async def _start(
    servers: list[TestServer], pieces: list[bytes], drop: bool, pause_s: float = 0.01
) -> str:
    server = TestServer(_script(pieces, drop, pause_s), host="127.0.0.1")
    await server.start_server()
    servers.append(server)
    return str(server.make_url("")).rstrip("/")


async def test_split_events_rejoin_and_cached_tokens(scripted: list[TestServer]) -> None:
    pieces = [
        b'data: {"a":',
        b'1}\n\ndata: {"b":2}\n',
        b'\ndata: {"usage":{"prompt_tokens_details":{"cached_tokens":48}}}\n\n',
        b"data: [DONE]\n\n",
    ]
    url = await _start(scripted, pieces, drop=False)
    async with run_gateway([url], policy__name="cache_aware") as gw, ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            raw = await resp.read()
        assert raw == b"".join(pieces)
        outcome = gw.router.decisions.latest(1)[0].outcome
        assert outcome is not None and outcome.reported_cached_tokens == 48


async def test_drop_inside_an_event_sends_whole_events_then_error(
    scripted: list[TestServer],
) -> None:
    url = await _start(scripted, [b'data: {"a":1}\n\ndata: {"b":', b"2"], drop=True)
    async with run_gateway([url]) as gw, ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            raw = await resp.read()
        events = raw.split(b"\n\n")
        assert events[0] == b'data: {"a":1}'
        assert events[1].startswith(b'data: {"error":')
        assert events[2:] == [b"data: [DONE]", b""]
        assert all(w.in_flight == 0 for w in gw.registry)


async def test_drop_before_first_event_is_retried(scripted: list[TestServer]) -> None:
    broken = await _start(scripted, [], drop=True)
    good = await _start(scripted, [b'data: {"a":1}\n\n', b"data: [DONE]\n\n"], drop=False)
    async with run_gateway([broken, good]) as gw, ClientSession() as client:
        for _ in range(4):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert resp.headers["x-gateway-worker"] == good
                assert await resp.read() == b'data: {"a":1}\n\ndata: [DONE]\n\n'


async def test_client_disconnect_sends_abort_with_the_rid(scripted: list[TestServer]) -> None:
    url = await _start(scripted, [b'data: {"a":1}\n\n'] * 50, drop=False, pause_s=0.05)
    async with run_gateway([url]) as gw, ClientSession() as client:
        async with client.post(
            gw.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "gone-1"}
        ) as resp:
            await resp.content.readany()
            resp.close()
        worker = next(iter(gw.registry))
        for _ in range(100):
            if scripted[0].app[ABORTS] and worker.in_flight == 0:
                break
            await asyncio.sleep(0.02)
        # the abort names the gateway's rid for this request, never the client's id
        aborts = scripted[0].app[ABORTS]
        assert len(aborts) == 1 and aborts[0]["rid"] != "gone-1" and len(aborts[0]["rid"]) == 32
        assert worker.in_flight == 0 and worker.decoding_requests == 0
