"""What telemetry costs: per-request CPU of its named methods, and gateway throughput on/off.

Usage::

    python -m loadtests.micro.telemetry micro [--requests 20000] [--repeats 5]
    python -m loadtests.micro.telemetry e2e [--seconds 5] [--concurrency 32] [--rounds 2]

``micro`` times, per request, the calls the gateway makes (``begin_request``,
``decided``, ``upstream_headers``, ``first_byte``, ``finish``) with realistic labels
(8 workers, 2 routes), and the same eight metric updates done with prometheus-client
naively (``labels()`` per call) and with OpenTelemetry's metrics SDK + Prometheus reader:
the figures behind the library choice in docs/TELEMETRY.md. Also the decision record
and ring, and one ``/metrics`` scrape.

``e2e`` runs a trivial fake worker process (4 ports), and three gateway processes built by
``gateway.app.build_app``: without telemetry, with metrics, with metrics and tracing
(every request sampled, spans ended into a dropping exporter). A client in this process
sends non-streaming chat for ``--seconds`` to each in turn; reported: requests/s and the
gateway process's CPU per request (from /proc), the sturdier figure on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from gateway.routing.decisions import CandidateScore, DecisionLog, DecisionRecord
from gateway.telemetry.hub import Telemetry, TelemetryConfig
from gateway.telemetry.series import DURATION_BUCKETS, MATCH_RATIO_BUCKETS, TTFT_BUCKETS
from gateway.telemetry.snapshot import FleetSnapshot, IndexFigures, WorkerSnapshot
from gateway.telemetry.tracing import TracingConfig
from loadtests.harness.procs import cpu_seconds, running

WORKERS = [f"127.0.0.1-1800{i}" for i in range(8)]
ROUTES = ["/v1/chat/completions", "/generate"]
MODES = ("off", "metrics", "metrics+tracing")


class DropExporter(SpanExporter):
    """Accepts spans and keeps nothing: span cost without an exporter's I/O."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _records(n: int) -> list[DecisionRecord]:
    rng = random.Random(1)
    out = []
    for i in range(n):
        worker = WORKERS[i % len(WORKERS)]
        cands = tuple(CandidateScore(w, rng.choice((0, 512)), rng.random()) for w in WORKERS)
        out.append(
            DecisionRecord(
                time=0.0,
                request_id=f"{i:032x}",
                policy="min_ttft",
                worker=worker,
                reason=rng.choice(("prefix_hit", "load", "miss")),
                candidates=cands,
                prompt_tokens=2048,
                matched_tokens=rng.choice((0, 512, 1024)),
                model="m",
            )
        )
    return out


def _fleet() -> FleetSnapshot:
    return FleetSnapshot(
        workers=[
            WorkerSnapshot(
                worker=w,
                url="http://x",
                in_flight=3,
                engine_running=4,
                engine_waiting=1,
                engine_token_usage=0.4,
                index=IndexFigures(1000, 128000, 5000, 4000),
            )
            for w in WORKERS
        ]
    )


# --- micro ------------------------------------------------------------------------------


def _per_request_ours(t: Telemetry, records: list[DecisionRecord]) -> Callable[[], None]:
    def run() -> None:
        for i, rec in enumerate(records):
            rt = t.begin_request(rec.request_id, ROUTES[i & 1], "m")
            rt.decided(rec)
            rt.upstream_headers()
            rt.first_byte()
            rec.outcome = None
            rt.finish(200, reported_cached_tokens=400)

    return run


def _per_request_prom(records: list[DecisionRecord], cached: bool) -> Callable[[], None]:
    """The eight updates with prometheus-client's own metrics (``labels()`` per call, or
    children cached in a dict as telemetry did before ``telemetry_metrics``)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram

    r = CollectorRegistry()
    req = Counter("b_requests", "", ["worker", "route", "status"], registry=r)
    dur = Histogram("b_duration", "", ["worker"], buckets=DURATION_BUCKETS, registry=r)
    ttft = Histogram("b_ttft", "", ["worker"], buckets=TTFT_BUCKETS, registry=r)
    dec = Counter("b_decisions", "", ["policy", "reason"], registry=r)
    ratio = Histogram("b_ratio", "", ["policy"], buckets=MATCH_RATIO_BUCKETS, registry=r)
    toks = [Counter(f"b_tokens{i}", "", ["worker"], registry=r) for i in range(3)]

    cache: dict[tuple[Any, ...], Any] = {}

    def child(metric: Any, *values: str) -> Any:
        key = (metric, *values)
        got = cache.get(key)
        if got is None:
            got = cache[key] = metric.labels(*values)
        return got

    def run_cached() -> None:
        for i, rec in enumerate(records):
            w = rec.worker
            child(dec, rec.policy, rec.reason).inc()
            child(ratio, rec.policy).observe(rec.match_ratio)
            child(req, w, ROUTES[i & 1], "200").inc()
            child(dur, w).observe(0.05)
            child(ttft, w).observe(0.01)
            child(toks[0], w).inc(rec.prompt_tokens)
            child(toks[1], w).inc(rec.matched_tokens)
            child(toks[2], w).inc(400)

    def run() -> None:
        for i, rec in enumerate(records):
            w = rec.worker
            dec.labels(rec.policy, rec.reason).inc()
            ratio.labels(rec.policy).observe(rec.match_ratio)
            req.labels(w, ROUTES[i & 1], "200").inc()
            dur.labels(w).observe(0.05)
            ttft.labels(w).observe(0.01)
            toks[0].labels(w).inc(rec.prompt_tokens)
            toks[1].labels(w).inc(rec.matched_tokens)
            toks[2].labels(w).inc(400)

    return run_cached if cached else run


def _per_request_lockfree(records: list[DecisionRecord]) -> Callable[[], None]:
    """The eight updates with ``gateway.telemetry.metrics`` (what telemetry uses)."""
    from gateway.telemetry.metrics import CounterVec, HistogramVec

    req = CounterVec("l_requests", "", ["worker", "route", "status"])
    dur = HistogramVec("l_duration", "", ["worker"], DURATION_BUCKETS)
    ttft = HistogramVec("l_ttft", "", ["worker"], TTFT_BUCKETS)
    dec = CounterVec("l_decisions", "", ["policy", "reason"])
    ratio = HistogramVec("l_ratio", "", ["policy"], MATCH_RATIO_BUCKETS)
    toks = [CounterVec(f"l_tokens{i}", "", ["worker"]) for i in range(3)]

    def run() -> None:
        for i, rec in enumerate(records):
            w = rec.worker
            dec.labels(rec.policy, rec.reason).inc()
            ratio.labels(rec.policy).observe(rec.match_ratio)
            req.labels(w, ROUTES[i & 1], "200").inc()
            dur.labels(w).observe(0.05)
            ttft.labels(w).observe(0.01)
            toks[0].labels(w).inc(rec.prompt_tokens)
            toks[1].labels(w).inc(rec.matched_tokens)
            toks[2].labels(w).inc(400)

    return run


def _per_request_otel(records: list[DecisionRecord]) -> Callable[[], None]:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider

    reader = PrometheusMetricReader()  # registers with prometheus-client's global registry
    meter = MeterProvider(metric_readers=[reader], shutdown_on_exit=False).get_meter("bench")
    req = meter.create_counter("o_requests")
    dur = meter.create_histogram(
        "o_duration", explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS)
    )
    ttft = meter.create_histogram("o_ttft", explicit_bucket_boundaries_advisory=list(TTFT_BUCKETS))
    dec = meter.create_counter("o_decisions")
    ratio = meter.create_histogram(
        "o_ratio", explicit_bucket_boundaries_advisory=list(MATCH_RATIO_BUCKETS)
    )
    toks = [meter.create_counter(f"o_tokens{i}") for i in range(3)]

    def run() -> None:
        for i, rec in enumerate(records):
            w = {"worker": rec.worker}
            dec.add(1, {"policy": rec.policy, "reason": rec.reason})
            ratio.record(rec.match_ratio, {"policy": rec.policy})
            req.add(1, {"worker": rec.worker, "route": ROUTES[i & 1], "status": "200"})
            dur.record(0.05, w)
            ttft.record(0.01, w)
            toks[0].add(rec.prompt_tokens, w)
            toks[1].add(rec.matched_tokens, w)
            toks[2].add(400, w)

    return run


def _sdk_spans(records: list[DecisionRecord]) -> Callable[[], None]:
    """One span per request the SDK's usual way (``start_span`` … ``set_attributes`` …
    ``end``), 13 attributes, into a dropping exporter: what ``Tracing`` avoids."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import SpanKind

    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(DropExporter()))
    tracer = provider.get_tracer("bench")

    def run() -> None:
        for rec in records:
            span = tracer.start_span("/v1/chat/completions", kind=SpanKind.SERVER)
            span.set_attributes({
                "gateway.request_id": rec.request_id, "http.route": "/v1/chat/completions",
                "http.response.status_code": 200, "gateway.retries": 0,
                "gen_ai.request.model": "m", "gateway.policy": rec.policy,
                "gateway.worker": rec.worker, "gateway.reason": rec.reason,
                "gateway.candidates": 8, "gateway.matched_tokens": rec.matched_tokens,
                "gateway.prompt_tokens": rec.prompt_tokens, "gateway.ttft_s": 0.01,
                "gateway.reported_cached_tokens": 400,
            })  # fmt: skip
            span.end()

    return run


def _decision_ring(records: list[DecisionRecord]) -> Callable[[], None]:
    from policies.base import Decision, WorkerView

    views = [WorkerView(id=w, matched_tokens=512) for w in WORKERS]
    decision = Decision(WORKERS[0], "prefix_hit", {w: 0.5 for w in WORKERS})
    log = DecisionLog(1024)

    def run() -> None:
        for rec in records:
            log.add(
                DecisionRecord.from_decision(
                    request_id=rec.request_id,
                    policy="min_ttft",
                    decision=decision,
                    candidates=views,
                    prompt_tokens=2048,
                    model="m",
                )
            )

    return run


def _time_us(run: Callable[[], None], n: int, repeats: int) -> float:
    run()  # warm: children created, code paths hot
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, (time.process_time() - start) / n * 1e6)
    return best


def micro(n: int, repeats: int) -> list[tuple[str, float]]:
    """(case, CPU µs per request), best of ``repeats``."""
    records = _records(n)
    off = Telemetry(TelemetryConfig(metrics=False))
    ours = Telemetry(snapshot=_fleet)
    traced = Telemetry(snapshot=_fleet, span_exporter=DropExporter())
    sampled = Telemetry(
        TelemetryConfig(tracing=TracingConfig(sampling_ratio=0.01)),
        snapshot=_fleet,
        span_exporter=DropExporter(),
    )
    cases = [
        ("telemetry off (metrics=False, no tracing)", _per_request_ours(off, records)),
        ("telemetry: metrics (the gateway's calls)", _per_request_ours(ours, records)),
        ("telemetry: metrics + tracing, every request sampled", _per_request_ours(traced, records)),
        ("telemetry: metrics + tracing, 1% sampled", _per_request_ours(sampled, records)),
        ("8 metric updates: lock-free families (used)", _per_request_lockfree(records)),
        ("8 metric updates: prometheus-client, cached children", _per_request_prom(records, True)),
        (
            "8 metric updates: prometheus-client, labels() per call",
            _per_request_prom(records, False),
        ),
        (
            "8 metric updates: OpenTelemetry metrics SDK + Prometheus reader",
            _per_request_otel(records),
        ),
        ("one span the SDK's usual way (start_span, set_attributes, end)", _sdk_spans(records)),
        ("decision record from_decision + ring add (8 candidates)", _decision_ring(records)),
    ]
    out = [(name, _time_us(run, n, repeats)) for name, run in cases]
    scrape = min(_scrape_ms(ours) for _ in range(repeats))
    out.append(("one /metrics scrape, 8 workers (ms, not µs)", scrape))
    for t in (off, ours, traced, sampled):
        t.shutdown()
    return out


def _scrape_ms(t: Telemetry) -> float:
    start = time.process_time()
    t.render_prometheus()
    return (time.process_time() - start) * 1e3


# --- e2e: fake worker, gateway processes, client ------------------------------------------

_CHAT = orjson.dumps(
    {
        "id": "c",
        "object": "chat.completion",
        "model": "fake",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": 40,
            "completion_tokens": 1,
            "total_tokens": 41,
            "prompt_tokens_details": {"cached_tokens": 32},
        },
    }
)
_LOADS = orjson.dumps(
    {
        "loads": [
            {
                "num_running_reqs": 0,
                "num_waiting_reqs": 0,
                "token_usage": 0.0,
                "max_total_num_tokens": 100000,
            }
        ]
    }
)
_INFO = orjson.dumps({"model_path": "fake", "max_total_num_tokens": 100000, "page_size": 1})


_SSE = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"ok"}}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":'
    b'{"prompt_tokens":40,"completion_tokens":1,"prompt_tokens_details":'
    b'{"cached_tokens":32}}}\n\n'
    b"data: [DONE]\n\n"
)


def fake_worker_app(
    traceparents: list[str] | None = None, failures: list[int] | None = None, delay_s: float = 0.0
) -> web.Application:
    """A trivial SGLang-shaped worker: chat (JSON or SSE, 32 cached tokens reported),
    health, loads and server info. Appends each request's ``traceparent`` (or "") to
    ``traceparents`` when given; answers chat with the statuses popped from ``failures``
    first (while any remain); sleeps ``delay_s`` before answering."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if traceparents is not None:
            traceparents.append(request.headers.get("traceparent", ""))
        if delay_s:
            await asyncio.sleep(delay_s)
        if failures:
            return web.Response(status=failures.pop(0), text='{"error": "injected"}')
        if b'"stream":true' not in body.replace(b" ", b""):
            return web.Response(body=_CHAT, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_SSE)
        await response.write_eof()
        return response

    def fixed(body: bytes) -> Callable[[web.Request], Any]:
        async def handler(_: web.Request) -> web.Response:
            return web.Response(body=body, content_type="application/json")

        return handler

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    for path in ("/health", "/ping"):
        app.router.add_get(path, fixed(b"{}"))
    app.router.add_get("/v1/loads", fixed(_LOADS))
    app.router.add_get("/server_info", fixed(_INFO))
    return app


async def _serve_forever(app: web.Application, ports: Sequence[int]) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print(" ".join(str(a[1]) for a in runner.addresses), flush=True)
    try:
        await _until_sigterm()
    finally:
        await runner.cleanup()


async def _until_sigterm() -> None:
    import signal

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


def _gateway_app(mode: str, worker_urls: Sequence[str]) -> web.Application:
    """The real gateway; ``off`` sets ``telemetry.metrics: false`` (tracing is off by
    default); ``metrics+tracing`` samples every request into a :class:`DropExporter`."""
    import gateway.app
    from gateway.config import config_from_dict, merge

    settings = {
        "workers": list(worker_urls), "policy.name": "round_robin", "policy.seed": 1,
        "health.endpoint": "/ping", "server.log_level": "warning",
        "telemetry.metrics": mode != "off",
    }  # fmt: skip
    if mode == "metrics+tracing":
        # This bench process only: the app's factory, with an exporter that drops spans.
        gateway.app.make_telemetry = lambda _: Telemetry(span_exporter=DropExporter())  # type: ignore[assignment]
    return gateway.app.build_app(config_from_dict(merge({}, settings)))


def _spawn(stack: contextlib.ExitStack, args: Sequence[str]) -> tuple[int, list[int]]:
    """Start this module's ``args`` subcommand (stopped by PID when ``stack`` closes);
    its PID and the ports it printed."""
    cmd = [sys.executable, "-m", "loadtests.micro.telemetry", *args]
    proc = stack.enter_context(running(cmd, stdout=subprocess.PIPE, text=True))
    assert proc.stdout is not None
    ports = [int(p) for p in proc.stdout.readline().split()]
    return proc.pid, ports


async def _load(url: str, seconds: float, concurrency: int) -> int:
    import aiohttp

    body = orjson.dumps(
        {"model": "fake", "messages": [{"role": "user", "content": "hi " * 30}], "max_tokens": 1}
    )
    done = 0
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                async with session.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                ) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done


async def _measure(url: str, pid: int, seconds: float, concurrency: int) -> tuple[float, float]:
    await _load(url, 0.5, concurrency)  # warm connections and caches
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    done = await _load(url, seconds, concurrency)
    cpu, wall = cpu_seconds(pid) - cpu0, time.monotonic() - t0
    return done / wall, cpu / max(1, done) * 1e6


def e2e(seconds: float, concurrency: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """mode -> [(requests/s, gateway CPU µs per request)] per round."""
    with contextlib.ExitStack() as stack:  # stops the gateways, then the worker
        _, ports = _spawn(stack, ["_worker", "--ports", "0", "0", "0", "0"])
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        gateways: dict[str, tuple[int, int]] = {}
        for mode in MODES:
            pid, (port,) = _spawn(stack, ["_gateway", "--mode", mode, "--workers", *urls])
            gateways[mode] = (pid, port)
        time.sleep(1.0)  # first health probes pass
        results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for _ in range(rounds):
            for mode, (pid, port) in gateways.items():
                url = f"http://127.0.0.1:{port}"
                results[mode].append(asyncio.run(_measure(url, pid, seconds, concurrency)))
        return results


async def _gateway_main(mode: str, workers: Sequence[str]) -> None:
    from gateway.http.handlers import start_site

    runner, port = await start_site(_gateway_app(mode, workers), "127.0.0.1", 0)
    print(port, flush=True)
    try:
        await _until_sigterm()
    finally:
        await runner.cleanup()


# --- CLI --------------------------------------------------------------------------------


def _run_uvloop(coro: Any) -> None:
    import uvloop

    with (
        contextlib.suppress(KeyboardInterrupt),
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        runner.run(coro)


def _report_micro(rows: list[tuple[str, float]]) -> None:
    print("| case | CPU µs per request |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


def _report_e2e(results: dict[str, list[tuple[float, float]]]) -> None:
    base_rps = statistics.median(r for r, _ in results["off"])
    base_cpu = statistics.median(c for _, c in results["off"])
    print("| gateway | requests/s (median) | vs off | gateway CPU µs/request | added µs |")
    print("|---|---|---|---|---|")
    for mode, rows in results.items():
        rps = statistics.median(r for r, _ in rows)
        cpu = statistics.median(c for _, c in rows)
        print(
            f"| {mode} | {rps:.0f} | {100 * (rps / base_rps - 1):+.1f}% | {cpu:.0f} | "
            f"{cpu - base_cpu:+.0f} |"
        )
    print("rounds:", {m: [(round(r), round(c)) for r, c in rows] for m, rows in results.items()})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.micro.telemetry")
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("micro")
    m.add_argument("--requests", type=int, default=20000)
    m.add_argument("--repeats", type=int, default=5)
    e = sub.add_parser("e2e")
    e.add_argument("--seconds", type=float, default=5.0)
    e.add_argument("--concurrency", type=int, default=32)
    e.add_argument("--rounds", type=int, default=2)
    w = sub.add_parser("_worker")
    w.add_argument("--ports", type=int, nargs="+", required=True)
    g = sub.add_parser("_gateway")
    g.add_argument("--mode", choices=MODES, required=True)
    g.add_argument("--workers", nargs="+", required=True)
    args = parser.parse_args(argv)
    if args.cmd == "micro":
        _report_micro(micro(args.requests, args.repeats))
    elif args.cmd == "e2e":
        _report_e2e(e2e(args.seconds, args.concurrency, args.rounds))
    elif args.cmd == "_worker":
        _run_uvloop(_serve_forever(fake_worker_app(), args.ports))
    else:
        _run_uvloop(_gateway_main(args.mode, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
