"""Telemetry through the real gateway (``build_app``, which wires it) in front of
in-process fake workers.

Counts in ``/metrics`` equal the traffic sent; one span per request; decisions served
with candidates; a removed worker's series disappear.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

import gateway.app
from gateway.config import config_from_dict, merge
from gateway.http import app_keys
from gateway.http.handlers import start_site
from gateway.telemetry.hub import _CURRENT, Telemetry
from gateway.telemetry.logs import REQUEST_ID, setup_logging
from loadtests.micro.telemetry import fake_worker_app

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hello " * 40}]}


@pytest.fixture(autouse=True)
def _fresh_request_context() -> Iterator[None]:
    rid = REQUEST_ID.set(None)
    current = _CURRENT.set(None)
    yield
    _CURRENT.reset(current)
    REQUEST_ID.reset(rid)


@dataclass
class Env:
    url: str
    app: web.Application
    telemetry: Telemetry
    spans: InMemorySpanExporter
    traceparents: list[str]
    session: aiohttp.ClientSession


async def _site(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@contextlib.asynccontextmanager
async def gateway_env(
    monkeypatch: pytest.MonkeyPatch,
    failures: list[int] | None = None,
    delay_s: float = 0.0,
    **overrides: object,
) -> AsyncIterator[Env]:
    """The real gateway over 3 fake workers; the first worker fails with ``failures``."""
    spans = InMemorySpanExporter()
    built: list[Telemetry] = []

    def make_telemetry(config: object) -> Telemetry:
        built.append(Telemetry(span_exporter=spans))
        return built[-1]

    monkeypatch.setattr(gateway.app, "make_telemetry", make_telemetry)
    traceparents: list[str] = []
    workers = [
        await _site(fake_worker_app(traceparents, failures if i == 0 else None, delay_s))
        for i in range(3)
    ]
    config = config_from_dict(merge({}, {
        "workers": [url for _, url in workers], "policy.name": "round_robin",
        "policy.seed": 1, "health.endpoint": "/ping", "health.interval_s": 0.1,
        "health.success_threshold": 1, "load.poll_interval_s": 0.1, **overrides,
    }))  # fmt: skip
    app = gateway.app.build_app(config)
    (telemetry,) = built
    assert app[app_keys.TELEMETRY] is telemetry
    runner, port = await start_site(app, "127.0.0.1", 0)
    try:
        for _ in range(200):
            if app[app_keys.REGISTRY].healthy_count() == 3:
                break
            await asyncio.sleep(0.02)
        async with aiohttp.ClientSession() as session:
            yield Env(f"http://127.0.0.1:{port}", app, telemetry, spans, traceparents, session)
    finally:
        await runner.cleanup()
        for worker_runner, _ in workers:
            await worker_runner.cleanup()


@pytest.fixture
async def env(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Env]:
    async with gateway_env(monkeypatch) as e:
        yield e


async def metrics(env: Env) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with env.session.get(env.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def by(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
       **labels: str) -> dict[str, float]:  # fmt: skip
    """worker -> value of ``name`` samples matching ``labels``."""
    out: dict[str, float] = {}
    for (sname, lset), value in samples.items():
        d = dict(lset)
        if sname == name and all(d.get(k) == v for k, v in labels.items()):
            out[d.get("worker", "")] = value
    return out


async def chat(env: Env, stream: bool = False) -> int:
    async with env.session.post(env.url + CHAT, json={**BODY, "stream": stream}) as resp:
        await resp.read()
        return resp.status


async def test_counts_equal_traffic(env: Env) -> None:
    statuses = [await chat(env, stream=i % 2 == 0) for i in range(12)]
    assert statuses == [200] * 12
    async with env.session.post(env.url + CHAT, data=b"{not json") as resp:
        assert resp.status == 400
    m = await metrics(env)
    ok = by(m, "gateway_requests_total", route=CHAT, status="200")
    assert sorted(ok.values()) == [4.0, 4.0, 4.0]  # round robin over 3 workers
    assert by(m, "gateway_requests_total", status="400") == {"none": 1.0}
    assert by(m, "gateway_routing_decisions_total", policy="round_robin") == {"": 12.0}
    assert sorted(by(m, "gateway_worker_reported_cached_tokens_total").values()) == [128.0] * 3
    # TTFT is seen on streamed answers only: 2 of each worker's 4
    assert sorted(by(m, "gateway_time_to_first_token_seconds_count").values()) == [2.0] * 3
    durations = by(m, "gateway_request_duration_seconds_count")
    assert durations.pop("none") == 1.0  # the 400
    assert sorted(durations.values()) == [4.0] * 3
    healthy = by(m, "gateway_worker_healthy")
    assert set(healthy) == set(ok) and set(healthy.values()) == {1.0}
    assert set(by(m, "gateway_worker_in_flight_requests").values()) == {0.0}
    assert by(m, "gateway_worker_health_flag", flag="ejected") == dict.fromkeys(ok, 0.0)


async def test_one_span_per_request(env: Env) -> None:
    for i in range(4):
        assert await chat(env, stream=i == 0) == 200
    spans = env.spans.get_finished_spans()
    assert len(spans) == 4
    assert isinstance(dict(spans[0].attributes or {})["gateway.ttft_s"], float)
    for span in spans:
        attrs = dict(span.attributes or {})
        assert attrs["http.route"] == CHAT
        assert attrs["gateway.policy"] == "round_robin"
        assert attrs["gateway.candidates"] == 3
        assert attrs["gateway.reported_cached_tokens"] == 32
        assert attrs["http.response.status_code"] == 200
        assert attrs["gen_ai.request.model"] == "fake"
        assert attrs["gateway.retries"] == 0


async def test_traceparent_reaches_the_worker(env: Env) -> None:
    assert await chat(env) == 200
    (span,) = env.spans.get_finished_spans()
    ctx = span.get_span_context()
    assert ctx is not None and ctx.trace_flags.sampled
    flags = f"{ctx.trace_flags:02x}"
    assert env.traceparents[-1] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{flags}"


async def test_decisions_and_index_routes(env: Env) -> None:
    for _ in range(5):
        assert await chat(env) == 200
    async with env.session.get(env.url + "/debug/decisions", params={"limit": "3"}) as resp:
        decisions = (await resp.json())["decisions"]
    assert len(decisions) == 3
    assert all(len(d["candidates"]) == 3 for d in decisions)
    assert decisions[0]["outcome"]["status"] == 200
    assert decisions[0]["outcome"]["reported_cached_tokens"] == 32
    assert "hello" not in str(decisions)
    async with env.session.get(env.url + "/debug/index") as resp:
        index = (await resp.json())["workers"]
    assert len(index) == 3 and all("blocks" in w for w in index)
    async with env.session.get(env.url + "/dashboard/data") as resp:
        data = await resp.json()
    assert data["requests_total"] == 5
    assert data["policy"] == "round_robin"


async def test_removed_worker_series_vanish(env: Env) -> None:
    for _ in range(6):
        assert await chat(env) == 200
    registry = env.app[app_keys.REGISTRY]
    gone = next(iter(registry)).id
    async with env.session.delete(env.url + f"/workers/{gone}") as resp:
        assert resp.status in (200, 202, 204)
    m = await metrics(env)
    assert not [k for k in m if dict(k[1]).get("worker") == gone]
    assert len(by(m, "gateway_requests_total", route=CHAT)) == 2


async def test_retries_and_upstream_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    async with gateway_env(monkeypatch, failures=[503, 503]) as env:
        statuses = [await chat(env) for _ in range(6)]
        assert statuses == [200] * 6  # each 503 retried on another worker
        m = await metrics(env)
        first = env.app[app_keys.REGISTRY].find(env.app[app_keys.CONFIG].workers[0])
        assert first is not None
        assert by(m, "gateway_upstream_errors_total", kind="http_5xx") == {first.id: 2.0}
        assert by(m, "gateway_retries_total") == {"": 2.0}
        assert sum(by(m, "gateway_routing_decisions_total").values()) == 8.0
        assert sum(by(m, "gateway_requests_total", status="200").values()) == 6.0
        async with env.session.get(env.url + "/debug/decisions") as resp:
            decisions = (await resp.json())["decisions"]
        outcomes = sorted(d["outcome"]["status"] for d in decisions)
        assert outcomes == [200] * 6 + [503, 503]  # failed attempts keep their own outcome
        spans = env.spans.get_finished_spans()
        assert sorted(_int_attribute(s, "gateway.retries") for s in spans) == [
            0, 0, 0, 0, 1, 1,
        ]  # fmt: skip


def _int_attribute(span: ReadableSpan, key: str) -> int:
    value = dict(span.attributes or {})[key]
    assert isinstance(value, int), (key, value)
    return value


async def test_admission_rejections(monkeypatch: pytest.MonkeyPatch) -> None:
    limits: dict[str, Any] = {"admission.max_concurrent_requests": 1, "admission.queue_size": 0}
    async with gateway_env(monkeypatch, delay_s=0.3, **limits) as env:
        statuses = sorted(await asyncio.gather(*(chat(env) for _ in range(4))))
        assert statuses == [200, 429, 429, 429]
        m = await metrics(env)
        assert by(m, "gateway_admission_rejections_total", reason="queue_full") == {"": 3.0}
        assert by(m, "gateway_requests_total", status="429") == {"none": 3.0}


async def test_client_gone_counts_as_499(monkeypatch: pytest.MonkeyPatch) -> None:
    async with gateway_env(monkeypatch, delay_s=0.5) as env:
        with pytest.raises(asyncio.TimeoutError):
            await env.session.post(
                env.url + CHAT, json=BODY, timeout=aiohttp.ClientTimeout(total=0.1)
            )
        for _ in range(50):
            m = await metrics(env)
            gone = by(m, "gateway_requests_total", status="499")
            if gone:
                break
            await asyncio.sleep(0.05)
        assert sum(gone.values()) == 1.0
        assert "none" not in gone  # it had reached a worker
        (span,) = env.spans.get_finished_spans()
        assert dict(span.attributes or {})["http.response.status_code"] == 499


async def test_error_log_line_carries_request_id(env: Env) -> None:
    buf = io.StringIO()
    level = logging.getLogger().level
    handler = setup_logging("INFO", json=True, stream=buf)
    try:
        headers = {"x-request-id": "rid-log-1", "content-type": "application/json"}
        async with env.session.post(env.url + CHAT, data=b"{oops", headers=headers) as resp:
            assert resp.status == 400
        assert await chat(env) == 200  # a success logs nothing at INFO
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger().setLevel(level)
        handler.close()
    lines = [orjson.loads(x) for x in buf.getvalue().splitlines()]
    mine = [d for d in lines if str(d["logger"]).startswith("gateway")]
    assert len(mine) == 1, mine
    assert mine[0]["request_id"] == "rid-log-1"
    assert "oops" not in buf.getvalue()
