"""The gateway's ring of recent dashboard figures (gateway/telemetry/history.py) and its
route (``/dashboard/data?history=1``): bounded, sampled by the app's own task, served
only when asked."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.http.debug import add_telemetry_routes
from gateway.routing.decisions import CandidateScore, DecisionLog, DecisionRecord
from gateway.telemetry.history import FigureRing, ttft_percentiles
from gateway.telemetry.hub import Telemetry
from gateway.telemetry.series import Metrics, WorkerStats
from gateway.telemetry.snapshot import FleetSnapshot, WorkerSnapshot


def send(telemetry: Telemetry, worker: str, n: int, ttft_s: float) -> None:
    for i in range(n):
        rt = telemetry.begin_request(f"{worker}-{i}", "/generate", "m")
        rec = DecisionRecord(
            time=float(i), request_id=f"{worker}-{i}", policy="min_ttft", worker=worker,
            reason="load", candidates=(CandidateScore(worker, 0, 0.1),),
            prompt_tokens=32, matched_tokens=0,
        )  # fmt: skip
        rt.decided(rec)
        rt.finish(200, ttft_s=ttft_s)


def test_percentile_rule_and_window() -> None:
    from prometheus_client import CollectorRegistry

    ws = WorkerStats("w", Metrics(CollectorRegistry()), window=512)
    assert ttft_percentiles(ws, 60.0, now=100.0) == {"p50": None, "p90": None, "p99": None}
    ws.ttft_recent.extend((100.0, float(v)) for v in range(1, 11))  # 1..10 s, at t=100
    ws.ttft_recent.append((10.0, 99.0))  # older than the window: ignored
    assert ttft_percentiles(ws, 60.0, now=101.0) == {"p50": 6.0, "p90": 10.0, "p99": 10.0}
    assert ttft_percentiles(ws, 60.0, now=161.0)["p90"] is None  # all aged out
    assert ttft_percentiles(None, 60.0)["p50"] is None


def test_ring_samples_counts_and_p90_and_is_bounded() -> None:
    telemetry = Telemetry()
    wall = iter(float(t) for t in range(1000, 2000))
    ring = FigureRing(telemetry.worker_stats, 60.0, period_s=1.0, size=3, wall=lambda: next(wall))
    ring.sample()
    assert ring.to_dict() == {"period_s": 1.0, "samples": [{"time": 1000.0, "workers": []}]}
    send(telemetry, "w1", 4, 0.02)
    ring.sample()
    send(telemetry, "w1", 2, 0.02)
    send(telemetry, "w2", 1, 0.5)
    ring.sample()
    ring.sample()
    samples = ring.to_dict()["samples"]
    assert len(ring) == 3 and [s["time"] for s in samples] == [1001.0, 1002.0, 1003.0]
    assert samples[0]["workers"] == [{"worker": "w1", "requests": 4, "ttft_p90": 0.02}]
    assert sorted((w["worker"], w["requests"], w["ttft_p90"]) for w in samples[2]["workers"]) == [
        ("w1", 6, 0.02),
        ("w2", 1, 0.5),
    ]
    telemetry.shutdown()


def test_ring_refuses_a_bad_period() -> None:
    with pytest.raises(ValueError, match="period_s"):
        FigureRing(dict, 60.0, period_s=0.0)


def one_worker() -> FleetSnapshot:
    return FleetSnapshot(workers=[WorkerSnapshot(worker="w1", url="http://127.0.0.1:19001")])


async def test_route_serves_the_ring_sampled_by_the_apps_task() -> None:
    telemetry = Telemetry(snapshot=one_worker)
    app = web.Application()
    add_telemetry_routes(app, telemetry=telemetry, decisions=DecisionLog(8), history_period_s=0.05)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        send(telemetry, "w1", 3, 0.01)
        await asyncio.sleep(0.3)  # several periods: the task samples without any reader
        plain = await (await client.get("/dashboard/data")).json()
        assert "history" not in plain  # the ring goes out only when asked (first poll)
        doc = await (await client.get("/dashboard/data", params={"history": "1"})).json()
        hist = doc["history"]
        assert hist["period_s"] == 0.05
        assert len(hist["samples"]) >= 3
        times = [s["time"] for s in hist["samples"]]
        assert times == sorted(times) and times[-1] <= doc["time"]
        last = hist["samples"][-1]["workers"]
        assert last == [{"worker": "w1", "requests": 3, "ttft_p90": 0.01}]
    # the app stopped: so did its sampling task
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "dashboard-history"]
    telemetry.shutdown()
