"""DP-aware routing end to end: a simulated SGLang worker with ``--dp-size 4`` behind the
gateway is four routing targets; the gateway pins each request to the rank it chose
(``routed_dp_rank``), so a conversation's repeats hit its rank's cache; rank-blind
(``dp_aware: false``) leaves the rank to SGLang's round robin."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp import ClientSession

from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import run_gateway, sim_stats
from simulator.fleet import SimConfig, SimulatedFleet


def _chat(topic: int, turn: int) -> dict[str, Any]:
    system = f"You are assistant number {topic}. " * 60
    return {"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"turn {turn}"}],
        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


async def _send(client: ClientSession, url: str, body: dict[str, Any]) -> int:
    """The request's reported cached tokens (streamed, with usage)."""
    async with client.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    usage = [line for line in text.splitlines() if '"usage":{' in line and "prompt_tokens" in line]
    assert usage, text
    doc = orjson.loads(usage[-1].removeprefix("data: "))
    return int((doc["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft"])
async def test_each_rank_is_a_target_and_requests_are_pinned(
    client: ClientSession, policy: str
) -> None:
    async with (
        await SimulatedFleet.start(1, SimConfig(speed=50.0, dp_size=4)) as fleet,
        run_gateway(fleet.urls, policy__name=policy) as gw,
    ):
        wid = worker_id_for(fleet.urls[0])
        ranks = [f"{wid}@dp{r}" for r in range(4)]
        chosen: dict[int, set[str]] = {}
        cached: list[int] = []
        for turn in range(4):
            for topic in range(3):
                cached.append(await _send(client, gw.url, _chat(topic, turn)))
                record = gw.router.decisions.latest(1)[0]
                assert record.worker in ranks
                assert {c.worker for c in record.candidates} == set(ranks)
                chosen.setdefault(topic, set()).add(record.worker)
        async with client.get(gw.url + "/workers") as resp:
            described = (await resp.json())["workers"][0]
        stats = await sim_stats(client, fleet.urls[0])
    # a conversation stays on its rank, and every repeat hits that rank's cache
    assert all(len(targets) == 1 for targets in chosen.values()), chosen
    assert all(c > 0 for c in cached[3:]), cached
    served = {f"{wid}@dp{r['dp_rank']}": r["finished_total"] for r in stats["dp_ranks"]}
    for topic, (target,) in chosen.items():
        assert served[target] >= 4, (topic, served)
    assert described["dp_size"] == 4
    assert [r["id"] for r in described["dp_ranks"]] == ranks


async def test_rank_blind_leaves_the_rank_to_the_worker(client: ClientSession) -> None:
    async with (
        await SimulatedFleet.start(1, SimConfig(speed=50.0, dp_size=4)) as fleet,
        run_gateway(fleet.urls, policy__name="cache_aware", dp_aware=False) as gw,
    ):
        cached = []
        for turn in range(4):
            for topic in range(3):
                cached.append(await _send(client, gw.url, _chat(topic, turn)))
                assert gw.router.decisions.latest(1)[0].worker == worker_id_for(fleet.urls[0])
        stats = await sim_stats(client, fleet.urls[0])
    # SGLang's round robin over 4 ranks, 3 conversations in turn: repeats land elsewhere
    assert sum(1 for c in cached[3:] if c == 0) > 0, cached
    assert all(r["finished_total"] == 3 for r in stats["dp_ranks"]), stats["dp_ranks"]
