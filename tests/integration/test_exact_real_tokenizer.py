"""Exact mode end to end on a real tokenizer and chat template, and ``kv_events: auto``.

The model directory is the one the real-SGLang tests serve (``loadtests.engine.
sglang_model.write_tokenizer``): a byte-level BPE ``tokenizer.json`` trained here with
``tokenizers`` (dense: ~1.2 bytes per token) and a ChatML template with tools in
``tokenizer_config.json``. The simulated workers load it with ``--tokenizer-path``
(through ``transformers``, as SGLang does) and the gateway with ``--tokenizer-path`` (its
own renderer, ``gateway.exact``): two implementations that must agree token for token,
or the gateway's predictions would not equal what the workers report cached.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.config import ConfigError
from gateway.exact.choice import load_cached
from gateway.exact.request import request_tokens
from gateway.workers.registry import worker_id_for
from loadtests.engine.sglang_model import write_tokenizer
from loadtests.harness.chat_templates import TemplatesUnavailable, chat_templates_dir
from loadtests.harness.inprocess import run_gateway
from simulator.fleet import SimConfig, SimulatedFleet

pytest.importorskip("transformers")  # the simulated worker's tokenizer (dev extra)

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "relative path"}},
                "required": ["path"],
            },
        },
    }
]
SYSTEM = "You are a careful coding agent. Préférez les réponses courtes. 日本語も可。 " * 20


# the model's own ChatML template, and real ones that print tools and tool calls with
# tojson (from the registry: loadtests.harness.chat_templates)
TEMPLATES = ("chatml", "Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct")


@pytest.fixture(scope="module", params=TEMPLATES)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-model")
    write_tokenizer(directory)
    if request.param != "chatml":
        try:
            source = chat_templates_dir() / f"{request.param}.jinja"
        except TemplatesUnavailable as exc:
            pytest.skip(f"the registry is unreachable and nothing is cached: {exc}")
        config_path = directory / "tokenizer_config.json"
        config = orjson.loads(config_path.read_bytes())
        config["chat_template"] = source.read_text(encoding="utf-8")
        config_path.write_bytes(orjson.dumps(config))
    return directory


@pytest.fixture
async def real_fleet(model_dir: Path) -> AsyncIterator[SimulatedFleet]:
    config = SimConfig(
        speed=50.0, page_size=16, kv_events_config=KV_CONFIG, tokenizer_path=str(model_dir)
    )
    async with await SimulatedFleet.start(2, config) as fleet:
        yield fleet


async def _until(cond: Callable[[], Any], within_s: float = 8.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not await cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def _workers(s: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with s.get(f"{url}/workers") as resp:
        assert resp.status == 200
        return {w["id"]: w for w in (await resp.json())["workers"]}


# a gateway that routes by prefix, discovers fast, predicts only from events
EXACT: dict[str, Any] = {
    "policy__name": "cache_aware",
    "kv_events__discovery_interval_s": 0.1,
    "kv_events__hybrid": False,
}


async def _all_exact(s: aiohttp.ClientSession, url: str, ids: list[str]) -> None:
    async def all_exact() -> bool:
        workers = await _workers(s, url)
        return all(workers[w].get("index_mode") == "exact" for w in ids)

    await _until(all_exact)


def _agent_step(step: int, agent: int) -> list[dict[str, Any]]:
    """An agent's conversation after ``step`` tool round trips (grows append-only)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Agent {agent}: fix the failing test 🚀"},
    ]
    for i in range(step):
        args = orjson.dumps({"path": f"src/module_{agent}_{i}.py"}).decode()
        messages.append({
            "role": "assistant", "content": "",
            "tool_calls": [{"id": f"call_{i}", "type": "function",
                            "function": {"name": "read_file", "arguments": args}}],
        })  # fmt: skip
        messages.append({
            "role": "tool", "tool_call_id": f"call_{i}",
            "content": f"def f_{i}(x):\n    return x * {i}  # 注释 {i}\n" * 6,
        })  # fmt: skip
    return messages


async def test_exact_mode_on_a_real_tokenizer_predicts_what_workers_report(
    real_fleet: SimulatedFleet, model_dir: Path
) -> None:
    ids = [worker_id_for(u) for u in real_fleet.urls]
    # kv_events.enabled: auto
    overrides: dict[str, Any] = {**EXACT, "kv_events__tokenizer": f"hf:{model_dir}"}
    async with run_gateway(real_fleet.urls, **overrides) as gw, aiohttp.ClientSession() as s:
        await _all_exact(s, gw.url, ids)
        reason = (await _workers(s, gw.url))[ids[0]]["index_mode_reason"]
        assert reason.startswith("following its KV events")

        gateway_tok = load_cached(f"hf:{model_dir}")
        worker_tok = real_fleet.workers[0].tokenizer
        hits = 0
        for step in range(4):
            for agent in range(2):
                messages = _agent_step(step, agent)
                body = {"model": "sim-model", "messages": messages, "tools": TOOLS,
                        "max_tokens": 2}  # fmt: skip
                # the gateway's renderer and the worker's transformers agree token for token
                mine, _ = request_tokens("chat", orjson.dumps(body), gateway_tok)
                assert mine == worker_tok.encode_chat_request(body)
                async with s.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    usage = (await resp.json())["usage"]
                assert mine is not None and usage["prompt_tokens"] == len(mine)
                async with s.get(f"{gw.url}/debug/decisions?limit=1") as resp:
                    decision = (await resp.json())["decisions"][0]
                reported = usage["prompt_tokens_details"]["cached_tokens"]
                assert decision["index_mode"] == "exact"
                assert decision["matched_tokens"] == reported, (step, agent, decision)
                hits += reported > 0
                await asyncio.sleep(0.15)  # its BlockStored reaches the gateway
        assert hits >= 6  # every step after an agent's first reuses its conversation


async def test_auto_mode_says_why_each_worker_is_approximate(
    real_fleet: SimulatedFleet, model_dir: Path
) -> None:
    plain = SimConfig(speed=50.0, tokenizer_path=str(model_dir))  # publishes no events
    llama = SimConfig(engine="llamacpp", speed=50.0, slots=2, context_length=8192)
    async with (
        await SimulatedFleet.start(1, plain) as quiet,
        await SimulatedFleet.start(1, llama) as slots,
        aiohttp.ClientSession() as s,
    ):
        urls = [*real_fleet.urls, *quiet.urls, *slots.urls]
        evented, silent, llamacpp = (worker_id_for(u) for u in urls[1:])
        # no tokenizer configured, none taken from the workers: each worker says why
        async with run_gateway(
            urls, kv_events__tokenizer="", kv_events__tokenizer_from_workers=False
        ) as gw:

            async def reasons_shown() -> bool:
                workers = await _workers(s, gw.url)
                return all(workers[w].get("index_mode_reason") for w in (evented, silent, llamacpp))

            await _until(reasons_shown)
            workers = await _workers(s, gw.url)
            assert "no tokenizer configured" in workers[evented]["index_mode_reason"]
            assert workers[evented]["index_mode"] == "approximate"

        async with run_gateway(
            urls, kv_events__tokenizer=f"hf:{model_dir}", kv_events__discovery_interval_s=0.1
        ) as gw:

            async def discovered() -> bool:
                workers = await _workers(s, gw.url)
                return (
                    workers[evented]["index_mode"] == "exact"
                    and "kv_events" in str(workers[silent]["index_mode_reason"])
                    and "llamacpp" in str(workers[llamacpp]["index_mode_reason"])
                )  # the llama.cpp worker's kind is known after its first probes

            await _until(discovered)
            workers = await _workers(s, gw.url)
            assert workers[silent]["index_mode"] == "approximate"
            assert workers[silent]["index_mode_reason"] == (
                "its /server_info advertises no kv_events"
            )
            assert workers[llamacpp]["index_mode_reason"] == (
                "a llamacpp worker publishes no KV events"
            )

        async with run_gateway(urls, kv_events__enabled=False) as gw:
            workers = await _workers(s, gw.url)
            assert workers[evented]["index_mode"] == "approximate"
            assert "kv_events.enabled: false" in workers[evented]["index_mode_reason"]


async def test_a_tokenizer_that_cannot_load(tmp_path: Path, real_fleet: SimulatedFleet) -> None:
    from gateway.cli import parse_config

    missing = tmp_path / "no-model"
    with pytest.raises(ConfigError, match=r"kv_events.tokenizer.*could not be loaded"):
        parse_config(["--kv-events", "true", "--tokenizer-path", str(missing)])
    # auto: a warning and a reason, never a refusal; the workers stay approximate
    async with (
        run_gateway(real_fleet.urls, kv_events__tokenizer=f"hf:{missing}") as gw,
        aiohttp.ClientSession() as s,
    ):
        wid = worker_id_for(real_fleet.urls[0])

        async def shown() -> bool:
            return bool((await _workers(s, gw.url))[wid].get("index_mode_reason"))

        await _until(shown)
        worker = (await _workers(s, gw.url))[wid]
        assert worker["index_mode"] == "approximate"
        assert "could not be loaded" in worker["index_mode_reason"]


async def test_the_tokenizer_a_worker_names_is_used_when_it_is_local(
    real_fleet: SimulatedFleet, model_dir: Path
) -> None:
    """No tokenizer configured at all: each simulated worker's /server_info names its
    tokenizer directory (``tokenizer_path``), which is local here, so ``auto`` follows
    its events and predicts exactly."""
    ids = [worker_id_for(u) for u in real_fleet.urls]
    overrides: dict[str, Any] = {**EXACT, "kv_events__tokenizer": ""}
    async with run_gateway(real_fleet.urls, **overrides) as gw, aiohttp.ClientSession() as s:
        await _all_exact(s, gw.url, ids)
        for question in ("first", "second"):
            body = {"model": "sim-model", "max_tokens": 2,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"{question} question"}]}  # fmt: skip
            async with s.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                usage = (await resp.json())["usage"]
            async with s.get(f"{gw.url}/debug/decisions?limit=1") as resp:
                decision = (await resp.json())["decisions"][0]
            assert decision["index_mode"] == "exact"
            assert decision["matched_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
            await asyncio.sleep(0.15)
        assert decision["matched_tokens"] > 0  # the second question hit the system prompt
