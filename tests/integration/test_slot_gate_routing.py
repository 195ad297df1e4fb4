"""The slot gate through the gateway, on a simulated llama.cpp worker (slots share no KV):
a sibling sent while the first request still runs waits for its slot and hits there;
with the gate off it runs in the other slot and computes the prefix again."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from loadtests.harness.inprocess import run_gateway
from simulator.fleet import SimConfig, SimulatedFleet

SYSTEM = " ".join(f"shared{i}" for i in range(600))  # the prefix both requests share


def chat(user: str, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": "m", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}


async def discovered(client: aiohttp.ClientSession, url: str) -> None:
    for _ in range(200):
        async with client.get(url + "/workers") as resp:
            workers = (await resp.json())["workers"]
        if workers and all(w["max_sequences"] for w in workers):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"slots never discovered: {workers}")


async def in_flight(client: aiohttp.ClientSession, url: str) -> int:
    async with client.get(url + "/workers") as resp:
        return sum(w["in_flight"] for w in (await resp.json())["workers"])


async def siblings(client: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    """A long request, then its sibling while it runs: the sibling's cached tokens and
    its decision record."""

    async def send(body: dict[str, Any]) -> dict[str, Any]:
        async with client.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return dict(orjson.loads(await resp.read()))

    first = asyncio.create_task(send(chat("first question", max_tokens=40)))
    for _ in range(500):  # dispatched (and recorded) before the second is sent
        if await in_flight(client, url):
            break
        await asyncio.sleep(0.01)
    second = await send(chat("second question", max_tokens=2))
    await first
    async with client.get(url + "/debug/decisions?limit=1") as resp:
        record = (await resp.json())["decisions"][0]
    return second["usage"]["prompt_tokens_details"]["cached_tokens"], record


@pytest.mark.parametrize("wait_s", [5.0, 0.0])
async def test_a_sibling_waits_for_the_warm_slot(
    client: aiohttp.ClientSession, wait_s: float
) -> None:
    config = SimConfig(
        engine="llamacpp", slots=2, profile="tiny-llamacpp", speed=4.0, context_length=16384
    )
    async with (
        await SimulatedFleet.start(1, config) as fleet,
        run_gateway(fleet.urls, policy__name="min_ttft", prefix_index__slot_wait_s=wait_s) as gw,
    ):
        await discovered(client, gw.url)
        cached, record = await siblings(client, gw.url)
    if wait_s > 0:
        assert record["slot_wait_s"] > 0, record  # held until the first finished
        assert cached > 1000, cached  # then run in the first one's slot: the prefix hit
    else:
        assert "slot_wait_s" not in record, record
        assert cached < 100, cached  # the other slot: the prefix computed again
