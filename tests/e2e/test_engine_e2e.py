"""What a llama.cpp worker (xllamacpp 2026.10.11549) reports, checked on the real engine.

These are the facts ``docs/REAL_ENGINE.md`` states and the gateway's ``llamacpp`` worker
kind relies on: health, capacity, slots, counters, usage and timings, abort on close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from typing import Any

import aiohttp
import openai
import pytest

from loadtests.engine.client import engine_session, stream_chat
from loadtests.engine.llama_fleet import LlamaFleet
from loadtests.engine.probe import (
    CACHED_TOKENS,
    DEFERRED,
    PROCESSING,
    PROMPT_TOKENS,
    parse_prometheus,
    read_counters,
)
from loadtests.engine.workload import syllable_text

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"


def chat_body(seed: int, tokens: int, **extra: Any) -> dict[str, Any]:
    """A one-message chat request of ``tokens`` fresh syllables (+ the template's few)."""
    content = syllable_text(random.Random(seed), tokens)
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    }
    return {**body, **extra}


async def post_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_health_props_slots_metrics(llama_fleet: LlamaFleet) -> None:
    url = llama_fleet.urls[0]
    async with engine_session() as session:
        assert await get_json(session, url + "/health") == {"status": "ok"}
        props = await get_json(session, url + "/props")
        assert props["total_slots"] == 2
        assert props["eos_token"] == "<|im_end|>"
        assert props["default_generation_settings"]["n_ctx"] == 4096
        slots = await get_json(session, url + "/slots")
        assert [(s["id"], s["n_ctx"]) for s in slots] == [(0, 4096), (1, 4096)]
        assert all(isinstance(s["is_processing"], bool) for s in slots)
        models = await get_json(session, url + "/v1/models")
        assert models["data"][0]["id"] == MODEL
        async with session.get(url + "/metrics") as response:
            samples = parse_prometheus(await response.text())
        assert {PROMPT_TOKENS, CACHED_TOKENS, PROCESSING, DEFERRED} <= samples.keys()
        async with session.get(url + "/server_info") as response:
            assert response.status == 404  # not SGLang: the gateway must not require it


async def test_repeat_is_cached_on_the_same_worker_only(llama_fleet: LlamaFleet) -> None:
    first, other = llama_fleet.urls[0], llama_fleet.urls[1]
    body = chat_body(seed=101, tokens=800)
    async with engine_session() as session:
        before = await read_counters(session, first)
        cold = await post_chat(session, first, body)
        warm = await post_chat(session, first, body)
        elsewhere = await post_chat(session, other, body)
        after = await read_counters(session, first)
    prompt = warm["usage"]["prompt_tokens"]
    assert prompt == cold["usage"]["prompt_tokens"] > 800
    cold_cached = cold["usage"]["prompt_tokens_details"]["cached_tokens"]
    warm_cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cold_cached < 0.1 * prompt
    assert warm_cached > 0.9 * prompt
    assert warm["timings"]["cache_n"] == warm_cached
    assert warm["timings"]["prompt_n"] == prompt - warm_cached  # computed tokens only
    assert elsewhere["usage"]["prompt_tokens_details"]["cached_tokens"] < 0.1 * prompt
    assert after.cached_tokens - before.cached_tokens == cold_cached + warm_cached
    assert after.computed_tokens - before.computed_tokens == 2 * prompt - cold_cached - warm_cached


async def test_a_worker_holds_one_prompt_per_slot(llama_fleet: LlamaFleet) -> None:
    """2 slots, RAM cache off: after prompts A, B, C the least recently used (A) is gone."""
    url = llama_fleet.urls[2]
    a, b, c = (chat_body(seed=200 + i, tokens=400) for i in range(3))
    async with engine_session() as session:
        for body in (a, b, c):
            await post_chat(session, url, body)
        c_again = await post_chat(session, url, c)
        a_again = await post_chat(session, url, a)
    prompt = a_again["usage"]["prompt_tokens"]
    assert c_again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.9 * prompt
    assert a_again["usage"]["prompt_tokens_details"]["cached_tokens"] < 0.1 * prompt


async def test_stream_reports_usage_and_timings(llama_fleet: LlamaFleet) -> None:
    url = llama_fleet.urls[3]
    body = chat_body(seed=301, tokens=600)
    async with engine_session() as session:
        cold = await stream_chat(session, url, body)
        warm = await stream_chat(session, url, body)
    assert cold.ok and warm.ok, (cold.error, warm.error)
    assert warm.prompt_tokens == cold.prompt_tokens > 600
    assert warm.cached_tokens == warm.cache_n
    assert warm.cached_tokens > 0.9 * warm.prompt_tokens
    assert cold.ttft_s is not None and warm.ttft_s is not None
    assert warm.ttft_s < cold.ttft_s


async def test_closing_the_connection_frees_the_slot(llama_fleet: LlamaFleet) -> None:
    """Abort = close the connection: the slot stops decoding (no abort endpoint needed)."""
    url = llama_fleet.urls[1]
    body = chat_body(seed=401, tokens=50, max_tokens=3000, ignore_eos=True, stream=True)
    async with engine_session() as session:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data:"):
                    break  # decoding has started
            busy = await read_counters(session, url)
            response.close()
        for _ in range(50):
            idle = await read_counters(session, url)
            if idle.processing == 0:
                break
            await asyncio.sleep(0.1)
    assert busy.processing == 1
    assert idle.processing == 0


async def raw_exchange(url: str, body: dict[str, Any]) -> tuple[bytes, bool]:
    """One keep-alive HTTP/1.1 POST on a raw socket: (response head, server closed after)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nConnection: keep-alive\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    response_head = await reader.readuntil(b"\r\n\r\n")
    if b"chunked" in response_head:
        await reader.readuntil(b"\r\n0\r\n\r\n")
    else:
        length = int(response_head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    try:
        closed = await asyncio.wait_for(reader.read(1), timeout=1.0) == b""
    except TimeoutError:
        closed = False
    writer.close()
    await writer.wait_closed()
    return response_head, closed


async def test_closing_a_non_streaming_request_does_not_abort_it(llama_fleet: LlamaFleet) -> None:
    """Engine limit: without a stream the server only notices the closed connection when
    it writes the answer, so the generation runs to ``max_tokens``."""
    url = llama_fleet.urls[2]
    body = chat_body(seed=451, tokens=50, max_tokens=600, ignore_eos=True)
    async with engine_session() as session:
        before = await read_counters(session, url)
        request = asyncio.create_task(session.post(url + "/v1/chat/completions", json=body))
        await asyncio.sleep(0.2)
        busy = await read_counters(session, url)
        request.cancel()  # closes the connection
        with contextlib.suppress(asyncio.CancelledError):
            await request
        for _ in range(300):
            after = await read_counters(session, url)
            if after.processing == 0:
                break
            await asyncio.sleep(0.1)
    assert before.processing == 0
    assert busy.processing == 1
    assert after.predicted_tokens - before.predicted_tokens == 600


async def test_server_closes_keep_alive_connection_after_a_stream(llama_fleet: LlamaFleet) -> None:
    """Engine quirk the gateway must handle: after a streamed answer the server closes the
    connection although it said ``Keep-Alive``, so a pooled connection reused at once fails
    (aiohttp: ``Can not write request body``). A plain answer keeps the connection open.
    """
    url = llama_fleet.urls[3]
    head, closed_after_stream = await raw_exchange(
        url, chat_body(seed=351, tokens=20, max_tokens=1, stream=True)
    )
    assert b"Keep-Alive" in head
    _, closed_after_plain = await raw_exchange(url, chat_body(seed=352, tokens=20, max_tokens=1))
    assert closed_after_stream
    assert not closed_after_plain


async def test_openai_client_against_one_worker(llama_fleet: LlamaFleet) -> None:
    client = openai.AsyncOpenAI(base_url=llama_fleet.urls[0] + "/v1", api_key="unused")
    messages = chat_body(seed=501, tokens=300)["messages"]
    try:
        plain = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
    assert plain.choices[0].finish_reason in {"stop", "length"}
    assert plain.usage is not None and plain.usage.prompt_tokens > 300
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert usage.prompt_tokens_details.cached_tokens > 0.9 * usage.prompt_tokens
    assert chunks[0].choices[0].delta.role == "assistant"
