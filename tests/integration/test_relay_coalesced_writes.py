"""The relay's coalesced writes keep what the client sees: the response head is not held
back while the worker's first event is incomplete, a stream the worker sends in one piece
arrives whole and ends, and the worker's connection is reused across streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from loadtests.harness.inprocess import run_gateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x" * 300}], "stream": True}
GO = web.AppKey("go", asyncio.Event)
PEERS = web.AppKey("peers", list)
WHOLE = b'data: {"a":1}\n\ndata: {"usage":{"cached_tokens":5}}\n\ndata: [DONE]\n\n'


def _worker(first: bytes, rest: bytes, wait: bool) -> web.Application:
    """Sends ``first``, then (after the test's go when ``wait``) ``rest`` with the end."""

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        request.app[PEERS].append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        if wait:
            await request.app[GO].wait()
        await resp.write_eof(rest)
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app[GO] = asyncio.Event()
    app[PEERS] = []
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/ping", ok)
    return app


@pytest.fixture
async def servers() -> AsyncIterator[list[TestServer]]:
    started: list[TestServer] = []
    yield started
    for server in started:
        await server.close()


async def _start(servers: list[TestServer], app: web.Application) -> str:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    servers.append(server)
    return str(server.make_url("")).rstrip("/")


async def test_head_arrives_while_the_first_event_is_incomplete(
    servers: list[TestServer],
) -> None:
    app = _worker(b'data: {"a":', b"1}\n\ndata: [DONE]\n\n", wait=True)
    url = await _start(servers, app)
    async with run_gateway([url]) as gw, ClientSession() as client:
        post = client.post(gw.url + "/v1/chat/completions", json=CHAT)
        # the worker holds the rest until the client has the head: a head held back for
        # the first whole event would never come
        resp = await asyncio.wait_for(post, 10)
        try:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            app[GO].set()
            assert await resp.read() == b'data: {"a":1}\n\ndata: [DONE]\n\n'
        finally:
            resp.release()


async def test_a_stream_in_one_piece_arrives_whole_and_the_connection_is_reused(
    servers: list[TestServer],
) -> None:
    app = _worker(b"", WHOLE, wait=False)
    url = await _start(servers, app)
    async with run_gateway([url], policy__name="cache_aware") as gw, ClientSession() as client:
        for _ in range(3):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert await resp.read() == WHOLE
        outcome = gw.router.decisions.latest(1)[0].outcome
        assert outcome is not None and outcome.reported_cached_tokens == 5
    peers: list[object] = app[PEERS]
    assert len(peers) == 3 and len(set(peers)) == 1  # one kept-alive connection
