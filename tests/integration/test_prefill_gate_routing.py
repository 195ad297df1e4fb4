"""The prefill gate through the gateway, on simulated SGLang workers (radix cache, fcfs):
eight rollout siblings sent at once go to one worker; the first computes the prompt, the
seven others are held until its first byte and then hit the whole prompt. With the gate
off they reach the worker together and are prefilled in one batch, before anything is
cached. Behind more than a prefill batch queued, siblings are not held: they hit anyway."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from loadtests.harness.inprocess import run_gateway
from simulator.fleet import SimConfig, SimulatedFleet

PROMPT = " ".join(f"step{i}" for i in range(1200))  # one rollout prompt, ~2,600 tokens
N = 8


def rollout(prompt: str = PROMPT) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send(client: aiohttp.ClientSession, url: str, prompt: str = PROMPT) -> tuple[int, int]:
    """One streamed sibling: (prompt tokens, cached tokens) from its usage chunk."""
    async with client.post(url + "/v1/chat/completions", json=rollout(prompt)) as resp:
        assert resp.status == 200, await resp.text()
        usage: dict[str, Any] = {}
        async for line in resp.content:
            data = line.strip().removeprefix(b"data: ")
            if data.startswith(b"{"):
                usage = orjson.loads(data).get("usage") or usage
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def gate_counts(metrics: str) -> dict[str, float]:
    prefix = 'gateway_gate_requests_total{gate="prefill",outcome="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(prefix)
    }


@pytest.mark.parametrize("wait_s", [5.0, 0.0])
async def test_rollout_siblings_wait_for_the_first_prefill_and_hit(
    client: aiohttp.ClientSession, wait_s: float
) -> None:
    async with (
        await SimulatedFleet.start(2, SimConfig(speed=2.0)) as fleet,
        run_gateway(fleet.urls, policy__name="min_ttft", prefix_index__prefill_wait_s=wait_s) as gw,
    ):
        answers = await asyncio.gather(*(send(client, gw.url) for _ in range(N)))
        async with client.get(gw.url + "/metrics") as resp:
            counts = gate_counts(await resp.text())
        records = gw.router.decisions.latest(N)
    prompt = answers[0][0]
    assert prompt > 1000
    hits = sorted(cached for _, cached in answers)
    assert len({r.worker for r in records}) == 1  # the whole group on one worker
    if wait_s > 0:
        assert hits[0] < prompt // 10  # the first: a miss
        assert all(c >= prompt - 64 for c in hits[1:]), hits  # the 7 others: the whole prompt
        assert counts == {"held": N - 1, "released": N - 1, "timed_out": 0}
        assert sum(1 for r in records if r.slot_wait_s) == N - 1
    else:
        assert counts == {"held": 0, "released": 0, "timed_out": 0}
        assert all(r.slot_wait_s is None for r in records)
        assert sum(c >= prompt - 64 for c in hits) < N - 1, hits  # computed together


async def test_siblings_behind_more_than_a_prefill_batch_go_at_once_and_hit(
    client: aiohttp.ClientSession,
) -> None:
    """Eight different prompts (~21,000 tokens, over SGLang's 16,384-token prefill batch)
    queued on one worker, then three siblings of the first: sent at once, they are
    prefilled in a later batch than the first, after it is cached, so they hit without
    being held (held, they would have gone behind everything sent meanwhile)."""
    prompts = [" ".join(f"p{k}w{i}" for i in range(1200)) for k in range(8)]
    async with (
        await SimulatedFleet.start(1, SimConfig(speed=0.25)) as fleet,
        run_gateway(fleet.urls, policy__name="min_ttft", prefix_index__prefill_wait_s=5.0) as gw,
    ):
        first = [asyncio.create_task(send(client, gw.url, p)) for p in prompts]
        (worker,) = gw.registry.targets()
        for _ in range(2000):  # until all eight are dispatched (their prefill takes ~2 s)
            if len(gw.router.decisions.latest(8)) == 8:
                break
            await asyncio.sleep(0.005)
        assert worker.queued_prefill_tokens > 16384
        siblings = await asyncio.gather(*(send(client, gw.url, prompts[0]) for _ in range(3)))
        await asyncio.gather(*first)
        async with client.get(gw.url + "/metrics") as resp:
            counts = gate_counts(await resp.text())
    assert counts["held"] == 0
    assert all(cached >= prompt - 64 for prompt, cached in siblings), siblings
