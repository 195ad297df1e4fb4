"""The simulated worker's HTTP API against SGLANG_API.md: shapes, streaming bytes, errors."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDictProxy

from simulator.fleet import SimConfig, SimulatedFleet
from simulator.model.tokenizer import IM_END_ID

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedFleet]:
    async with await SimulatedFleet.start(1, SimConfig(speed=50.0)) as fleet:
        yield fleet


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def events(raw: bytes) -> list[bytes]:
    """SSE events, each checked to be ``data: ...`` and terminated by a blank line."""
    assert raw.endswith(b"\n\n")
    parts = raw.split(b"\n\n")[:-1]
    assert all(p.startswith(b"data: ") for p in parts)
    return parts


async def post(
    http: aiohttp.ClientSession, url: str, body: Any
) -> tuple[int, bytes, CIMultiDictProxy[str]]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.read(), resp.headers


# ---------------------------------------------------------------------- chat
async def test_chat_stream_bytes_match_the_reference(
    sim: SimulatedFleet, http: aiohttp.ClientSession
) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "rid": "r-1"}
    status, raw, headers = await post(http, sim.urls[0] + "/v1/chat/completions", body)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    evs = events(raw)
    assert evs[-1] == b"data: [DONE]"
    first = orjson.loads(evs[0][6:])
    created = first["created"]
    # byte templates copied from SGLANG_API.md §2.1
    head = f'data: {{"id":"r-1","object":"chat.completion.chunk","created":{created},"model":"m",'
    assert evs[0].decode() == head + (
        '"choices":[{"index":0,"delta":{"reasoning_content":null,"role":"assistant",'
        '"content":""},"logprobs":null,"finish_reason":null,"matched_stop":null}]}'
    )
    contents = evs[1:-3]
    assert len(contents) == 4  # one chunk per token (stream_interval 1)
    text = ""
    for ev in contents:
        chunk = orjson.loads(ev[6:])
        delta = chunk["choices"][0]["delta"]["content"]
        text += delta
        assert ev.decode() == head + (
            '"choices":[{"index":0,"delta":{"reasoning_content":null,"content":'
            + orjson.dumps(delta).decode()
            + '},"logprobs":null,"finish_reason":null,"matched_stop":null}]}'
        )
        assert "usage" not in chunk
    assert evs[-3].decode() == head + (
        '"choices":[{"index":0,"delta":{"reasoning_content":null},"logprobs":null,'
        '"finish_reason":"length","matched_stop":null}]}'
    )
    usage = orjson.loads(evs[-2][6:])
    prompt_tokens = usage["usage"]["prompt_tokens"]
    assert evs[-2].decode() == head + (
        '"choices":[],"usage":{"prompt_tokens":'
        f'{prompt_tokens},"total_tokens":{prompt_tokens + 4},"completion_tokens":4,'
        '"prompt_tokens_details":{"cached_tokens":0},"reasoning_tokens":0,'
        '"completion_tokens_details":null}}'
    )  # with --enable-cache-report a miss reports 0, as the real 0.5.23 server does
    assert text


async def test_chat_stream_without_include_usage_and_natural_stop(
    sim: SimulatedFleet, http: aiohttp.ClientSession
) -> None:
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, raw, _ = await post(http, sim.urls[0] + "/v1/chat/completions", body)
    assert status == 200
    evs = events(raw)
    chunks = [orjson.loads(e[6:]) for e in evs[:-1]]
    assert all(c["choices"] for c in chunks)  # no usage chunk
    last = chunks[-1]["choices"][0]
    # no max_tokens: the model stops on its own (EOS = <|im_end|>)
    assert last["finish_reason"] == "stop" and last["matched_stop"] == IM_END_ID
    assert last["delta"] == {"reasoning_content": None}


async def test_chat_non_stream_shape_and_cache_report(http: aiohttp.ClientSession) -> None:
    for report in (True, False):
        config = SimConfig(speed=50.0, enable_cache_report=report)
        async with await SimulatedFleet.start(1, config) as fleet:
            url = fleet.urls[0] + "/v1/chat/completions"
            _, raw1, _ = await post(http, url, CHAT)
            status, raw, _ = await post(http, url, CHAT)
            assert status == 200
            body = orjson.loads(raw)
            assert list(body) == [
                "id", "object", "created", "model", "choices", "usage", "metadata",
            ]  # fmt: skip
            assert len(body["id"]) == 32 and body["object"] == "chat.completion"
            assert body["model"] == "m" and body["metadata"] == {
                "weight_version": "default",
                "weight_versions": [{"version": "default", "start": 0, "end": 4}],
            }
            choice = body["choices"][0]
            assert choice["message"]["role"] == "assistant"
            assert choice["message"]["reasoning_content"] is None
            assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
            usage = body["usage"]
            assert usage["completion_tokens"] == 4
            assert usage["total_tokens"] == usage["prompt_tokens"] + 4
            first_usage = orjson.loads(raw1)["usage"]
            # nothing cached yet: 0 with the cache report (as the real server), else null
            miss = {"cached_tokens": 0} if report else None
            assert first_usage["prompt_tokens_details"] == miss
            if report:
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert cached == usage["prompt_tokens"] - 1
            else:
                assert usage["prompt_tokens_details"] is None


async def test_request_id_and_duplicate_rid(
    sim: SimulatedFleet, http: aiohttp.ClientSession
) -> None:
    url = sim.urls[0] + "/v1/chat/completions"
    _, raw, _ = await post(http, url, {**CHAT, "rid": "my-rid"})
    assert orjson.loads(raw)["id"] == "my-rid"
    long = {**CHAT, "max_tokens": 3000, "stream": True, "rid": "dup"}
    async with http.post(url, json=long) as first:
        await first.content.readline()
        status, raw, _ = await post(http, url, {**CHAT, "rid": "dup"})
        assert status == 400
        assert orjson.loads(raw) == {
            "object": "error",
            "message": "Duplicate request ID detected: dup",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }


async def test_multi_turn_chat_hits_through_the_previous_reply(
    sim: SimulatedFleet, http: aiohttp.ClientSession
) -> None:
    url = sim.urls[0] + "/v1/chat/completions"
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 20},
        {"role": "user", "content": "Tell me about prefix caching."},
    ]
    _, raw, _ = await post(http, url, {"model": "m", "messages": messages, "max_tokens": 30})
    first = orjson.loads(raw)
    reply = first["choices"][0]["message"]["content"]
    turn1_prompt = first["usage"]["prompt_tokens"]
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And then?"},
    ]
    _, raw, _ = await post(http, url, {"model": "m", "messages": messages, "max_tokens": 5})
    second = orjson.loads(raw)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the whole first prompt plus the committed reply (all but its last token) is a hit
    assert cached >= turn1_prompt + 30 - 1


# ---------------------------------------------------------------------- completions
async def test_completions_stream_bytes(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    body = {
        "model": "m",
        "prompt": "Once upon a time",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "rid": "c-1",
    }
    status, raw, _ = await post(http, sim.urls[0] + "/v1/completions", body)
    assert status == 200
    evs = events(raw)
    assert evs[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in evs[:-1]]
    contents, usage = chunks[:-1], chunks[-1]
    assert len(contents) == 3
    for i, chunk in enumerate(contents):
        assert list(chunk) == ["id", "object", "created", "model", "choices", "usage"]
        assert chunk["usage"] is None and chunk["object"] == "text_completion"
        choice = chunk["choices"][0]
        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "matched_stop"]
        assert choice["finish_reason"] == ("length" if i == 2 else None)
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": usage["usage"]["prompt_tokens"],
        "total_tokens": usage["usage"]["prompt_tokens"] + 3,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
        "reasoning_tokens": 0,
    }


async def test_completions_non_stream_default_max_tokens_and_echo(
    sim: SimulatedFleet, http: aiohttp.ClientSession
) -> None:
    url = sim.urls[0] + "/v1/completions"
    _, raw, _ = await post(http, url, {"model": "m", "prompt": "Say something"})
    body = orjson.loads(raw)
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 16
    _, raw, _ = await post(
        http, url, {"model": "m", "prompt": "Echo me", "max_tokens": 2, "echo": True}
    )
    assert orjson.loads(raw)["choices"][0]["text"].startswith("Echo me")
    _, raw, _ = await post(http, url, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
    assert orjson.loads(raw)["usage"]["prompt_tokens"] == 3


# ---------------------------------------------------------------------- /generate
async def test_generate_non_stream_and_stream_cumulative(
    sim: SimulatedFleet, http: aiohttp.ClientSession
) -> None:
    url = sim.urls[0] + "/generate"
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 5}}
    status, raw, _ = await post(http, url, body)
    assert status == 200
    out = orjson.loads(raw)
    assert list(out) == ["text", "output_ids", "meta_info"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5 and len(out["output_ids"]) == 5
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default"
    for key in ("id", "prompt_tokens", "e2e_latency", "cached_tokens_details"):
        assert key in meta
    status, raw, _ = await post(http, url, {**body, "stream": True})
    evs = events(raw)
    assert evs[-1] == b"data: [DONE]"
    outs = [orjson.loads(e[6:]) for e in evs[:-1]]
    texts = [o["text"] for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative
    assert texts[-1] == out["text"]  # deterministic for the same prompt
    assert [o["meta_info"]["finish_reason"] for o in outs[:-1]] == [None] * (len(outs) - 1)
    assert outs[-1]["meta_info"]["cached_tokens"] == meta["prompt_tokens"] - 1
    _, raw, _ = await post(http, url, {"input_ids": [5, 6, 7], "sampling_params": {}})
    assert orjson.loads(raw)["meta_info"]["completion_tokens"] == 128  # SGLang's default


async def test_generate_batch(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    body = {"text": ["a b c", "d e f"], "sampling_params": {"max_new_tokens": 2}}
    status, raw, _ = await post(http, sim.urls[0] + "/generate", body)
    assert status == 200
    outs = orjson.loads(raw)
    assert isinstance(outs, list) and len(outs) == 2


# ---------------------------------------------------------------------- errors
async def test_error_bodies(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    base = sim.urls[0]
    async with http.post(base + "/v1/chat/completions", data=b"{not json") as resp:
        assert resp.status == 400
        body = await resp.json(content_type=None)
        assert set(body) == {"object", "message", "type", "param", "code"}
        assert body["object"] == "error" and body["code"] == 400
        assert body["type"] == "Bad Request" and body["param"] is None
    async with http.post(
        base + "/v1/chat/completions", data=b"{}", headers={"Content-Type": "text/plain"}
    ) as resp:
        assert resp.status == 400
        assert "Only 'application/json' is allowed" in (await resp.json())["message"]
    status, raw, _ = await post(http, base + "/v1/chat/completions", {"model": "m"})
    assert status == 400 and "Field required" in orjson.loads(raw)["message"]
    status, raw, _ = await post(http, base + "/v1/completions", {"model": "m"})
    assert status == 400 and orjson.loads(raw)["object"] == "error"
    status, raw, _ = await post(http, base + "/generate", {"sampling_params": {}})
    assert status == 400 and "input_ids" in orjson.loads(raw)["error"]
    async with http.get(base + "/no/such/path") as resp:
        assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}
    async with http.get(base + "/v1/chat/completions") as resp:
        assert resp.status == 405 and await resp.json() == {"detail": "Method Not Allowed"}
    async with http.get(base + "/v1/models/other") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_context_length_errors(http: aiohttp.ClientSession) -> None:
    async with await SimulatedFleet.start(1, SimConfig(speed=50.0, context_length=64)) as fleet:
        base = fleet.urls[0]
        long_prompt = list(range(1, 100))
        status, raw, _ = await post(
            http, base + "/v1/completions", {"model": "m", "prompt": long_prompt}
        )
        assert status == 400
        message = "The input (99 tokens) is longer than the model's context length (64 tokens)."
        assert orjson.loads(raw) == {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        status, raw, _ = await post(
            http, base + "/v1/completions", {"model": "m", "prompt": [1] * 10, "max_tokens": 60}
        )
        assert status == 400
        assert orjson.loads(raw)["message"].startswith(
            "Requested token count exceeds the model's maximum context length of 64 tokens."
        )
        status, raw, _ = await post(http, base + "/generate", {"input_ids": long_prompt})
        assert status == 400
        assert orjson.loads(raw)["error"]["message"].startswith("The input (99 tokens)")
        status, raw, _ = await post(
            http, base + "/generate", {"input_ids": long_prompt, "stream": True}
        )
        assert status == 200
        evs = events(raw)
        assert orjson.loads(evs[0][6:])["error"]["code"] == 400 and evs[-1] == b"data: [DONE]"
        # chat pre-fetches its first chunk, so a streamed chat error is still a real 400
        chat = {"model": "m", "messages": [{"role": "user", "content": "x " * 100}]}
        status, raw, _ = await post(http, base + "/v1/chat/completions", {**chat, "stream": True})
        assert status == 400 and orjson.loads(raw)["type"] == "BadRequestError"


# ---------------------------------------------------------------------- info, tokenize
async def test_info_routes(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    base = sim.urls[0]
    for path in ("/server_info", "/get_server_info"):
        async with http.get(base + path) as resp:
            info = await resp.json()
        assert info["model_path"] == "sim-model" and info["served_model_name"] == "sim-model"
        assert info["page_size"] == 1 and info["max_total_num_tokens"] == 420_000
        assert info["chunked_prefill_size"] == 8192 and info["max_prefill_tokens"] == 16384
        assert info["schedule_policy"] == "fcfs" and info["dp_size"] == 1
        assert info["status"] == "ready" and info["version"] == "0.5.23"
        assert info["kv_events"] is None and len(info["internal_states"]) == 1
    for path in ("/model_info", "/get_model_info"):
        async with http.get(base + path) as resp:
            assert (await resp.json())["is_generation"] is True
    async with http.get(base + "/v1/models") as resp:
        models = await resp.json()
    card = models["data"][0]
    assert models["object"] == "list" and card["id"] == "sim-model"
    assert card["owned_by"] == "sglang" and card["parent"] is None
    assert card["max_model_len"] == 131072
    for path in ("/health", "/health_generate", "/ping", "/ready"):
        async with http.get(base + path) as resp:
            assert resp.status == 200 and await resp.read() == b""


async def test_tokenize_messages_is_append_only(
    sim: SimulatedFleet, http: aiohttp.ClientSession
) -> None:
    url = sim.urls[0] + "/v1/tokenize"
    turn1 = [{"role": "user", "content": "What is a radix tree?"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "A compressed trie."},
        {"role": "user", "content": "Why?"},
    ]
    _, raw1, _ = await post(http, url, {"messages": turn1})
    _, raw2, _ = await post(http, url, {"messages": turn2})
    t1, t2 = orjson.loads(raw1), orjson.loads(raw2)
    assert t1["count"] == len(t1["tokens"]) and t1["max_model_len"] == 131072
    assert t2["tokens"][: t1["count"]] == t1["tokens"]
    _, raw, _ = await post(http, url, {"prompt": "Hello world"})
    tokens = orjson.loads(raw)["tokens"]
    _, raw, _ = await post(http, sim.urls[0] + "/v1/detokenize", {"tokens": tokens})
    assert orjson.loads(raw)["text"] == "Hello world"


async def test_embeddings(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    status, raw, _ = await post(
        http, sim.urls[0] + "/v1/embeddings", {"model": "m", "input": ["a b", "c d e"]}
    )
    assert status == 200
    body = orjson.loads(raw)
    assert body["object"] == "list" and body["model"] == "sim-model"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


async def test_api_key(http: aiohttp.ClientSession) -> None:
    async with await SimulatedFleet.start(1, SimConfig(speed=50.0, api_key="k")) as fleet:
        base = fleet.urls[0]
        status, raw, _ = await post(http, base + "/v1/chat/completions", CHAT)
        assert status == 401 and orjson.loads(raw) == {"error": "Unauthorized"}
        async with http.post(
            base + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k"}
        ) as resp:
            assert resp.status == 200
        async with http.get(base + "/health") as resp:
            assert resp.status == 200


async def test_many_concurrent_streams(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    url = sim.urls[0] + "/v1/chat/completions"

    async def one(i: int) -> int:
        body = {**CHAT, "max_tokens": 20, "stream": True, "rid": f"c{i}"}
        async with http.post(url, json=body) as resp:
            raw = await resp.read()
        return len(events(raw))

    counts = await asyncio.gather(*(one(i) for i in range(40)))
    assert all(c >= 3 for c in counts)
