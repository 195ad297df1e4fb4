"""The telemetry routes on a small aiohttp app with a fake fleet snapshot."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.http.debug import add_telemetry_routes
from gateway.routing.decisions import CandidateScore, DecisionLog, DecisionRecord
from gateway.telemetry.hub import Telemetry
from gateway.telemetry.snapshot import FleetSnapshot, IndexFigures, WorkerSnapshot

SECRET = "never-log-this-prompt"


def fleet() -> FleetSnapshot:
    return FleetSnapshot(
        workers=[
            WorkerSnapshot(
                worker=w,
                url=f"http://127.0.0.1:1900{i}",
                in_flight=i,
                index_mode=mode,
                index=IndexFigures(
                    blocks=5, approx_bytes=640, predicted_tokens=100, reported_tokens=80
                ),
            )
            for i, (w, mode) in enumerate([("w1", "exact"), ("w2", "degraded")])
        ],
        policy="min_ttft",
    )


@pytest.fixture
async def env() -> AsyncIterator[
    tuple[TestClient[web.Request, web.Application], Telemetry, DecisionLog]
]:
    telemetry = Telemetry(snapshot=fleet)
    log = DecisionLog(capacity=8)
    app = web.Application()
    add_telemetry_routes(app, telemetry=telemetry, decisions=log)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client, telemetry, log
    telemetry.shutdown()


def send(telemetry: Telemetry, log: DecisionLog, n: int) -> None:
    for i in range(n):
        rt = telemetry.begin_request(f"r{i}", "/generate", "m")
        rec = DecisionRecord(
            time=float(i), request_id=f"r{i}", policy="min_ttft", worker="w1",
            reason="prefix_hit", candidates=(CandidateScore("w1", 16, 0.1),),
            prompt_tokens=32, matched_tokens=16,
        )  # fmt: skip
        log.add(rec)
        rt.decided(rec)
        rt.finish(200, reported_cached_tokens=8, ttft_s=0.01 * (i + 1))


Env = tuple[TestClient[web.Request, web.Application], Telemetry, DecisionLog]


async def test_metrics_route(env: Env) -> None:
    client, telemetry, log = env
    send(telemetry, log, 3)
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert 'gateway_requests_total{route="/generate",status="200",worker="w1"} 3.0' in text
    assert 'gateway_prefix_index_blocks{worker="w2"} 5.0' in text


async def test_decisions_newest_first_with_limit(env: Env) -> None:
    client, telemetry, log = env
    send(telemetry, log, 12)
    resp = await client.get("/debug/decisions", params={"limit": "3"})
    doc = await resp.json()
    assert [d["request_id"] for d in doc["decisions"]] == ["r11", "r10", "r9"]
    first = doc["decisions"][0]
    assert first["candidates"] == [{"worker": "w1", "matched_tokens": 16, "score": 0.1}]
    assert first["outcome"]["reported_cached_tokens"] == 8
    all_docs = await (await client.get("/debug/decisions")).json()
    assert len(all_docs["decisions"]) == 8  # ring capacity
    assert SECRET not in await (await client.get("/debug/decisions")).text()


@pytest.mark.parametrize("limit", ["0", "-1", "abc", "100000"])
async def test_decisions_bad_limit(env: Env, limit: str) -> None:
    client, _, _ = env
    resp = await client.get("/debug/decisions", params={"limit": limit})
    assert resp.status == 400
    assert "limit" in (await resp.json())["error"]["message"]


async def test_index_route(env: Env) -> None:
    client, telemetry, log = env
    send(telemetry, log, 2)
    doc = await (await client.get("/debug/index")).json()
    w1 = doc["workers"][0]
    assert (w1["worker"], w1["blocks"], w1["bytes"]) == ("w1", 5, 640)
    assert w1["fidelity"] == 0.8
    assert w1["predicted_hit_rate"] == 0.5
    assert w1["reported_hit_rate"] == 0.25
    assert doc["workers"][1]["predicted_hit_rate"] is None


async def test_dashboard_page_and_data(env: Env) -> None:
    client, telemetry, log = env
    page = await client.get("/dashboard")
    assert page.status == 200
    html = await page.text()
    assert "/dashboard/data" in html
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # no CDN
    send(telemetry, log, 4)
    data = await (await client.get("/dashboard/data")).json()
    assert data["requests_total"] == 4
    assert data["reasons"] == {"prefix_hit": 4}
    w1 = data["workers"][0]
    assert w1["requests"] == 4
    assert w1["ttft_s"]["p50"] == pytest.approx(0.03)
    assert w1["ttft_s"]["p99"] == pytest.approx(0.04)
    assert len(data["decisions"]) == 4
    # what the page's mode badge reads (tests/browser/test_dashboard.py draws it)
    assert [(w["index_mode"], w["fidelity"]) for w in data["workers"]] == [
        ("exact", 0.8),
        ("degraded", 0.8),
    ]
    assert "w.index_mode" in html and 'dataset.field = "mode"' in html
