"""Tracing: one span per request with its attributes, W3C propagation, zero cost when off."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import gateway.telemetry.tracing
from gateway.routing.decisions import CandidateScore, DecisionRecord
from gateway.telemetry.hub import _CURRENT, Telemetry, TelemetryConfig
from gateway.telemetry.logs import REQUEST_ID
from gateway.telemetry.tracing import Tracing, TracingConfig, parse_traceparent

ROUTE = "/v1/chat/completions"
PARENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{PARENT_TRACE}-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def _fresh_request_context() -> Iterator[None]:
    """begin_request binds the request to the caller's context: undo it after a test."""
    rid = REQUEST_ID.set(None)
    current = _CURRENT.set(None)
    yield
    _CURRENT.reset(current)
    REQUEST_ID.reset(rid)


def record(worker: str) -> DecisionRecord:
    cands = (CandidateScore("w1", 32, 0.1), CandidateScore("w2", 0, 0.4), CandidateScore("w3", 0))
    return DecisionRecord(
        time=0.0, request_id="r", policy="cache_aware", worker=worker, reason="prefix_hit",
        candidates=cands, prompt_tokens=64, matched_tokens=32,
    )  # fmt: skip


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def traced(exporter: InMemorySpanExporter) -> Iterator[Telemetry]:
    t = Telemetry(span_exporter=exporter)
    yield t
    t.shutdown()


def test_one_span_per_request_with_attributes(
    traced: Telemetry, exporter: InMemorySpanExporter
) -> None:
    for i in range(3):
        rt = traced.begin_request(f"req-{i}", ROUTE, "tiny-model")
        rt.decided(record("w2"))
        rt.upstream_failed("w2", "connect")
        rt.decided(record("w1"))
        rt.finish(200, reported_cached_tokens=30, ttft_s=0.125)
    spans = exporter.get_finished_spans()
    assert len(spans) == 3
    span = spans[0]
    assert span.name == ROUTE
    assert span.kind == SpanKind.SERVER
    attrs = dict(span.attributes or {})
    assert attrs["gateway.request_id"] == "req-0"
    assert attrs["gen_ai.request.model"] == "tiny-model"
    assert attrs["gateway.policy"] == "cache_aware"
    assert attrs["gateway.worker"] == "w1"
    assert attrs["gateway.matched_tokens"] == 32
    assert attrs["gateway.reported_cached_tokens"] == 30
    assert attrs["gateway.candidates"] == 3
    assert "gateway.candidates_left_out" not in attrs  # no shortlist
    assert attrs["gateway.retries"] == 1
    assert attrs["gateway.ttft_s"] == 0.125
    assert attrs["http.response.status_code"] == 200


def test_a_shortlisted_decision_says_how_many_candidates_were_left_out(
    traced: Telemetry, exporter: InMemorySpanExporter
) -> None:
    rt = traced.begin_request("req-big", ROUTE, "tiny-model")
    rt.decided(dataclasses.replace(record("w1"), left_out=253))
    rt.finish(200)
    attrs = dict(exporter.get_finished_spans()[0].attributes or {})
    assert (attrs["gateway.candidates"], attrs["gateway.candidates_left_out"]) == (3, 253)


def test_traceparent_injected_and_incoming_parent_honoured(
    traced: Telemetry, exporter: InMemorySpanExporter
) -> None:
    rt = traced.begin_request("r", ROUTE, headers={"traceparent": PARENT})
    headers = dict(rt.upstream_headers())
    rt.finish(200)
    (span,) = exporter.get_finished_spans()
    ctx = span.get_span_context()
    assert ctx is not None and span.parent is not None
    assert format(ctx.trace_id, "032x") == PARENT_TRACE
    assert headers["traceparent"] == f"00-{PARENT_TRACE}-{ctx.span_id:016x}-01"


def test_fresh_trace_without_incoming_parent(
    traced: Telemetry, exporter: InMemorySpanExporter
) -> None:
    rt = traced.begin_request("r", ROUTE)
    assert rt.upstream_headers()["traceparent"].startswith("00-")
    rt.finish(500)
    (span,) = exporter.get_finished_spans()
    assert span.parent is None


def test_finish_twice_ends_span_once(traced: Telemetry, exporter: InMemorySpanExporter) -> None:
    rt = traced.begin_request("r", ROUTE)
    rt.finish(200)
    rt.finish(200)
    assert len(exporter.get_finished_spans()) == 1


def test_sampling_ratio_zero_creates_no_root_span(exporter: InMemorySpanExporter) -> None:
    t = Telemetry(
        TelemetryConfig(tracing=TracingConfig(sampling_ratio=0.0)), span_exporter=exporter
    )
    rt = t.begin_request("r", ROUTE)
    assert rt._span is None
    assert dict(rt.upstream_headers()) == {}
    rt.finish(200)
    assert exporter.get_finished_spans() == ()
    # a sampled parent still decides: its trace continues through the gateway
    rt = t.begin_request("r2", ROUTE, headers={"traceparent": PARENT})
    rt.finish(200)
    assert len(exporter.get_finished_spans()) == 1
    t.shutdown()


def test_malformed_traceparent_is_ignored(exporter: InMemorySpanExporter) -> None:
    t = Telemetry(
        TelemetryConfig(tracing=TracingConfig(sampling_ratio=0.0)), span_exporter=exporter
    )
    rt = t.begin_request("r", ROUTE, headers={"traceparent": "00-zz-not-a-trace"})
    rt.finish(200)
    assert exporter.get_finished_spans() == ()  # the ratio applied, as without a parent
    t.shutdown()
    fresh = InMemorySpanExporter()  # shutdown stopped the first one
    t = Telemetry(span_exporter=fresh)
    t.begin_request("r", ROUTE, headers={"traceparent": "garbage"}).finish(200)
    (span,) = fresh.get_finished_spans()
    assert span.parent is None
    t.shutdown()


def test_sampling_ratio_is_honoured(exporter: InMemorySpanExporter) -> None:
    t = Telemetry(
        TelemetryConfig(tracing=TracingConfig(sampling_ratio=0.25)), span_exporter=exporter
    )
    for i in range(400):
        t.begin_request(f"r{i}", ROUTE).finish(200)
    assert 50 <= len(exporter.get_finished_spans()) <= 150
    t.shutdown()


def test_tracing_off_creates_no_span() -> None:
    t = Telemetry()
    assert not t.tracing_enabled
    rt = t.begin_request("r", ROUTE, headers={"traceparent": PARENT})
    assert rt._span is None
    assert dict(rt.upstream_headers()) == {}
    rt.finish(200)
    t.shutdown()


def test_console_exporter_prints_the_span(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()  # ConsoleSpanExporter binds sys.stdout at import: give it a buffer
    monkeypatch.setattr(
        gateway.telemetry.tracing, "ConsoleSpanExporter", lambda: ConsoleSpanExporter(out=out)
    )
    t = Telemetry(TelemetryConfig(tracing=TracingConfig(exporter="console")))
    assert t.tracing_enabled
    rt = t.begin_request("req-console", ROUTE, "m")
    rt.decided(record("w1"))
    rt.finish(200, ttft_s=0.01)
    t.shutdown()  # the batch processor flushes on shutdown
    t.shutdown()
    text = out.getvalue()
    assert '"gateway.request_id": "req-console"' in text
    assert '"kind": "SpanKind.SERVER"' in text


def test_tracestate_is_forwarded(traced: Telemetry, exporter: InMemorySpanExporter) -> None:
    headers = {"traceparent": PARENT, "tracestate": "vendor=abc"}
    rt = traced.begin_request("r", ROUTE, headers=headers)
    assert rt.upstream_headers()["tracestate"] == "vendor=abc"
    rt.finish(200)
    (span,) = exporter.get_finished_spans()
    assert span.parent is not None and format(span.parent.span_id, "016x") == "b7ad6b7169203331"
    ctx = span.get_span_context()
    assert ctx is not None and ctx.trace_state.get("vendor") == "abc"


@pytest.mark.parametrize(
    "value",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c8031-b7ad6b7169203331-01",
    ],
)
def test_invalid_traceparents(value: str) -> None:
    assert parse_traceparent(value) is None


def test_unsampled_parent_gets_no_span(traced: Telemetry, exporter: InMemorySpanExporter) -> None:
    rt = traced.begin_request("r", ROUTE, headers={"traceparent": PARENT[:-2] + "00"})
    assert dict(rt.upstream_headers()) == {}
    rt.finish(200)
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"exporter": "jaeger"}, "tracing.exporter"), ({"sampling_ratio": 1.5}, "sampling_ratio")],
)
def test_invalid_config_names_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        TracingConfig(**kwargs)  # type: ignore[arg-type]


def test_otlp_without_package_is_refused() -> None:
    try:
        import opentelemetry.exporter.otlp  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="opentelemetry-exporter-otlp"):
            Tracing(TracingConfig(exporter="otlp"))
    else:
        pytest.skip("opentelemetry-exporter-otlp is installed")
