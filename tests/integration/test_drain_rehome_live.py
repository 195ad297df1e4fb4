"""Drains that keep conversations warm and workers that join warm, live (issue 20): the
gateway in front of simulated SGLang workers, through its admin API."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import ClientSession

from loadtests.harness.inprocess import run_gateway, sim_stats

pytest.importorskip("simulator.fleet")
from simulator.fleet import SimulatedFleet

Eventually = Callable[..., Awaitable[None]]  # the ``eventually`` fixture (tests/conftest.py)

SYSTEM = {"role": "system", "content": "You are the support assistant of a large shop. " * 12}
WARM: dict[str, Any] = {
    "prewarm__prompt_store_bytes": 1 << 22,
    "prewarm__tokens_per_s": 1e6,  # the test's prompts go at once
    "policy__name": "min_ttft",
    "policy__seed": 7,
}


def _chat(messages: list[dict[str, Any]], max_tokens: int = 8) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "max_tokens": max_tokens}


def _user(conv: int, turn: int) -> dict[str, str]:
    return {"role": "user", "content": f"conversation {conv}, question {turn}: " + "why? " * 60}


async def _ask(client: ClientSession, url: str, messages: list[dict[str, Any]]) -> tuple[str, Any]:
    async with client.post(url + "/v1/chat/completions", json=_chat(messages)) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        return resp.headers["x-gateway-worker"], body


async def test_a_drain_rehomes_and_prewarms_each_conversation_that_lived_there(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    async with run_gateway(fleet.urls, **WARM) as gw:
        history: dict[int, list[dict[str, Any]]] = {}
        where: dict[int, str] = {}
        sent: dict[int, int] = {}  # the second turn's prompt tokens
        for conv in range(6):  # two turns each: every conversation came back once
            messages = [SYSTEM, _user(conv, 1)]
            _, body = await _ask(client, gw.url, messages)
            messages += [body["choices"][0]["message"], _user(conv, 2)]
            where[conv], body = await _ask(client, gw.url, messages)
            sent[conv] = body["usage"]["prompt_tokens"]
            history[conv] = [*messages, body["choices"][0]["message"], _user(conv, 3)]
        drained_url = max(set(where.values()), key=list(where.values()).count)
        lived = [c for c, url in where.items() if url == drained_url]
        drained = gw.registry.find(drained_url)
        assert drained is not None
        async with client.post(f"{gw.url}/workers/{drained.id}/drain") as resp:
            assert resp.status == 202
            answer = await resp.json()
        assert "draining" in answer["flags"]
        report = answer["drain"]
        assert report["chains_rehomed"] == len(lived) and not report["left"]
        assert drained.id not in report["homes"]

        async def prewarmed() -> bool:
            async with client.get(f"{gw.url}/workers/{drained.id}/drain") as resp:
                job = (await resp.json())["prewarm"]
                return bool(job["done"]) and job["completed"] == len(lived)

        await eventually(prewarmed, 10.0, "the drain's pre-warms complete")
        for url in set(fleet.urls) - {drained_url}:  # what a pre-warm sends
            last = (await sim_stats(client, url))["last_request_body"]
            if last is not None and last.get("max_tokens") == 1:
                assert last["stream"] is False and "rid" not in last
        for conv in lived:  # the next turn goes to the new home, its history cached there
            url, body = await _ask(client, gw.url, history[conv])
            assert url != drained_url
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= sent[conv] - 1, (cached, sent[conv])  # all the turn before
        async with client.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        assert f'gateway_drain_chains_total{{outcome="rehomed"}} {float(len(lived))}' in text
        assert 'gateway_prewarm_requests_total{outcome="completed",reason="drain"}' in text
        async with client.delete(f"{gw.url}/workers/{drained.id}") as resp:
            assert resp.status == 200
        async with client.get(f"{gw.url}/workers/{drained.id}/drain") as resp:
            assert resp.status == 200 and (await resp.json())["left"] is True


async def test_a_drain_without_a_prompt_store_rehomes_only_and_options_are_checked(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls, policy__name="min_ttft") as gw:
        for conv in range(3):
            messages = [SYSTEM, _user(conv, 1)]
            _, body = await _ask(client, gw.url, messages)
            await _ask(client, gw.url, [*messages, body["choices"][0]["message"], _user(conv, 2)])
        wid = gw.registry.find(fleet.urls[0])
        assert wid is not None
        async with client.post(f"{gw.url}/workers/{wid.id}/drain?rehome=maybe") as resp:
            assert resp.status == 400
        async with client.get(f"{gw.url}/workers/{wid.id}/drain") as resp:
            assert resp.status == 404  # no drain yet
        async with client.post(f"{gw.url}/workers/{wid.id}/drain?prewarm=false") as resp:
            report = (await resp.json())["drain"]
        assert report["prewarm"] is None and report["done"] is True
        other = gw.registry.find(fleet.urls[1])
        assert other is not None
        async with client.delete(f"{gw.url}/workers/{other.id}?rehome=true") as resp:
            removed = await resp.json()
        assert removed["removed"] == other.id and removed["drain"]["left"] is True


async def test_a_joining_worker_ramps_and_gets_the_shared_prefix(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    settings: dict[str, Any] = {**WARM, "policy__name": "round_robin",
                                "policy__shadows": ["cache_aware"],
                                "slow_start__window_s": 600.0}  # fmt: skip
    async with run_gateway(fleet.urls[:2], **settings) as gw:
        for conv in range(4):  # round robin: both workers hold the system prompt
            await _ask(client, gw.url, [SYSTEM, _user(conv, 1)])
        async with client.post(gw.url + "/workers", json={"url": fleet.urls[2]}) as resp:
            assert resp.status == 201
            added = await resp.json()

        async def joined() -> dict[str, Any] | None:
            async with client.get(f"{gw.url}/workers/{added['id']}/join") as resp:
                assert resp.status == 200
                report: dict[str, Any] = await resp.json()
                return report if report["prewarm"]["done"] else None

        await eventually(joined, 10.0, "the joining worker's pre-warm completes")
        report = await joined()
        assert report is not None and report["prewarm"]["completed"] == 1
        last = (await sim_stats(client, fleet.urls[2]))["last_request_body"]
        assert last["messages"] == [SYSTEM] and last["max_tokens"] == 1  # the shared prefix
        for conv in range(4, 40):  # it ramps: far fewer than its third of round robin
            await _ask(client, gw.url, [SYSTEM, _user(conv, 1)])
        async with client.get(f"{gw.url}/workers/{added['id']}/join") as resp:
            ramp = (await resp.json())["slow_start"]
        assert 0 < ramp["remaining_s"] <= 600 and ramp["factor"] < 1
        served = (await sim_stats(client, fleet.urls[2]))["requests"]
        assert served < 1 + 36 / 3
        first = gw.registry.find(fleet.urls[0])
        assert first is not None
        async with client.get(f"{gw.url}/workers/{first.id}/join") as resp:
            assert resp.status == 404  # a worker of the start neither ramps nor pre-warms
