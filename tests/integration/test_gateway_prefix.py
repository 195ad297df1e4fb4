"""What the prefix-aware policies rely on: matched tokens at decision time, the worker's
reported cached tokens fed back, capacity read from the worker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import ClientSession

from loadtests.harness.inprocess import run_gateway

pytest.importorskip("simulator.fleet")  # lands with the simulated worker
from simulator.fleet import SimulatedFleet

SYSTEM = "You are a meticulous assistant. " * 40


def _chat(question: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft"])
async def test_repeat_prefix_is_matched_and_reported(
    fleet: SimulatedFleet, client: ClientSession, policy: str
) -> None:
    async with run_gateway(fleet.urls, policy__name=policy) as gw:
        async with client.post(gw.url + "/v1/chat/completions", json=_chat("first?")) as resp:
            assert resp.status == 200
            assert resp.headers["x-gateway-matched-tokens"] == "0"
            first = resp.headers["x-gateway-worker"]
        async with client.post(gw.url + "/v1/chat/completions", json=_chat("second?")) as resp:
            assert resp.status == 200
            matched = int(resp.headers["x-gateway-matched-tokens"])
            assert resp.headers["x-gateway-worker"] == first
        assert matched >= len(SYSTEM) // 8  # most of the shared system prompt
        record = gw.router.decisions.latest(1)[0]
        assert record.matched_tokens == matched
        assert record.candidates and {c.worker for c in record.candidates} == {
            w.id for w in gw.registry
        }
        assert record.outcome is not None
        assert record.outcome.reported_cached_tokens is not None
        assert record.outcome.reported_cached_tokens > 0
        worker = gw.registry.find(first)
        assert worker is not None and worker.metadata.capacity_tokens
        assert worker.metadata.model == fleet.workers[0].model


async def test_engine_load_polled(fleet: SimulatedFleet) -> None:
    async with run_gateway(fleet.urls[:1], load__poll_interval_s=0.05) as gw:
        worker = next(iter(gw.registry))
        for _ in range(100):
            if worker.engine_load is not None:
                break
            await asyncio.sleep(0.02)
        assert worker.engine_load is not None
        view = worker.view(gw.registry.clock())
        assert view.engine_load is not None and view.engine_load.age_s < 5.0


async def test_chars_per_token_is_learnt_from_the_workers_answers(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    """Every answer's usage.prompt_tokens teaches the ratio; /debug/index and /metrics
    show it per model and per worker (gateway.routing.tokens)."""
    async with run_gateway(fleet.urls, policy__name="cache_aware") as gw:
        for i in range(3):
            body = {**_chat(f"question {i}?"), "stream": i % 2 == 1}
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        async with client.get(gw.url + "/debug/index") as resp:
            doc = await resp.json()
        async with client.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    ratio = doc["chars_per_token"]["m"]
    assert ratio != 4.0 and 1.0 < ratio < 8.0  # learnt (the prior is 4.0), and plausible
    learnt = [w["chars_per_token"] for w in doc["workers"] if w["chars_per_token"] != 4.0]
    assert learnt  # the workers that answered
    assert "gateway_worker_chars_per_token{" in metrics
