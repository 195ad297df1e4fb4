"""The simulated worker's claims, checked one by one against real SGLang 0.5.23 on the CPU.

Each test sends the same requests to a real server (``sglang_pair[0]``) and to a simulated
worker configured like it (page 16, 8,192 KV tokens, context 32,768, metrics and cache
report on) and compares what a client sees: status, framing, key order and types (the
JSON *skeleton*; texts and token counts differ: the simulator has its own tokenizer and
no weights), and the numbers both must agree on (``cached_tokens``). Differences that are
on purpose are listed where they are allowed (``KNOWN``), each with its reason; anything
else failing here is a difference to fix in ``simulator/``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from sglang_helpers import (
    CAPACITY,
    PAGE,
    call,
    chat_body,
    post_json,
    simulated,
    skeleton,
    sse_events,
    token_ids,
)

from gateway.workers.replies import parse_metrics, parse_server_info, parse_v1_loads
from loadtests.engine.sglang_fleet import SERVED_MODEL_NAME, SGLangFleet
from loadtests.engine.workload import SYLLABLES

pytestmark = pytest.mark.sglang


@pytest.fixture
def real(sglang_pair: SGLangFleet) -> str:
    return sglang_pair.servers[0].url


@pytest.fixture
async def sim() -> AsyncIterator[str]:
    async with simulated() as url:
        yield url


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def both(
    http: aiohttp.ClientSession, real: str, sim: str, method: str, path: str, body: Any = None,
    raw: bytes | None = None,
) -> tuple[tuple[int, str | None, bytes], tuple[int, str | None, bytes]]:  # fmt: skip
    return (
        await call(http, method, real + path, body, raw=raw),
        await call(http, method, sim + path, body, raw=raw),
    )


def chunk_kind(chunk: dict[str, Any]) -> str:
    """role / content / finish / usage, for a chat or completions chunk."""
    choices = chunk["choices"]
    if not choices:
        return "usage"
    choice = choices[0]
    delta = choice.get("delta")
    if delta is not None and "role" in delta:
        return "role"
    return "finish" if choice["finish_reason"] is not None else "content"


# ---------------------------------------------------------------------- streaming bytes
async def test_chat_stream_framing_and_chunks(
    http: aiohttp.ClientSession, real: str, sim: str
) -> None:
    """Chat streaming: role chunk, content chunks without ``usage``, a separate finish
    chunk with an empty delta, the usage chunk (``choices: []``), ``[DONE]``; the same key
    order and types on both."""
    body = chat_body(1, stream=True, stream_options={"include_usage": True})
    (rs, rct, rraw), (ss, sct, sraw) = await both(
        http, real, sim, "POST", "/v1/chat/completions", body
    )
    assert rs == ss == 200
    assert rct == sct == "text/event-stream; charset=utf-8"
    per_server = []
    for raw in (rraw, sraw):
        events = sse_events(raw)[:-1]
        chunks = [orjson.loads(e) for e in events]
        kinds = [chunk_kind(c) for c in chunks]
        assert kinds[0] == "role" and kinds[-2:] == ["finish", "usage"], kinds
        # up to one content chunk per token (a token ending inside a UTF-8 character
        # sends nothing until the character is complete)
        assert set(kinds[1:-2]) <= {"content"} and len(kinds) - 3 <= 4, kinds
        assert all("usage" not in c for c in chunks[:-1])
        assert all(b", " not in e and b'": ' not in e for e in events)  # compact JSON
        finish = chunks[-2]["choices"][0]
        assert finish["delta"] == {"reasoning_content": None}
        assert finish["finish_reason"] == "length"
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens_details"] == {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]
        }
        per_server.append({k: skeleton(c) for k, c in zip(kinds, chunks, strict=True)})
    real_shapes, sim_shapes = per_server
    assert "content" in sim_shapes
    assert {k: v for k, v in sim_shapes.items() if k in real_shapes} == real_shapes


async def test_chat_stream_without_include_usage_has_no_usage_chunk(
    http: aiohttp.ClientSession, real: str, sim: str
) -> None:
    body = chat_body(2, stream=True)
    for status, _, raw in await both(http, real, sim, "POST", "/v1/chat/completions", body):
        assert status == 200
        kinds = [chunk_kind(orjson.loads(e)) for e in sse_events(raw)[:-1]]
        assert kinds[0] == "role" and kinds[-1] == "finish" and "usage" not in kinds


async def test_completions_stream_framing(http: aiohttp.ClientSession, real: str, sim: str) -> None:
    """Completions streaming: ``"usage": null`` on content chunks, ``finish_reason`` on the
    last content chunk, a usage chunk without null fields, ``[DONE]``."""
    body = {
        "model": "m", "prompt": "".join(SYLLABLES[:30]), "max_tokens": 3, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    shapes = []
    for status, ctype, raw in await both(http, real, sim, "POST", "/v1/completions", body):
        assert status == 200 and ctype == "text/event-stream; charset=utf-8"
        chunks = [orjson.loads(e) for e in sse_events(raw)[:-1]]
        contents, usage = chunks[:-1], chunks[-1]
        assert all(c["usage"] is None for c in contents)
        assert [c["choices"][0]["finish_reason"] for c in contents][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in contents[:-1])
        assert usage["choices"] == [] and None not in usage["usage"].values()
        shapes.append((skeleton(contents[0]), skeleton(usage)))
    assert shapes[0] == shapes[1]


# ---------------------------------------------------------------------- plain bodies
SAMPLING = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body(3)),
        ("/v1/completions", {"model": "m", "prompt": "".join(SYLLABLES[40:60]), "max_tokens": 3,
                             "temperature": 0, "ignore_eos": True}),
        ("/generate", {"input_ids": token_ids(3, 20), "sampling_params": SAMPLING}),
        ("/v1/tokenize", {"model": "m", "messages": chat_body(3)["messages"]}),
        ("/v1/tokenize", {"model": "m", "prompt": "".join(SYLLABLES[:10])}),
    ],
)  # fmt: skip
async def test_non_streamed_bodies_have_the_same_skeleton(
    http: aiohttp.ClientSession, real: str, sim: str, path: str, body: dict[str, Any]
) -> None:
    (rs, rct, rraw), (ss, sct, sraw) = await both(http, real, sim, "POST", path, body)
    assert rs == ss == 200 and rct == sct == "application/json"
    assert skeleton(orjson.loads(rraw)) == skeleton(orjson.loads(sraw))


async def test_generate_stream_chunks(http: aiohttp.ClientSession, real: str, sim: str) -> None:
    """``/generate`` streams cumulative bodies; ``weight_versions`` and the request's timings
    only on the last one."""
    body = {"input_ids": token_ids(4, 20), "stream": True, "sampling_params": SAMPLING}
    shapes = []
    for status, _, raw in await both(http, real, sim, "POST", "/generate", body):
        assert status == 200
        chunks = [orjson.loads(e) for e in sse_events(raw)[:-1]]
        assert len(chunks) == 3
        assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3]  # cumulative
        assert "weight_versions" not in chunks[0]["meta_info"]
        shapes.append((skeleton(chunks[0]), skeleton(chunks[-1])))
    assert shapes[0] == shapes[1]


# ---------------------------------------------------------------------- errors
CONTEXT_TOO_LONG = re.compile(
    r"The input \(\d+ tokens\) is longer than the model's context length \(32768 tokens\)\."
)
POOL_TOO_LONG = re.compile(
    r"Input length \(\d+ tokens\) exceeds the maximum allowed length \(8186 tokens\)\. "
    r"Use a shorter input or enable --allow-auto-truncate\."
)
HUGE = "".join(SYLLABLES[i % len(SYLLABLES)] for i in range(40_000))  # > context
LONG = "".join(SYLLABLES[i % len(SYLLABLES)] for i in range(9_000))  # > the KV pool


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "body", "raw", "status", "check"),
    [
        ("POST", "/v1/chat/completions", None, b"{bad json", 400, "Bad Request"),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": "x"}, None, 400, "Bad Request"),
        ("POST", "/v1/chat/completions", chat(HUGE), None, 400, CONTEXT_TOO_LONG),
        ("POST", "/v1/chat/completions", chat(HUGE, stream=True), None, 400, CONTEXT_TOO_LONG),
        ("POST", "/v1/completions", {"model": "m", "prompt": HUGE}, None, 400, CONTEXT_TOO_LONG),
        ("POST", "/v1/chat/completions", chat(LONG), None, 400, POOL_TOO_LONG),
        ("POST", "/v1/completions", {"model": "m", "prompt": LONG, "max_tokens": 2}, None, 400,
         POOL_TOO_LONG),
        ("POST", "/generate", {"text": LONG, "sampling_params": {"max_new_tokens": 2}}, None, 400,
         POOL_TOO_LONG),
        ("GET", "/no/such/path", None, None, 404, "detail"),
        ("GET", "/v1/chat/completions", None, None, 405, "detail"),
        ("GET", "/get_load", None, None, 404, "detail"),
    ],
)  # fmt: skip
async def test_error_statuses_and_bodies(
    http: aiohttp.ClientSession, real: str, sim: str,
    method: str, path: str, body: Any, raw: bytes | None, status: int, check: Any,
) -> None:  # fmt: skip
    """Top-level ``{"object":"error",...}`` on the OpenAI routes (type ``Bad Request`` for
    validation, ``BadRequestError`` for lengths), ``{"error":{"message"}}`` on
    ``/generate``, FastAPI's ``{"detail"}`` for unknown paths and methods."""
    answers = await both(http, real, sim, method, path, body, raw=raw)
    shapes = []
    for got_status, _, data in answers:
        assert got_status == status, data[:300]
        doc = orjson.loads(data)
        if check == "detail":
            assert list(doc) == ["detail"]
        elif isinstance(check, str):
            assert doc["type"] == check and doc["code"] == 400
        elif "object" in doc:
            assert check.fullmatch(doc["message"]) and doc["type"] == "BadRequestError", doc
        else:
            assert check.fullmatch(doc["error"]["message"]), doc
        shapes.append(skeleton(doc))
    assert shapes[0] == shapes[1]
    if check == "detail":
        assert orjson.loads(answers[0][2]) == orjson.loads(answers[1][2])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_prompt_longer_than_the_pool_streams_an_error_event(
    http: aiohttp.ClientSession, real: str, sim: str, path: str
) -> None:
    """The KV-pool bound is the scheduler's: a streamed request gets 200, one error event
    (``json.dumps`` spacing, type ``BAD_REQUEST``) and ``[DONE]``."""
    body = (
        chat(LONG, stream=True)
        if "chat" in path
        else {"model": "m", "prompt": LONG, "stream": True}
    )
    for status, _, raw in await both(http, real, sim, "POST", path, body):
        assert status == 200
        events = sse_events(raw)
        assert len(events) == 2
        error = orjson.loads(events[0])["error"]
        assert events[0].startswith(b'{"error": {"object": "error", "message": ')
        assert error["type"] == "BAD_REQUEST" and error["code"] == 400 and error["param"] is None
        assert POOL_TOO_LONG.fullmatch(error["message"])


async def test_generate_stream_longer_than_the_pool_is_an_abort_chunk(
    http: aiohttp.ClientSession, real: str, sim: str
) -> None:
    body = {"text": LONG, "stream": True, "sampling_params": {"max_new_tokens": 2}}
    reasons = []
    for status, _, raw in await both(http, real, sim, "POST", "/generate", body):
        assert status == 200
        events = sse_events(raw)
        assert len(events) == 2
        reason = orjson.loads(events[0])["meta_info"]["finish_reason"]
        assert POOL_TOO_LONG.fullmatch(reason.pop("message"))
        reasons.append(reason)
    assert (
        reasons[0]
        == reasons[1]
        == {"type": "abort", "status_code": 400, "err_type": "BadRequestError"}
    )


async def test_any_model_name_is_accepted_and_echoed(
    http: aiohttp.ClientSession, real: str, sim: str
) -> None:
    body = chat_body(5, model="no-such-model")
    for status, _, raw in await both(http, real, sim, "POST", "/v1/chat/completions", body):
        assert status == 200 and orjson.loads(raw)["model"] == "no-such-model"


# ---------------------------------------------------------------------- metadata and load
SIM_ONLY_SERVER_INFO = {"sim_profile", "sim_speed"}  # the simulator's own knobs, on purpose
# and, at the top level only, its LoRA counters (loads, implicit reloads, evictions)
SIM_ONLY_TOP_LEVEL = SIM_ONLY_SERVER_INFO | {"sim_lora_counters"}


async def test_server_info_has_what_the_gateway_reads(
    http: aiohttp.ClientSession, real: str, sim: str
) -> None:
    """``page_size``, ``max_total_num_tokens``, ``served_model_name`` and the ``kv_events``
    descriptor (the simulator's is checked in test_sglang_kv_events); every key the
    simulator claims exists on the real server with the same type (the real one has ~550
    keys; the simulator models the ones clients read)."""
    (rs, _, rraw), (ss, _, sraw) = await both(http, real, sim, "GET", "/server_info")
    assert rs == ss == 200
    r, s = orjson.loads(rraw), orjson.loads(sraw)
    for doc in (r, s):
        meta = parse_server_info(doc)
        assert (meta.model, meta.capacity_tokens, meta.page_size) == (
            SERVED_MODEL_NAME,
            CAPACITY,
            PAGE,
        )
        assert doc["status"] == "ready" and doc["version"] == "0.5.23"
        assert doc["max_req_input_len"] == CAPACITY - 1 - 5
        assert isinstance(doc["startup_time"], dict)  # 0.5.23: seconds per phase
    assert r["device"] == "cpu"
    assert set(s) - set(r) == SIM_ONLY_TOP_LEVEL
    for key in set(s) & set(r):
        if r[key] is not None and s[key] is not None and key != "internal_states":
            assert type(r[key]) is type(s[key]), key
    assert set(s["internal_states"][0]) - set(r["internal_states"][0]) == SIM_ONLY_SERVER_INFO
    desc = r["kv_events"]
    assert list(desc) == ["publisher", "endpoint_host", "endpoint_port_base", "topic",
                          "block_size", "dp_size", "replay_endpoint_port_base"]  # fmt: skip
    assert desc["block_size"] == PAGE and desc["endpoint_host"] == "127.0.0.1"


async def test_v1_loads(http: aiohttp.ClientSession, real: str, sim: str) -> None:
    """Same skeleton but for ``accelerator`` (null on a CPU; the simulator plays a GPU) and
    ``decode_moments`` (a list once the real server decoded; the simulator has none)."""
    await post_json(http, real + "/generate", {"input_ids": token_ids(6, 8),
                    "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
    (rs, _, rraw), (ss, _, sraw) = await both(http, real, sim, "GET", "/v1/loads")
    assert rs == ss == 200
    r, s = orjson.loads(rraw), orjson.loads(sraw)
    assert r["accelerator"] is None and isinstance(s["accelerator"], str)
    for doc in (r, s):
        doc.pop("accelerator")
        doc["loads"][0].pop("decode_moments")
        reading = parse_v1_loads(doc)
        assert reading is not None and reading[1] == CAPACITY
    assert skeleton(r) == skeleton(s)


TTFT_BUCKETS = "0.1 0.2 0.4 0.6 0.8 1.0 2.0 4.0 6.0 8.0 10.0 20.0 40.0 60.0 80.0 100.0 200.0 400.0"


def families(text: str) -> dict[str, str]:
    """Metric family → type, from ``# TYPE`` lines."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out[name] = kind
    return out


async def test_metrics_names(http: aiohttp.ClientSession, real: str, sim: str) -> None:
    """The names the gateway and the benchmarks read exist with the same types and labels;
    every family the simulator exposes exists on the real server."""
    for base in (real, sim):
        body = chat_body(7)
        await post_json(http, base + "/v1/chat/completions", body)
        await post_json(http, base + "/v1/chat/completions", body)  # a hit
    texts = []
    for base in (real, sim):
        status, ctype, data = await call(http, "GET", base + "/metrics")
        assert status == 200 and ctype is not None and ctype.startswith("text/plain")
        texts.append(data.decode())
    real_fams, sim_fams = (families(t) for t in texts)
    for name, kind in [
        ("sglang:cached_tokens_total", "counter"),
        ("sglang:cache_hit_rate", "gauge"),
        ("sglang:time_to_first_token_seconds", "histogram"),
        ("sglang:num_running_reqs", "gauge"),
        ("sglang:num_queue_reqs", "gauge"),
        ("sglang:token_usage", "gauge"),
        ("sglang:prompt_tokens_total", "counter"),
        ("sglang:num_requests_total", "counter"),
    ]:
        assert real_fams.get(name) == sim_fams.get(name) == kind, name
    assert set(sim_fams) <= set(real_fams), sorted(set(sim_fams) - set(real_fams))
    for text in texts:
        assert parse_metrics(text) is not None
        cached = [ln for ln in text.splitlines() if ln.startswith("sglang:cached_tokens_total{")]
        assert any('cache_source="total"' in ln or 'cache_source="device"' in ln for ln in cached)
        buckets = [
            ln.split('le="')[1].split('"')[0]
            for ln in text.splitlines()
            if ln.startswith("sglang:time_to_first_token_seconds_bucket{") and "+Inf" not in ln
            and 'is_streaming="false"' in ln
        ]  # fmt: skip
        assert " ".join(buckets) == TTFT_BUCKETS
    labels = [
        re.findall(r"(\w+)=", ln.split("{", 1)[1].split("}")[0])
        for text in texts
        for ln in text.splitlines()
        if ln.startswith("sglang:num_running_reqs{")
    ]
    assert (
        labels[0] == labels[1] == ["engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"]
    )


# ---------------------------------------------------------------------- cached tokens
async def cached_of(http: aiohttp.ClientSession, base: str, ids: list[int]) -> int:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    doc = await post_json(http, base + "/generate", body)
    cached: int = doc["meta_info"]["cached_tokens"]
    return cached


async def test_cached_tokens_are_whole_pages_below_the_prompt_length(
    http: aiohttp.ClientSession, real: str, sim: str
) -> None:
    """``cached_tokens = min(match, P - 1)`` rounded down to a page, the same on both: an
    exact repeat of 40 tokens hits 32, of 32 tokens 16 (never the whole prompt), of 33
    tokens 32; a new 10-token tail after a cached 40-token prefix hits 32."""
    for base in (real, sim):
        got = []
        for seed, n in ((10, 40), (11, 32), (12, 33)):
            ids = token_ids(seed, n)
            got.append((await cached_of(http, base, ids), await cached_of(http, base, ids)))
        shared = token_ids(13, 40)
        await cached_of(http, base, shared)
        got.append((0, await cached_of(http, base, shared + token_ids(14, 10))))
        assert got == [(0, 32), (0, 16), (0, 32), (0, 32)], base


async def test_chat_reports_cached_tokens_in_usage(
    http: aiohttp.ClientSession, real: str, sim: str
) -> None:
    body = chat_body(15, system_tokens=100)
    for base in (real, sim):
        first = (await post_json(http, base + "/v1/chat/completions", body))["usage"]
        second = (await post_json(http, base + "/v1/chat/completions", body))["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        p = second["prompt_tokens"]
        assert second["prompt_tokens_details"] == {"cached_tokens": (p - 1) // PAGE * PAGE}


# ---------------------------------------------------------------------- abort and flush
async def test_abort_request(http: aiohttp.ClientSession, real: str, sim: str) -> None:
    """``/abort_request`` answers 200 with an empty body, known rid or not; the aborted
    stream ends with ``finish_reason: "abort"`` in its own chunk, then usage and [DONE];
    ``/generate`` reports ``{"type":"abort","message":"Aborted","status_code":null,
    "err_type":null}``."""
    for base in (real, sim):
        status, _, data = await call(http, "POST", base + "/abort_request", {"rid": "nobody"})
        assert (status, data) == (200, b"")
        rid = f"abort-{base[-5:]}"
        body = chat_body(16, max_tokens=3000, stream=True, rid=rid,
                         stream_options={"include_usage": True})  # fmt: skip
        async with http.post(base + "/v1/chat/completions", json=body) as resp:
            first = await resp.content.readline()
            assert first.startswith(b"data: ")
            status, _, data = await call(http, "POST", base + "/abort_request", {"rid": rid})
            assert (status, data) == (200, b"")
            rest = await asyncio.wait_for(resp.read(), 30)
        chunks = [orjson.loads(e) for e in sse_events(first + rest)[:-1]]
        assert chunk_kind(chunks[-1]) == "usage" and chunk_kind(chunks[-2]) == "finish"
        assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
        assert chunks[-1]["usage"]["completion_tokens"] < 3000
        gen_rid = rid + "-g"
        body = {"input_ids": token_ids(17, 12), "stream": True, "rid": gen_rid,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}  # fmt: skip
        async with http.post(base + "/generate", json=body) as resp:
            first = await resp.content.readline()
            await call(http, "POST", base + "/abort_request", {"rid": gen_rid})
            rest = await asyncio.wait_for(resp.read(), 30)
        last = orjson.loads(sse_events(first + rest)[-2])
        assert last["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }


async def test_flush_cache(http: aiohttp.ClientSession, real: str, sim: str) -> None:
    """Idle: 200 and SGLang's text, and the next repeat of a cached prompt misses. With a
    request running: 400 ``Flush cache failed.``. (``?timeout=5`` for the idle flush: a
    request that has just answered can still be finishing in the real scheduler, which
    then refuses a flush without a timeout; seen once in CI-like runs.)"""
    for base in (real, sim):
        ids = token_ids(20, 48)
        await cached_of(http, base, ids)
        assert await cached_of(http, base, ids) == 32
        status, _, data = await call(http, "POST", base + "/flush_cache?timeout=5")
        assert status == 200 and data.startswith(b"Cache flushed.\nPlease check backend logs")
        assert await cached_of(http, base, ids) == 0
        body = chat_body(21, max_tokens=3000, stream=True, rid=f"busy-{base[-5:]}")
        async with http.post(base + "/v1/chat/completions", json=body) as resp:
            await resp.content.readline()
            status, _, data = await call(http, "POST", base + "/flush_cache")
            await call(http, "POST", base + "/abort_request", {"rid": body["rid"]})
            await resp.read()
        assert (status, data) == (400, b"Flush cache failed.\n")
