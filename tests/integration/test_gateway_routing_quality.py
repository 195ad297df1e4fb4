"""Routing quality through the live gateway, judged by the simulated workers' own reports.

Four simulated workers in-process. The ideal cached fraction of a workload is measured,
not computed: the same requests are sent in the same order straight to one worker with
room for all of them, so every reuse the workload allows is a hit there.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest

from loadtests.harness.inprocess import run_gateway
from simulator.fleet import SimConfig, SimulatedFleet

GROUPS = 8
QUESTIONS_PER_GROUP = 6
SYSTEM_CHARS = 8_000  # ~2,000 tokens at ~4 characters per token


def _words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def shared_prefix_bodies(seed: int = 0) -> list[dict[str, Any]]:
    """GROUPS system prompts of ~2,000 tokens, QUESTIONS_PER_GROUP questions each, shuffled."""
    rng = random.Random(seed)
    bodies = []
    for group in range(GROUPS):
        system = f"group {group}: " + _words(rng, SYSTEM_CHARS)
        for _ in range(QUESTIONS_PER_GROUP):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": _words(rng, 500)},
            ]
            bodies.append({"model": "m", "max_tokens": 4, "messages": messages})
    rng.shuffle(bodies)
    return bodies


@pytest.fixture
async def fleet4() -> AsyncIterator[SimulatedFleet]:
    async with await SimulatedFleet.start(4, SimConfig(speed=20.0)) as fleet:
        yield fleet


async def _flush(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    for url in urls:
        async with session.post(url + "/flush_cache") as resp:
            assert resp.status == 200, await resp.text()


async def _send_all(
    session: aiohttp.ClientSession, url: str, bodies: Sequence[dict[str, Any]], concurrency: int
) -> list[tuple[dict[str, Any], str]]:
    """Send ``bodies`` in order with ``concurrency`` closed-loop clients; keep each reply."""
    results: list[tuple[dict[str, Any], str]] = [({}, "")] * len(bodies)
    queue = iter(enumerate(bodies))

    async def client() -> None:
        for i, body in queue:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                results[i] = (await resp.json(), resp.headers.get("x-gateway-worker", url))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


def _cached_fraction(results: Sequence[tuple[dict[str, Any], str]]) -> float:
    prompt: int = sum(reply["usage"]["prompt_tokens"] for reply, _ in results)
    cached = 0
    for reply, _ in results:
        details = reply["usage"].get("prompt_tokens_details") or {}
        cached += details.get("cached_tokens", 0)
    return cached / prompt


async def _ideal_fraction(
    session: aiohttp.ClientSession, fleet: SimulatedFleet, bodies: Sequence[dict[str, Any]]
) -> float:
    await _flush(session, fleet.urls)
    return _cached_fraction(await _send_all(session, fleet.urls[0], bodies, concurrency=1))


async def _through_gateway(
    session: aiohttp.ClientSession,
    fleet: SimulatedFleet,
    policy: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
) -> list[tuple[dict[str, Any], str]]:
    await _flush(session, fleet.urls)
    async with run_gateway(fleet.urls, policy__name=policy) as gw:
        return await _send_all(session, gw.url, bodies, concurrency)


async def test_shared_prefix_reaches_the_ideal_cached_fraction(fleet4: SimulatedFleet) -> None:
    bodies = shared_prefix_bodies()
    async with aiohttp.ClientSession() as session:
        ideal = await _ideal_fraction(session, fleet4, bodies)
        fractions = {
            policy: _cached_fraction(await _through_gateway(session, fleet4, policy, bodies, 4))
            for policy in ("round_robin", "cache_aware", "min_ttft")
        }
    assert ideal > 0.7, ideal  # 5 of 6 requests per group reuse ~2,000 of ~2,130 tokens
    for policy in ("cache_aware", "min_ttft"):
        assert fractions[policy] >= 0.9 * ideal, (policy, fractions, ideal)
        assert fractions[policy] >= 1.5 * fractions["round_robin"], (policy, fractions)


async def test_conversations_stay_on_their_worker(fleet4: SimulatedFleet) -> None:
    rng = random.Random(3)
    conversations: list[list[dict[str, str]]] = [
        [{"role": "system", "content": f"user {i}: " + _words(rng, 2_000)}] for i in range(6)
    ]
    homes: dict[int, str] = {}
    moved = 0
    async with (
        aiohttp.ClientSession() as session,
        run_gateway(fleet4.urls, policy__name="min_ttft") as gw,
    ):
        for _turn in range(4):
            for i, messages in enumerate(conversations):
                messages.append({"role": "user", "content": _words(rng, 300)})
                body = {"model": "m", "max_tokens": 16, "messages": messages}
                async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    reply = await resp.json()
                    worker = resp.headers["x-gateway-worker"]
                content = reply["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": content})
                moved += int(homes.setdefault(i, worker) != worker)
    later_turns = 3 * len(conversations)
    assert moved <= later_turns // 10, (moved, later_turns)


async def test_one_shared_prefix_does_not_collapse_onto_one_worker() -> None:
    rng = random.Random(5)
    system = _words(rng, SYSTEM_CHARS)
    bodies = [
        {
            "model": "m",
            "max_tokens": 32,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": _words(rng, 400)},
            ],
        }
        for _ in range(64)
    ]
    # Real time (speed 1): queues build as on a real fleet, which is what the load term
    # of min_ttft must see.
    fleet = await SimulatedFleet.start(4, SimConfig(speed=1.0))
    async with fleet, aiohttp.ClientSession() as session:
        results = await _through_gateway(session, fleet, "min_ttft", bodies, concurrency=8)
    share = Counter(worker for _, worker in results)
    assert max(share.values()) <= len(bodies) // 2, share
