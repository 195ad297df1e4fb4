"""Exact mode on the real engine: the gateway tokenizes with the model's own tokenizer and
chat template (``kv_events.tokenizer: hf:<model dir>``), follows the real servers' KV
events, and predicts the cached tokens the engine then reports, request by request.

Two real servers publishing with ``"bind": true``; the gateway in front of them routes
with ``min_ttft`` (a prefix-aware policy, so exact matches are asked for). The workload
is agent-like: a long system prompt per agent and a history that grows each turn with the
reply the server gave, sent one request at a time so that every event of a request has
arrived before the next one is routed (the comparison is then exact, not statistical).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from sglang_helpers import PAGE, call, post_json, start_fleet

from gateway.exact.tokenizer import HFTokenizer
from loadtests.engine.sglang_fleet import SERVED_MODEL_NAME, SGLangFleet
from loadtests.engine.sglang_install import SGLangEnv
from loadtests.engine.workload import syllable_text
from loadtests.harness.inprocess import run_gateway

pytestmark = pytest.mark.sglang

AGENTS = 4
TURNS = 4
SYSTEM_TOKENS = 300
EVENT_SETTLE_S = 1.0  # the finish's BlockStored is published when the scheduler idles


@pytest.fixture(scope="module")
def bound_pair(
    sglang_env: SGLangEnv, sglang_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangFleet]:
    log_dir = tmp_path_factory.mktemp("sglang-exact-logs")
    with start_fleet(sglang_env, sglang_model, ["bind", "bind"], log_dir) as fleet:
        yield fleet


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def messages_of(agent: int, turn: int, replies: list[str]) -> list[dict[str, str]]:
    rng = random.Random(f"agent:{agent}")
    out = [{"role": "system", "content": syllable_text(rng, SYSTEM_TOKENS)}]
    for t in range(turn + 1):
        out.append({"role": "user", "content": "step" + syllable_text(rng, 20)})
        if t < turn:
            out.append({"role": "assistant", "content": replies[t]})
    return out


async def test_the_hf_tokenizer_encodes_as_the_server(
    bound_pair: SGLangFleet, sglang_model: Path, http: aiohttp.ClientSession
) -> None:
    """``HFTokenizer`` (tokenizer.json + the chat template rendered by jinja2) gives the
    server's own ids (``/v1/tokenize``), for chat (template, generation prompt) and text."""
    tok = HFTokenizer(str(sglang_model))
    url = bound_pair.servers[0].url + "/v1/tokenize"
    replies = ["".join(random.Random(i).choices(" abc.,!?xyz\n", k=30)) for i in range(2)]
    messages = messages_of(0, 2, replies)
    served = await post_json(http, url, {"model": "m", "messages": messages})
    assert tok.encode_chat(messages, None) == served["tokens"]
    text = "The cache holds " + syllable_text(random.Random(1), 50) + " and 42 más ü\n"
    served = await post_json(http, url, {"model": "m", "prompt": text})
    assert tok.encode(text) == served["tokens"]


async def test_exact_mode_predicts_the_engine_reported_cached_tokens(
    bound_pair: SGLangFleet, sglang_model: Path, http: aiohttp.ClientSession
) -> None:
    """For every request: the decision's ``matched_tokens`` (exact mode) equals the
    ``cached_tokens`` the engine reported for it; the repeats of each agent's history hit
    on the worker that holds it."""
    async with run_gateway(
        bound_pair.urls,
        ready_within_s=15.0,
        policy__name="min_ttft",
        kv_events__enabled=True,
        kv_events__tokenizer=f"hf:{sglang_model}",
    ) as gw:
        await asyncio.sleep(1.0)  # discovery: /server_info, then one SUB per worker
        replies: dict[int, list[str]] = {a: [] for a in range(AGENTS)}
        for turn in range(TURNS):
            for agent in range(AGENTS):
                body: dict[str, Any] = {
                    "model": SERVED_MODEL_NAME,
                    "messages": messages_of(agent, turn, replies[agent]),
                    "max_tokens": 12,
                    "temperature": 0,
                }
                doc = await post_json(http, gw.url + "/v1/chat/completions", body)
                replies[agent].append(doc["choices"][0]["message"]["content"])
                await asyncio.sleep(EVENT_SETTLE_S)
        status, _, data = await call(http, "GET", gw.url + "/debug/decisions?limit=100")
        assert status == 200
    records = orjson.loads(data)["decisions"]
    assert len(records) == AGENTS * TURNS
    pairs = [(r["matched_tokens"], r["outcome"]["reported_cached_tokens"]) for r in records]
    assert all(r["index_mode"] == "exact" for r in records), [r["index_mode"] for r in records]
    assert all(r["outcome"]["status"] == 200 for r in records)
    assert [p for p, _ in pairs] == [c for _, c in pairs], pairs
    assert all(p % PAGE == 0 for p, _ in pairs)
    hits = [c for _, c in pairs if c > 0]
    assert len(hits) >= AGENTS * (TURNS - 1), pairs  # every later turn reuses its history
    assert sum(hits) >= AGENTS * (TURNS - 1) * SYSTEM_TOKENS


async def test_exact_mode_on_an_exact_repeat_of_whole_pages(
    bound_pair: SGLangFleet, sglang_model: Path, http: aiohttp.ClientSession
) -> None:
    """A repeat of a 64-token prompt: the engine reports 48 (the last token is always
    computed, and hits are whole pages), and so does the gateway's exact match."""
    ids = [random.Random(7).randrange(10, 2000) for _ in range(64)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    async with run_gateway(
        bound_pair.urls,
        ready_within_s=15.0,
        policy__name="min_ttft",
        kv_events__enabled=True,
        kv_events__tokenizer=f"hf:{sglang_model}",
    ) as gw:
        await asyncio.sleep(1.0)
        cached = []
        for _ in range(2):
            doc = await post_json(http, gw.url + "/generate", body)
            cached.append(doc["meta_info"]["cached_tokens"])
            await asyncio.sleep(EVENT_SETTLE_S)
        _, _, data = await call(http, "GET", gw.url + "/debug/decisions?limit=2")
    latest = orjson.loads(data)["decisions"][0]
    assert cached == [0, 48]
    assert (latest["index_mode"], latest["matched_tokens"]) == ("exact", 48)
