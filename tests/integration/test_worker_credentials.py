"""What a worker sees of credentials (``gateway.forward.credentials.WorkerCredentials``): never the
client's key when the gateway checks keys, the configured worker key on proxied requests
and on the gateway's own probes and polls, and the client's headers untouched otherwise.

The worker is a small aiohttp app that records the credential headers of every request
(the simulator does not expose request headers).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from gateway.config import ConfigError
from loadtests.harness.inprocess import run_gateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CLIENT_KEY, WORKER_KEY, ADMIN_KEY = "client-secret-1", "worker-secret-1", "admin-secret-1"
COMPLETION = {
    "id": "c",
    "object": "chat.completion",
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
}


@dataclass
class RecordingWorker:
    url: str = ""
    # (path, Authorization or None, x-api-key or None) of every request, in order
    seen: list[tuple[str, str | None, str | None]] = field(default_factory=list)

    def credentials(self, path: str) -> set[tuple[str | None, str | None]]:
        return {(auth, key) for p, auth, key in self.seen if p == path}

    async def handle(self, request: web.Request) -> web.Response:
        headers = request.headers
        self.seen.append((request.path, headers.get("Authorization"), headers.get("X-Api-Key")))
        if request.path == "/v1/chat/completions":
            return web.json_response(COMPLETION)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m"}]})
        if request.path == "/v1/loads":
            return web.json_response({"loads": []})
        if request.path in ("/ping", "/health"):
            return web.Response(text="ok")
        return web.Response(status=404)


@pytest.fixture
async def worker() -> AsyncIterator[RecordingWorker]:
    recording = RecordingWorker()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recording.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    recording.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield recording
    finally:
        await runner.cleanup()


async def _chat(client: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> None:
    async with client.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    async with client.get(url + "/v1/models", headers=headers) as resp:
        assert resp.status == 200, await resp.text()


async def test_one_shared_key_goes_to_the_workers_as_sglang_router_does(
    worker: RecordingWorker, client: aiohttp.ClientSession
) -> None:
    async with run_gateway([worker.url + "#sglang"], server__api_key=CLIENT_KEY) as gw:
        await _chat(client, gw.url, {"Authorization": f"Bearer {CLIENT_KEY}"})
        await _chat(client, gw.url, {"X-Api-Key": CLIENT_KEY})
    # the gateway's key, as Authorization only, on requests and on its own calls
    for path in ("/v1/chat/completions", "/ping"):
        assert worker.credentials(path) == {(f"Bearer {CLIENT_KEY}", None)}, path


async def test_other_client_keys_are_not_forwarded(
    worker: RecordingWorker, client: aiohttp.ClientSession
) -> None:
    async with run_gateway([worker.url + "#sglang"], server__api_keys=[CLIENT_KEY]) as gw:
        await _chat(client, gw.url, {"Authorization": f"Bearer {CLIENT_KEY}"})
        await _chat(client, gw.url, {"X-Api-Key": CLIENT_KEY})
    assert worker.credentials("/v1/chat/completions") == {(None, None)}
    assert all(CLIENT_KEY not in str(row) for row in worker.seen)


async def test_a_header_that_is_not_utf8_is_forwarded_when_credentials_are_swapped(
    worker: RecordingWorker,
) -> None:
    async with run_gateway([worker.url + "#sglang"], server__api_key=CLIENT_KEY) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps(CHAT).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {CLIENT_KEY}\r\n".encode()
            + b"X-Foo: \xff\xfe\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10.0)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


async def test_worker_key_reaches_every_call(
    worker: RecordingWorker, client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with run_gateway(
        [worker.url + "#sglang"],
        server__api_key=CLIENT_KEY,
        server__worker_api_key=WORKER_KEY,
        server__admin_api_key=ADMIN_KEY,
    ) as gw:
        await _chat(client, gw.url, {"Authorization": f"Bearer {CLIENT_KEY}"})
    expected = {(f"Bearer {WORKER_KEY}", None)}
    for path in ("/v1/chat/completions", "/v1/models", "/ping", "/v1/loads"):
        assert worker.credentials(path) == expected, path
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert CLIENT_KEY not in logged and WORKER_KEY not in logged


async def test_worker_key_from_the_environment_without_client_keys(
    worker: RecordingWorker, client: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_WORKER_KEY", WORKER_KEY)
    async with run_gateway(
        [worker.url + "#sglang"],
        server__worker_api_key_env="TEST_WORKER_KEY",
        server__admin_api_key=ADMIN_KEY,
    ) as gw:
        # no client keys (the admin key, required with a worker key, opens the API too):
        # the caller's credentials are replaced by the worker key
        await _chat(client, gw.url, {"Authorization": f"Bearer {ADMIN_KEY}", "X-Api-Key": "m"})
    assert worker.credentials("/v1/chat/completions") == {(f"Bearer {WORKER_KEY}", None)}
    assert worker.credentials("/ping") == {(f"Bearer {WORKER_KEY}", None)}


async def test_without_keys_the_client_header_passes_through(
    worker: RecordingWorker, client: aiohttp.ClientSession
) -> None:
    async with run_gateway([worker.url + "#sglang"]) as gw:
        await _chat(client, gw.url, {"Authorization": "Bearer direct", "X-Api-Key": "direct"})
    assert worker.credentials("/v1/chat/completions") == {("Bearer direct", "direct")}
    assert worker.credentials("/ping") == {(None, None)}  # the gateway's own calls: none


async def test_a_worker_key_without_an_admin_key_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # else any client could add a worker of theirs and receive the key with its first probe
    with pytest.raises(ConfigError, match="admin_api_key"):
        async with run_gateway([], server__worker_api_key=WORKER_KEY):
            pass
    monkeypatch.setenv("TEST_WORKER_KEY", WORKER_KEY)
    with pytest.raises(ConfigError, match="admin_api_key"):
        async with run_gateway([], server__worker_api_key_env="TEST_WORKER_KEY"):
            pass
