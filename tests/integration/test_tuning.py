"""Tuning on live traffic (gateway.http.tuning): a policy changed under load, refused
changes, shadows that never route, a stable A/B split, and recent traffic exported as a
trace the offline replay reads."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession

from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import run_gateway, sim_stats
from loadtests.harness.ports import free_port
from loadtests.harness.procs import running, wait_http
from loadtests.workloads.traces import mooncake_trace
from simulator.fleet import SimulatedFleet

# ~3,000 characters each: past one 512-token block of the exported trace
SYSTEMS = [f"You are assistant number {i}; answer briefly and with care. " * 60 for i in range(4)]


def _chat(i: int, system: int | None = None) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"question {i}: what is {i} squared?"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": SYSTEMS[system]})
    return {"model": "m", "max_tokens": 3, "messages": messages}


def _streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


async def _post(client: ClientSession, url: str, body: dict[str, Any], **headers: str) -> int:
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


async def test_a_policy_change_under_load_loses_and_duplicates_no_request(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls, policy__name="cache_aware") as gw:
        before = sum([(await sim_stats(client, u))["requests"] for u in fleet.urls])
        sends = [_post(client, gw.url, _chat(i, i % 4)) for i in range(60)]

        async def flip() -> list[int]:
            codes = []
            for name in ["min_ttft", "round_robin", "cache_aware", "least_load", "min_ttft"]:
                await asyncio.sleep(0.02)
                async with client.put(gw.url + "/admin/policy", json={"name": name}) as resp:
                    codes.append(resp.status)
            return codes

        *statuses, flips = await asyncio.gather(*sends, flip())
        after = sum([(await sim_stats(client, u))["requests"] for u in fleet.urls])
        async with client.get(gw.url + "/admin/policy") as resp:
            doc = await resp.json()
        async with client.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert flips == [200] * 5
    assert statuses == [200] * 60
    assert after - before == 60  # each request reached a worker exactly once
    assert doc["running"]["policy"]["name"] == "min_ttft"
    assert [c["result"] for c in doc["changes"]] == ["applied"] * 5
    assert 'gateway_policy_changes_total{result="applied"} 5.0' in metrics


async def test_a_bad_change_is_refused_and_the_running_policy_stays(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls, policy__name="cache_aware") as gw:
        for body, where in [
            ({"name": "no_such_policy"}, "policy.name"),
            ({"params": {"no_such_param": 1}}, "policy.params"),
            ({"ab_fraction": 2.0}, "policy.ab_fraction"),
            ({"shadows": ["min_ttft:work_weight=-1"]}, "policy.shadows[0]"),
            ({"unknown_key": 1}, "policy.unknown_key"),
        ]:
            async with client.put(gw.url + "/admin/policy", json=body) as resp:
                assert resp.status == 400, body
                error = (await resp.json())["error"]
                assert where in error["message"] and error["type"] == "invalid_request_error"
        async with client.put(gw.url + "/admin/policy", data=b"{not json") as resp:
            assert resp.status == 400
        assert await _post(client, gw.url, _chat(1, 0)) == 200
        async with client.get(gw.url + "/admin/policy") as resp:
            doc = await resp.json()
    assert doc["running"]["policy"]["name"] == "cache_aware"
    assert [c["result"] for c in doc["changes"]] == ["refused"] * 5


async def _routes(gw_url: str, client: ClientSession, router: Any) -> list[str]:
    picks = []
    for i in range(16):
        assert await _post(client, gw_url, _chat(i, i % 3)) == 200
        picks.append(router.decisions.latest(1)[0].worker)
    return picks


async def test_shadows_score_every_request_and_never_change_the_live_pick(
    client: ClientSession,
) -> None:
    """Two runs on fresh, identical fleets, one with three shadows: the same workers."""
    from simulator.fleet import SimConfig

    picks: list[list[str]] = []
    records = []
    for shadows in ([], ["min_ttft", "random", "cache_aware:cache_threshold=0.9"]):
        async with (
            await SimulatedFleet.start(3, SimConfig(speed=50.0)) as fleet,
            run_gateway(fleet.urls, policy__name="cache_aware", policy__shadows=shadows) as gw,
        ):
            ids = {worker_id_for(u): i for i, u in enumerate(fleet.urls)}
            routed = await _routes(gw.url, client, gw.router)
            picks.append([str(ids[w]) for w in routed])
            records = gw.router.decisions.latest(16)
            async with client.get(gw.url + "/metrics") as resp:
                metrics = await resp.text()
    assert picks[0] == picks[1]
    assert all(len(r.shadows) == 3 for r in records)
    assert {s.policy for s in records[0].shadows} == {"min_ttft", "random", "cache_aware"}
    for r in records:
        for s in r.shadows:
            assert s.agrees == (s.worker == r.worker)
            assert s.estimated_ttft_s is not None and s.estimated_ttft_s > 0
    assert 'gateway_shadow_decisions_total{agrees="true",shadow="min_ttft"}' in metrics
    assert 'gateway_shadow_matched_tokens_total{policy="cache_aware",role="routed"}' in metrics
    doc = records[0].to_dict()
    assert len(doc["shadows"]) == 3 and doc["estimated_ttft_s"] is not None


async def test_an_ab_split_is_stable_per_session_and_reports_both_arms(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(
        fleet.urls, policy__name="cache_aware", policy__ab_policy="round_robin",
        policy__ab_fraction=0.5,
    ) as gw:  # fmt: skip
        arms: dict[str, set[str]] = {}
        for rep in range(3):
            for s in range(16):
                body = _streamed(_chat(rep, s % 4))  # streamed: TTFT measured
                assert await _post(client, gw.url, body, **{"x-session-id": f"s{s}"}) == 200
                record = gw.router.decisions.latest(1)[0]
                arms.setdefault(f"s{s}", set()).add(str(record.arm))
                assert record.policy == ("round_robin" if record.arm == "B" else "cache_aware")
        async with client.get(gw.url + "/debug/ab") as resp:
            doc = await resp.json()
    assert all(len(a) == 1 for a in arms.values())  # every session stayed in its arm
    in_b = sum(1 for a in arms.values() if a == {"B"})
    assert 2 <= in_b <= 14  # about half of 16 sessions, by the hash
    assert doc["ab_fraction"] == 0.5 and doc["ab_policy"]["name"] == "round_robin"
    for arm in ("A", "B"):
        figures = doc["arms"][arm]
        assert figures["requests"] == 3 * (in_b if arm == "B" else 16 - in_b)
        assert figures["cached_fraction"]["value"] is not None
        assert figures["ttft_p50_s"]["value"] > 0
    assert set(doc["arms"]["verdict"]) == {"cached_fraction", "ttft_p50_s", "ttft_p99_s"}


async def test_recent_traffic_exports_as_a_trace_the_replay_reads(
    fleet: SimulatedFleet, client: ClientSession, tmp_path: Path
) -> None:
    async with run_gateway(fleet.urls, policy__name="cache_aware") as gw:
        start = time.time()
        sent = []
        for i in range(8):
            assert await _post(client, gw.url, _chat(i, i % 2)) == 200
            sent.append(gw.router.decisions.latest(1)[0])
            await asyncio.sleep(0.05)
        async with client.get(gw.url + "/debug/trace", params={"since": str(start)}) as resp:
            assert resp.status == 200 and resp.content_type == "application/x-ndjson"
            text = await resp.text()
        async with client.get(gw.url + "/debug/trace", params={"since": "soon"}) as resp:
            assert resp.status == 400
    rows = [json.loads(line) for line in text.splitlines()]
    assert len(rows) == 8
    assert "messages" not in text and "squared" not in text  # never the prompt text
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    workload = mooncake_trace(str(path))
    arrivals = [r.arrival_s for r in workload.requests]
    expected = [r.time - sent[0].time for r in sent]
    assert arrivals == pytest.approx(expected, abs=0.002)
    ids = [tuple(r["hash_ids"]) for r in rows]
    # the same system prompt: the same leading block, a different one otherwise
    assert ids[0][0] == ids[2][0] == ids[4][0] and ids[1][0] == ids[3][0]
    assert ids[0][0] != ids[1][0] and ids[0] != ids[2]
    assert all(r["input_length"] > 100 and r["output_length"] >= 1 for r in rows)


@pytest.mark.slow
async def test_sighup_reloads_the_policy_from_the_file(
    fleet: SimulatedFleet, client: ClientSession, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("policy:\n  name: cache_aware\n")
    port = free_port()
    args = [sys.executable, "-m", "gateway", "--config", str(config), "--port", str(port),
            "--log-level", "warning", "--worker-urls", *fleet.urls]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(args, log=tmp_path / "gateway.log") as proc:
        assert await wait_http(url + "/liveness", 20.0)
        config.write_text("policy:\n  name: min_ttft\n  shadows: [round_robin]\n")
        os.kill(proc.pid, signal.SIGHUP)
        doc: dict[str, Any] = {}
        for _ in range(50):
            async with client.get(url + "/admin/policy") as resp:
                doc = await resp.json()
            if doc["running"]["policy"]["name"] == "min_ttft":
                break
            await asyncio.sleep(0.1)
        assert doc["running"]["policy"]["name"] == "min_ttft"
        assert [s["name"] for s in doc["running"]["shadows"]] == ["round_robin"]
        config.write_text("policy:\n  name: no_such_policy\n")
        os.kill(proc.pid, signal.SIGHUP)
        await asyncio.sleep(0.5)
        async with client.get(url + "/admin/policy") as resp:
            doc = await resp.json()
        assert doc["running"]["policy"]["name"] == "min_ttft"  # refused: the running stays
        assert doc["changes"][0]["result"] == "refused"
        assert proc.poll() is None  # a bad reload never stops the gateway


async def test_the_shortlist_follows_the_config_and_a_live_change(client: ClientSession) -> None:
    """A fleet above ``policy.shortlist_above``: cache_aware sees a shortlist and the
    records count the rest; ``PUT /admin/policy`` turning it off applies at once."""
    from simulator.fleet import SimConfig

    async with (
        await SimulatedFleet.start(6, SimConfig(speed=50.0)) as fleet,
        run_gateway(
            fleet.urls,
            policy__name="cache_aware",
            policy__shortlist_above=2,
            policy__shortlist_least_loaded=1,
        ) as gw,
    ):
        assert gw.router.core.shortlist.above == 2
        assert await _post(client, gw.url, _chat(1, 0)) == 200
        record = gw.router.decisions.latest(1)[0]
        assert record.left_out >= 2 and len(record.candidates) + record.left_out == 6
        assert record.to_dict()["candidates_left_out"] == record.left_out
        async with client.put(gw.url + "/admin/policy", json={"shortlist_above": 0}) as resp:
            assert resp.status == 200
        assert gw.router.core.shortlist.above == 0
        assert await _post(client, gw.url, _chat(2, 1)) == 200
        record = gw.router.decisions.latest(1)[0]
        assert record.left_out == 0 and len(record.candidates) == 6
        assert "candidates_left_out" not in record.to_dict()
