"""Routing capture live (issue 22), behind a gateway in front of simulated workers: a
request whose prefix is held on a worker the policy does not pick captures less than was
available (round_robin, its index kept matched by a cache_aware shadow); cache_aware
captures all of it; delivered is what the simulator reported (cached_tokens); requests
that report nothing, or that no index was consulted for, are counted apart."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import ClientSession

from gateway.routing.decisions import DecisionRecord
from loadtests.harness.inprocess import GatewayHandle, run_gateway

pytest.importorskip("simulator.fleet")
from simulator.fleet import SimulatedFleet

SYSTEM = "You are a meticulous assistant who answers briefly. " * 30


def _chat(question: str, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 4,
        "stream": stream,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


async def _post(client: ClientSession, gw: GatewayHandle, body: dict[str, Any]) -> None:
    async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()


async def _capture(client: ClientSession, gw: GatewayHandle) -> dict[str, Any]:
    async with client.get(gw.url + "/dashboard/data") as resp:
        assert resp.status == 200
        doc: dict[str, Any] = await resp.json()
    capture: dict[str, Any] = doc["routing_capture"]
    return capture


def _records(gw: GatewayHandle, n: int) -> list[DecisionRecord]:
    records = gw.router.decisions.latest(n)[::-1]  # oldest first
    assert len(records) == n and all(r.outcome is not None for r in records)
    return records


async def _ask(
    client: ClientSession, gw: GatewayHandle, n: int, then_stream: bool = False
) -> tuple[list[DecisionRecord], dict[str, Any]]:
    """``n`` questions sharing the system prompt, one at a time (then a stream without
    usage, which reports nothing); their decision records and the routing capture."""
    for i in range(n):
        await _post(client, gw, _chat(f"question {i}?"))
    if then_stream:
        await _post(client, gw, _chat("streamed?", stream=True))
    return _records(gw, n + then_stream), await _capture(client, gw)


def _metric(text: str, sample: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(sample + " ")]
    return float(line.split()[-1])


async def test_a_prefix_held_elsewhere_is_available_but_not_captured(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(
        fleet.urls, policy__name="round_robin", policy__shadows=["cache_aware"]
    ) as gw:
        # round robin over 3 workers: the 4th is back on the first; a stream reports nothing
        records, capture = await _ask(client, gw, 4, then_stream=True)
        async with client.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    first, second = records[0], records[1]
    assert first.available_tokens == 0 == first.matched_tokens  # nothing held yet
    assert second.worker != first.worker
    assert second.available_tokens is not None and second.available_tokens > 0  # on first's
    assert second.matched_tokens < second.available_tokens  # not captured
    back = next(r for r in records[1:4] if r.worker == first.worker)  # the rotation's return
    assert back.matched_tokens == back.available_tokens
    assert back.outcome is not None and back.outcome.reported_cached_tokens  # a real hit
    assert records[4].outcome is not None and records[4].outcome.reported_cached_tokens is None

    reported = [r for r in records if r.outcome and r.outcome.reported_cached_tokens is not None]
    assert capture["available_tokens"] == sum(r.available_tokens or 0 for r in records)
    assert capture["captured_tokens"] == sum(r.matched_tokens for r in records)
    assert capture["captured_tokens"] < capture["available_tokens"]
    assert capture["delivered_tokens"] == sum(
        r.outcome.reported_cached_tokens or 0 for r in reported if r.outcome
    )  # the simulator's cached_tokens
    assert capture["reported_available_tokens"] == sum(r.available_tokens or 0 for r in reported)
    assert (capture["requests"], capture["reported_requests"]) == (5, 4)
    assert (capture["unreported_requests"], capture["unindexed_requests"]) == (1, 0)
    assert capture["captured_over_available"] < 1.0
    kind = 'gateway_prefix_tokens_total{kind="%s"}'
    assert _metric(metrics, kind % "available") == capture["available_tokens"]
    assert _metric(metrics, kind % "captured") == capture["captured_tokens"]
    assert _metric(metrics, kind % "delivered") == capture["delivered_tokens"]
    unreported = 'gateway_prefix_capture_requests_total{available="known",delivered="unreported"}'
    assert _metric(metrics, unreported) == 1


async def test_cache_aware_captures_everything_available(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls, policy__name="cache_aware") as gw:
        records, capture = await _ask(client, gw, 4)
    assert all(r.matched_tokens == r.available_tokens for r in records)
    assert records[-1].matched_tokens > 0
    assert capture["captured_tokens"] == capture["available_tokens"] > 0
    assert capture["captured_over_available"] == 1.0
    delivered = sum((r.outcome.reported_cached_tokens or 0) for r in records if r.outcome)
    assert capture["delivered_tokens"] == delivered > 0
    assert capture["reported_requests"] == 4 and capture["unreported_requests"] == 0


async def test_without_an_index_available_is_unknown_and_counted_apart(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls, policy__name="round_robin") as gw:
        records, capture = await _ask(client, gw, 3)
        async with client.get(gw.url + "/debug/decisions?limit=1") as resp:
            latest = (await resp.json())["decisions"][0]
    assert all(r.available_tokens is None for r in records)
    assert latest["available_tokens"] is None
    assert capture["unindexed_requests"] == 3 and capture["requests"] == 0
    assert capture["captured_over_available"] is None
    assert capture["delivered_over_available"] is None
