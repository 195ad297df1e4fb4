"""Exact mode through the gateway: modes on /metrics, exact matches in decisions, fallback.

A simulated fleet publishes KV events; the gateway (``kv_events.enabled``: true, and
auto, the default, when a tokenizer is configured) shows
``gateway_index_mode{...,mode="exact"} 1`` for every worker, predicts exactly what the
worker then reports as cached, and when a worker's events stop it turns ``degraded``
while requests keep being served.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import run_gateway
from simulator.fleet import SimConfig, SimulatedFleet, SimulatedWorker

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
)


@pytest.fixture
async def kv_fleet() -> AsyncIterator[SimulatedFleet]:
    config = SimConfig(speed=50.0, page_size=16, kv_events_config=KV_CONFIG)
    async with await SimulatedFleet.start(2, config) as fleet:
        yield fleet


async def _until(cond: Callable[[], Any], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not await cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def _mode_line(worker: str, mode: str) -> str:
    return f'gateway_index_mode{{mode="{mode}",worker="{worker}"}} 1.0'


async def _metrics(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(f"{url}/metrics") as resp:
        return await resp.text()


async def _chat(s: aiohttp.ClientSession, url: str, content: str) -> dict[str, Any]:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
    }
    async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        out: dict[str, Any] = await resp.json()
        return out


async def _last_decision(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/debug/decisions?limit=1") as resp:
        decision: dict[str, Any] = (await resp.json())["decisions"][0]
        return decision


async def test_gateway_exact_mode_end_to_end(kv_fleet: SimulatedFleet) -> None:
    overrides: dict[str, Any] = {
        "policy__name": "cache_aware",
        "kv_events__enabled": True,
        "kv_events__stale_timeout_s": 0.3,
        "kv_events__discovery_interval_s": 0.1,
        "kv_events__hybrid": False,
    }
    ids = [worker_id_for(u) for u in kv_fleet.urls]
    async with run_gateway(kv_fleet.urls, **overrides) as gw, aiohttp.ClientSession() as s:

        async def all_exact() -> bool:
            text = await _metrics(s, gw.url)
            return all(_mode_line(w, "exact") in text for w in ids)

        await _until(all_exact)
        context = " ".join(f"shared{i}" for i in range(400))
        first = await _chat(s, gw.url, context + " first question")
        assert (await _last_decision(s, gw.url))["index_mode"] == "exact"
        await asyncio.sleep(0.2)  # the first request's BlockStored reaches the gateway
        second = await _chat(s, gw.url, context + " second question")
        decision = await _last_decision(s, gw.url)
        reported = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reported > 0 and decision["matched_tokens"] == reported
        assert decision["outcome"]["reported_cached_tokens"] == reported
        assert first["usage"]["prompt_tokens"] > reported
        text = await _metrics(s, gw.url)
        assert "gateway_index_mode_true_predicted_cached_tokens" in text

        # events stop on every worker: each turns degraded after a dispatch, routing goes on
        for worker in kv_fleet.workers:
            assert isinstance(worker, SimulatedWorker)
            assert worker.kv_events is not None
            await worker.kv_events.close()
        for i in range(4):  # new blocks each (a prompt held whole would store nothing)
            await _chat(s, gw.url, " ".join(f"after{i}stop{j}" for j in range(40)))

        async def all_degraded() -> bool:
            text = await _metrics(s, gw.url)
            return all(_mode_line(w, "degraded") in text for w in ids)

        await _until(all_degraded)
        await _chat(s, gw.url, context + " third question")
        assert (await _last_decision(s, gw.url))["index_mode"] == "degraded"
        await kv_fleet.restart_worker(0)  # a new publisher: back to exact
        await _until(lambda: _exact_again(s, gw.url, ids[0]))


async def _exact_again(s: aiohttp.ClientSession, url: str, worker: str) -> bool:
    return _mode_line(worker, "exact") in await _metrics(s, url)


async def test_gateway_with_kv_events_off_is_approximate(kv_fleet: SimulatedFleet) -> None:
    async with (
        run_gateway(kv_fleet.urls, kv_events__enabled=False) as gw,
        aiohttp.ClientSession() as s,
    ):
        text = await _metrics(s, gw.url)
        for url in kv_fleet.urls:
            assert _mode_line(worker_id_for(url), "approximate") in text
