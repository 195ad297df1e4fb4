"""Cache tiers live (issue 20): a gateway in front of a simulated SGLang worker running
HiCache (``--enable-hierarchical-cache``). A prompt pushed off the GPU by another one is
matched again on the worker's host tier: the decision record shows the host part of the
match and the worker's ``cached_tokens_details``; ``gateway_prefix_tokens_total`` counts
them. In approximate mode the index learns the host tier from ``/server_info``; in exact
mode from the KV events' ``medium``, predicting the host part the worker then reports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import GatewayHandle, run_gateway

pytest.importorskip("simulator.fleet")
from simulator.fleet import SimConfig, SimulatedFleet

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*",'
    '"replay_endpoint":"tcp://127.0.0.1:*","topic":"kv"}'
)
A = list(range(1, 2001))  # two 2,000-token prompts; the GPU pool holds one
B = list(range(5001, 7001))


@pytest.fixture
async def hicache_worker() -> AsyncIterator[SimulatedFleet]:
    config = SimConfig(speed=50.0, page_size=16, capacity_tokens=3000,
                       enable_hierarchical_cache=True, kv_events_config=KV_CONFIG)  # fmt: skip
    async with await SimulatedFleet.start(1, config) as fleet:
        yield fleet


async def _until(cond: Callable[[], Awaitable[bool]], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not await cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def _generate(s: aiohttp.ClientSession, gw: GatewayHandle, ids: list[int]) -> Any:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    async with s.post(gw.url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["meta_info"]


async def _last_decision(s: aiohttp.ClientSession, gw: GatewayHandle) -> dict[str, Any]:
    async with s.get(gw.url + "/debug/decisions?limit=1") as resp:
        decision: dict[str, Any] = (await resp.json())["decisions"][0]
        return decision


async def _host_tier_known(gw: GatewayHandle, worker: str) -> bool:
    w = gw.registry.get(worker)
    return w is not None and w.metadata.host_capacity_tokens is not None


async def _a_then_b_then_a(s: aiohttp.ClientSession, gw: GatewayHandle) -> Any:
    await _generate(s, gw, A)
    await asyncio.sleep(0.2)  # exact mode: the stores reach the gateway
    await _generate(s, gw, B)  # the GPU evicts A's tail: the worker keeps it on its host
    await asyncio.sleep(0.2)
    return await _generate(s, gw, A)


async def test_a_host_hit_through_the_gateway_approximate(hicache_worker: SimulatedFleet) -> None:
    worker = worker_id_for(hicache_worker.urls[0])
    overrides: dict[str, Any] = {"policy__name": "min_ttft", "kv_events__enabled": False}
    async with run_gateway(hicache_worker.urls, **overrides) as gw, aiohttp.ClientSession() as s:
        await _until(lambda: _host_tier_known(gw, worker))
        # /server_info: 2 x the 2,992-token pool, less the GPU's blocks it copies
        known = gw.registry.get(worker)
        assert known is not None and known.metadata.host_capacity_tokens == 2992
        meta = await _a_then_b_then_a(s, gw)
        details = meta["cached_tokens_details"]
        assert details["host"] > 0 and details["device"] + details["host"] == 1984
        decision = await _last_decision(s, gw)
        assert "index_mode" not in decision  # no exact mode: the approximate index
        assert 0 < decision["matched_host_tokens"] < decision["matched_tokens"] == 2000
        outcome = decision["outcome"]
        assert outcome["reported_cached_tokens"] == 1984
        assert (outcome["reported_device_tokens"], outcome["reported_host_tokens"]) == (
            details["device"], details["host"],
        )  # fmt: skip
        async with s.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        line = 'gateway_prefix_tokens_total{kind="delivered_host"} '
        assert f"{line}{float(details['host'])}" in text
        assert 'gateway_prefix_tokens_total{kind="captured_host"}' in text


async def test_a_host_hit_through_the_gateway_exact(hicache_worker: SimulatedFleet) -> None:
    worker = worker_id_for(hicache_worker.urls[0])
    overrides: dict[str, Any] = {
        "policy__name": "min_ttft",
        "kv_events__enabled": True,
        "kv_events__discovery_interval_s": 0.1,
        "kv_events__hybrid": False,
    }
    async with run_gateway(hicache_worker.urls, **overrides) as gw, aiohttp.ClientSession() as s:

        async def exact() -> bool:
            async with s.get(gw.url + "/metrics") as resp:
                text = await resp.text()
            return f'gateway_index_mode{{mode="exact",worker="{worker}"}} 1.0' in text

        await _until(exact)
        meta = await _a_then_b_then_a(s, gw)
        details = meta["cached_tokens_details"]
        assert details["host"] > 0
        decision = await _last_decision(s, gw)
        assert decision["index_mode"] == "exact"
        # the events' medium: the predicted split is the one the worker reports
        assert decision["matched_tokens"] == 1984
        assert decision["matched_host_tokens"] == details["host"]
        assert decision["outcome"]["reported_host_tokens"] == details["host"]
