"""Worker kinds through the gateway, against small scripted llama.cpp and vLLM workers.

The fakes answer the shapes docs/REAL_ENGINE.md measured on llama.cpp (``Server:
llama.cpp``, ``/props``, ``/metrics``, 404 on ``/server_info``, ``timings.cache_n``, no
abort endpoint) and vLLM's documented ones (``/metrics`` gauges, ``/v1/models`` owned by
``vllm``). They record what reached them, so the tests see what the gateway sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import ClientSession, web

from gateway.http import app_keys
from loadtests.harness.inprocess import run_gateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 4}


@dataclass
class Fake:
    """What a fake worker saw."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    stream_closed: asyncio.Event = field(default_factory=asyncio.Event)


async def _ok(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _llama_app(fake: Fake) -> web.Application:
    @web.middleware
    async def server_header(request: web.Request, handler: Any) -> web.StreamResponse:
        fake.paths.append(request.path)
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPNotFound:
            response = web.json_response({"error": {"code": 404}}, status=404)
        response.headers["Server"] = "llama.cpp"
        return response

    async def props(_: web.Request) -> web.Response:
        settings = {"n_ctx": 4096}
        return web.json_response(
            {"total_slots": 2, "default_generation_settings": settings, "model_alias": "fake"}
        )

    async def metrics(_: web.Request) -> web.Response:
        text = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 3\n"
        return web.Response(text=text, content_type="text/plain")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        fake.bodies.append(body)
        timings = {"cache_n": 7, "prompt_n": 50}
        if not body.get("stream"):
            usage = {"prompt_tokens": 57, "prompt_tokens_details": {"cached_tokens": 7}}
            return web.json_response({"choices": [], "usage": usage, "timings": timings})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunks = 200 if body.get("max_tokens", 0) > 100 else 2
        try:
            for _ in range(chunks):
                await response.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
                await asyncio.sleep(0.02)
        except (ConnectionResetError, OSError):
            fake.stream_closed.set()  # llama.cpp stops a stream whose client went away
            return response
        end = {"choices": [{"finish_reason": "stop", "delta": {}}], "timings": timings}
        await response.write(b"data: " + orjson.dumps(end) + b"\n\ndata: [DONE]\n\n")
        return response

    app = web.Application(middlewares=[server_header])
    app.router.add_get("/health", _ok)
    app.router.add_get("/props", props)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _vllm_app(fake: Fake) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        text = (
            'vllm:num_requests_running{model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{model_name="m"} 4.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def chat(request: web.Request) -> web.Response:
        fake.bodies.append(orjson.loads(await request.read()))
        usage = {"prompt_tokens": 57, "prompt_tokens_details": {"cached_tokens": 32}}
        return web.json_response({"choices": [], "usage": usage})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "org/model", "owned_by": "vllm"}]})

    app = web.Application()
    app.router.add_get("/health", _ok)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@contextlib.asynccontextmanager
async def serve(app: web.Application, fake: Fake) -> AsyncIterator[Fake]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()


async def _workers(client: ClientSession, gateway_url: str) -> list[dict[str, Any]]:
    async with client.get(gateway_url + "/workers") as resp:
        workers: list[dict[str, Any]] = (await resp.json())["workers"]
        return workers


async def _wait_for_load(client: ClientSession, gateway_url: str) -> dict[str, Any]:
    for _ in range(100):
        worker = (await _workers(client, gateway_url))[0]
        if worker["engine_load"] is not None:
            return worker
        await asyncio.sleep(0.05)
    raise AssertionError("the engine load was never read")


async def test_llamacpp_is_discovered_with_slots_context_and_load() -> None:
    fake = Fake()
    async with (
        serve(_llama_app(fake), fake),
        ClientSession() as client,
        run_gateway([fake.url]) as gw,
    ):
        worker = await _wait_for_load(client, gw.url)
    assert worker["kind"] == "llamacpp" and worker["healthy"] is True
    assert (worker["max_sequences"], worker["capacity_tokens"], worker["model"]) == (
        2,
        8192,
        "fake",
    )
    assert worker["engine_load"]["running_requests"] == 1
    assert worker["engine_load"]["waiting_requests"] == 3
    assert "/health" in fake.paths  # its own probe, not the configured /ping


async def test_llamacpp_body_untouched_cached_tokens_read_no_abort_request() -> None:
    fake = Fake()
    async with (
        serve(_llama_app(fake), fake),
        ClientSession() as client,
        run_gateway([fake.url + "#llamacpp"], policy__name="min_ttft") as gw,
    ):
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            assert (await resp.json())["timings"]["cache_n"] == 7  # relayed as is
        streamed = {**CHAT, "stream": True}
        async with client.post(gw.url + "/v1/chat/completions", json=streamed) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        long = {**CHAT, "stream": True, "max_tokens": 1000}
        async with client.post(gw.url + "/v1/chat/completions", json=long) as resp:
            await resp.content.readany()
            resp.close()  # the client goes away mid-stream
        await asyncio.wait_for(fake.stream_closed.wait(), 5.0)
        await asyncio.sleep(0.1)
        records = gw.app[app_keys.DECISIONS].latest(10)
    assert all("rid" not in body for body in fake.bodies)  # no rid added for llama.cpp
    assert fake.bodies[0] == CHAT
    reported = [r.outcome.reported_cached_tokens for r in records if r.outcome is not None]
    assert reported.count(7) == 2  # usage.cached_tokens (plain), timings.cache_n (stream)
    assert "/abort_request" not in fake.paths  # closing the stream is llama.cpp's abort


async def test_vllm_is_discovered_and_polled() -> None:
    fake = Fake()
    async with (
        serve(_vllm_app(fake), fake),
        ClientSession() as client,
        run_gateway([fake.url]) as gw,
    ):
        worker = await _wait_for_load(client, gw.url)
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
        records = gw.app[app_keys.DECISIONS].latest(1)
    assert (worker["kind"], worker["model"], worker["capacity_tokens"]) == (
        "vllm",
        "org/model",
        1600,
    )
    load = worker["engine_load"]
    assert (load["running_requests"], load["waiting_requests"], load["token_usage"]) == (2, 4, 0.5)
    assert fake.bodies == [CHAT]
    assert records[0].outcome is not None and records[0].outcome.reported_cached_tokens == 32


async def test_kind_given_on_post_workers() -> None:
    fake = Fake()
    async with serve(_vllm_app(fake), fake), ClientSession() as client, run_gateway([]) as gw:
        bad = {"url": fake.url, "kind": "tgi"}
        async with client.post(gw.url + "/workers", json=bad) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "kind"
        body = {"url": fake.url, "kind": "openai"}
        async with client.post(gw.url + "/workers", json=body) as resp:
            assert resp.status == 201
            added = await resp.json()
    assert added["kind"] == "openai" and added["healthy"] is True  # probed at /v1/models
    assert added["model"] == "org/model"
    assert "/metrics" not in fake.paths  # a generic OpenAI server has no load to poll
