"""The simulated llama.cpp server's HTTP API against docs/REAL_ENGINE.md, and the gateway
discovering it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from loadtests.harness.inprocess import run_gateway
from simulator.fleet import SimConfig, SimulatedFleet
from simulator.model.slots import SlotWorkerModel

SYSTEM = " ".join(f"word{i}" for i in range(300))


def chat(user: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "anything", "messages": messages, "max_tokens": 4, **extra}


def config(**overrides: Any) -> SimConfig:
    settings: dict[str, Any] = {
        "engine": "llamacpp",
        "slots": 2,
        "speed": 50.0,
        "profile": "tiny-cpu",
        "context_length": 8192,
        "served_model_name": "tiny-llama",
        **overrides,
    }
    return SimConfig(**settings)


@pytest.fixture
async def llama() -> AsyncIterator[SimulatedFleet]:
    async with await SimulatedFleet.start(1, config()) as fleet:
        yield fleet


def engine_of(fleet: SimulatedFleet, i: int = 0) -> SlotWorkerModel:
    engine = fleet.workers[i].engine
    assert isinstance(engine, SlotWorkerModel)
    return engine


def events(raw: bytes) -> list[Any]:
    parts = raw.split(b"\n\n")
    assert parts[-1] == b"" and parts[-2] == b"data: [DONE]"
    return [orjson.loads(p.removeprefix(b"data: ")) for p in parts[:-2]]


async def metrics(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with client.get(url + "/metrics") as resp:
        assert resp.status == 200 and resp.headers["Server"] == "llama.cpp"
        text = await resp.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split(" ")
            samples[name] = float(value)
    return samples


async def test_info_endpoints_have_llamacpp_shapes(
    llama: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = llama.urls[0]
    async with client.get(url + "/health") as resp:
        assert resp.status == 200 and resp.headers["Server"] == "llama.cpp"
        assert await resp.json() == {"status": "ok"}
    async with client.get(url + "/props") as resp:
        props = await resp.json()
    assert props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == 4096
    assert (props["model_alias"], props["build_info"]) == ("tiny-llama", "b0-unknown")
    async with client.get(url + "/v1/models") as resp:
        models = await resp.json()
    assert models["data"][0]["owned_by"] == "llamacpp"
    assert models["data"][0]["meta"]["n_ctx"] == 4096
    async with client.get(url + "/slots") as resp:
        assert await resp.json() == [
            {"id": i, "n_ctx": 4096, "speculative": False, "is_processing": False} for i in range(2)
        ]
    for path in ("/server_info", "/v1/loads", "/get_load"):
        async with client.get(url + path) as resp:
            assert resp.status == 404 and resp.headers["Server"] == "llama.cpp"
            assert (await resp.json())["error"]["type"] == "not_found_error"
    async with client.post(url + "/abort_request", json={"rid": "x"}) as resp:
        assert resp.status == 404
    async with client.post(url + "/tokenize", json={"content": "hello world"}) as resp:
        assert len((await resp.json())["tokens"]) > 0
    samples = await metrics(client, url)
    for name in ("prompt_tokens_total", "prompt_tokens_cached_total", "tokens_predicted_total"):
        assert samples[f"llamacpp:{name}"] == 0
    assert samples["llamacpp:requests_processing"] == samples["llamacpp:requests_deferred"] == 0


async def test_chat_plain_repeat_is_cached_with_usage_timings_and_counters(
    llama: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = llama.urls[0] + "/v1/chat/completions"
    answers = []
    for _ in range(2):
        async with client.post(url, json=chat("same question")) as resp:
            assert resp.status == 200 and resp.headers["Server"] == "llama.cpp"
            answers.append(await resp.json())
    cold, warm = answers
    prompt = cold["usage"]["prompt_tokens"]
    assert cold["model"] == "tiny-llama" and cold["object"] == "chat.completion"
    assert cold["choices"][0]["message"]["role"] == "assistant"
    assert cold["usage"]["completion_tokens"] == 4
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt - 1}
    timings = warm["timings"]
    assert (timings["cache_n"], timings["prompt_n"], timings["predicted_n"]) == (prompt - 1, 1, 4)
    assert timings["prompt_ms"] < cold["timings"]["prompt_ms"]
    samples = await metrics(client, llama.urls[0])
    assert samples["llamacpp:prompt_tokens_total"] == prompt + 1
    assert samples["llamacpp:prompt_tokens_cached_total"] == prompt - 1
    assert samples["llamacpp:tokens_predicted_total"] == 8


async def test_chat_stream_shapes_and_usage_chunk(
    llama: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = llama.urls[0] + "/v1/chat/completions"
    body = chat("q", stream=True)
    async with client.post(url, json=body) as resp:
        assert resp.status == 200 and resp.headers["Server"] == "llama.cpp"
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        evs = events(await resp.read())
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(e["object"] == "chat.completion.chunk" for e in evs)
    contents = [e["choices"][0]["delta"].get("content") for e in evs[1:-1]]
    assert len(contents) == 4 and all(contents)
    last = evs[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["delta"] == {} and last["timings"]["cache_n"] == 0
    assert "usage" not in last  # without include_usage
    body = chat("q", stream=True, stream_options={"include_usage": True})
    async with client.post(url, json=body) as resp:
        evs = events(await resp.read())
    usage_chunk = evs[-1]
    assert usage_chunk["choices"] == []
    prompt = usage_chunk["usage"]["prompt_tokens"]
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert usage_chunk["timings"]["cache_n"] == prompt - 1
    assert evs[-2]["timings"]["cache_n"] == prompt - 1  # the finish chunk


async def test_openai_text_completions_plain_and_streamed(
    llama: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = llama.urls[0] + "/v1/completions"
    body = {"model": "m", "prompt": SYSTEM, "max_tokens": 3}
    async with client.post(url, json=body) as resp:
        assert resp.status == 200 and resp.headers["Server"] == "llama.cpp"
        plain = await resp.json()
    assert plain["object"] == "text_completion" and plain["choices"][0]["text"]
    assert plain["choices"][0]["finish_reason"] == "length"
    prompt = plain["usage"]["prompt_tokens"]
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.post(url, json=stream) as resp:
        evs = events(await resp.read())
    assert all(e["object"] == "text_completion" for e in evs)
    texts = [e["choices"][0]["text"] for e in evs[:-2]]
    assert len(texts) == 3 and all(texts)
    assert evs[-2]["choices"][0]["finish_reason"] == "length"
    assert evs[-1]["choices"] == []  # the usage chunk: the repeat is cached
    assert evs[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert evs[-1]["timings"]["cache_n"] == prompt - 1


async def test_seed_changes_the_text(client: aiohttp.ClientSession) -> None:
    texts = []
    for seed in (1, 2):
        async with await SimulatedFleet.start(1, config(seed=seed)) as fleet:
            body = chat("q", max_tokens=8)
            async with client.post(fleet.urls[0] + "/v1/chat/completions", json=body) as resp:
                texts.append((await resp.json())["choices"][0]["message"]["content"])
    assert texts[0] != texts[1]


async def test_prompt_longer_than_a_slot_is_a_400(client: aiohttp.ClientSession) -> None:
    async with await SimulatedFleet.start(1, config(context_length=400)) as fleet:
        url = fleet.urls[0] + "/v1/chat/completions"
        async with client.post(url, json=chat("q")) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == 200 and error["n_prompt_tokens"] > 200
    assert error["message"].startswith(f"request ({error['n_prompt_tokens']} tokens) exceeds")


async def test_third_request_is_deferred_and_closing_a_stream_frees_its_slot(
    client: aiohttp.ClientSession,
) -> None:
    async with await SimulatedFleet.start(1, config(speed=1.0)) as fleet:
        url = fleet.urls[0]
        engine = engine_of(fleet)
        long = chat("long", stream=True, max_tokens=100_000)
        long["messages"][1]["content"] = "x"
        responses = [await client.post(url + "/v1/chat/completions", json=long) for _ in range(2)]
        for resp in responses:
            assert resp.status == 200
            await resp.content.readany()
        third = asyncio.create_task(client.post(url + "/completion", json={"prompt": "hi"}))
        for _ in range(200):
            if engine.requests_deferred == 1:
                break
            await asyncio.sleep(0.01)
        samples = await metrics(client, url)
        assert samples["llamacpp:requests_processing"] == 2
        assert samples["llamacpp:requests_deferred"] == 1
        async with client.get(url + "/slots?fail_on_no_slot=1") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["message"] == "no slot available"
        responses[0].close()  # the client goes away: llama.cpp frees the slot
        done = await asyncio.wait_for(third, 10.0)
        assert done.status == 200
        answer = await done.json()
        assert answer["stop"] is True and answer["id_slot"] in (0, 1)
        assert "tokens_cached" in answer and answer["timings"]["cache_n"] == 0
        async with client.get(url + "/slots") as resp:
            slots = await resp.json()
        assert sum(s["is_processing"] for s in slots) == 1
        responses[1].close()
        for _ in range(200):
            if engine.requests_processing == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.requests_processing == 0


async def test_gateway_discovers_llamacpp_and_routes_a_repeat_to_the_warm_worker(
    client: aiohttp.ClientSession,
) -> None:
    async with (
        await SimulatedFleet.start(2, config()) as fleet,
        run_gateway(fleet.urls, policy__name="min_ttft") as gw,
    ):
        for _ in range(100):
            async with client.get(gw.url + "/workers") as resp:
                workers = (await resp.json())["workers"]
            if all(w["kind"] is not None and w["max_sequences"] for w in workers):
                break
            await asyncio.sleep(0.05)
        assert [(w["kind"], w["max_sequences"]) for w in workers] == [("llamacpp", 2)] * 2
        cached = []
        for _ in range(2):
            body = chat("the same question", stream=True, stream_options={"include_usage": True})
            async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                usage = events(await resp.read())[-1]["usage"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, usage["prompt_tokens"] - 1]
    served = [engine_of(fleet, i).counters.finished for i in range(2)]
    assert sorted(served) == [0, 2]  # both on one worker: the repeat went to the warm one
