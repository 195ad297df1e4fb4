"""Telemetry: metric names, types, labels and counts after known traffic; worker removal."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.routing.decisions import CandidateScore, DecisionRecord
from gateway.telemetry.hub import _CURRENT, NO_WORKER, Telemetry, TelemetryConfig
from gateway.telemetry.logs import REQUEST_ID
from gateway.telemetry.snapshot import FleetSnapshot, IndexFigures, WorkerSnapshot

ROUTE = "/v1/chat/completions"


@pytest.fixture(autouse=True)
def _fresh_request_context() -> Iterator[None]:
    """begin_request binds the request to the caller's context: undo it after a test."""
    rid = REQUEST_ID.set(None)
    current = _CURRENT.set(None)
    yield
    _CURRENT.reset(current)
    REQUEST_ID.reset(rid)


def record(
    worker: str, reason: str = "prefix_hit", matched: int = 60, prompt: int = 100
) -> DecisionRecord:
    cands = (CandidateScore("w1", matched, 0.5), CandidateScore("w2", 0, 1.5))
    return DecisionRecord(
        time=0.0, request_id="r", policy="min_ttft", worker=worker, reason=reason,
        candidates=cands, prompt_tokens=prompt, matched_tokens=matched,
        available_tokens=matched,  # the longest candidate match (w1's)
    )  # fmt: skip


class Fleet:
    """A mutable fake snapshot provider."""

    def __init__(self, workers: list[str]) -> None:
        self.workers = workers

    def __call__(self) -> FleetSnapshot:
        return FleetSnapshot(
            workers=[
                WorkerSnapshot(
                    worker=w,
                    url=f"http://127.0.0.1:1800{i}",
                    healthy=i != 1,
                    health_flags={"ejected": i == 1},
                    in_flight=3 + i,
                    queued=i,
                    engine_running=5,
                    engine_waiting=2 * i,
                    engine_token_usage=0.25,
                    index=IndexFigures(
                        blocks=10 * (i + 1),
                        approx_bytes=1000 * (i + 1),
                        predicted_tokens=7,
                        reported_tokens=5,
                    ),
                )
                for i, w in enumerate(self.workers)
            ],
            policy="min_ttft",
            admission_in_flight=4,
            admission_queued=1,
            admission_rejections={"queue_full": 2, "queue_timeout": 0},
        )


def samples(t: Telemetry) -> dict[str, tuple[str, list[Sample]]]:
    text = t.render_prometheus().decode()
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def value(fams: dict[str, tuple[str, list[Sample]]], sample_name: str, **labels: str) -> float:
    family = sample_name
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        if sample_name.endswith(suffix) and sample_name[: -len(suffix)] in fams:
            family = sample_name[: -len(suffix)]
    hits = [s.value for s in fams[family][1] if s.name == sample_name and s.labels == labels]
    assert len(hits) == 1, (sample_name, labels, fams[family][1])
    return hits[0]


@pytest.fixture
def fleet() -> Fleet:
    return Fleet(["w1", "w2"])


@pytest.fixture
def telemetry(fleet: Fleet) -> Iterator[Telemetry]:
    t = Telemetry(snapshot=fleet)
    yield t
    t.shutdown()


def traffic(t: Telemetry) -> None:
    """7 requests: w1 3x200 (one after a retry), w2 2x200 + 1x502, one 429 with no worker."""
    for i in range(3):
        rt = t.begin_request(f"a{i}", ROUTE, "m")
        if i == 0:
            rt.decided(record("w2", "load"))
            rt.upstream_failed("w2", "connect")
        rt.decided(record("w1"))
        rt.first_byte()
        rt.finish(200, reported_cached_tokens=50)
    for status in (200, 200, 502):
        rt = t.begin_request("b", "/generate", "m")
        rt.decided(record("w2", "miss", matched=0))
        if status == 502:
            rt.upstream_failed("w2", "http_5xx")
        rt.finish(status, ttft_s=0.02)
    t.begin_request("c", ROUTE).finish(429)
    t.worker_ejected("w2")


def test_request_counts_by_worker_route_status(telemetry: Telemetry) -> None:
    traffic(telemetry)
    f = samples(telemetry)
    assert f["gateway_requests"][0] == "counter"
    assert value(f, "gateway_requests_total", worker="w1", route=ROUTE, status="200") == 3
    assert value(f, "gateway_requests_total", worker="w2", route="/generate", status="200") == 2
    assert value(f, "gateway_requests_total", worker="w2", route="/generate", status="502") == 1
    assert value(f, "gateway_requests_total", worker=NO_WORKER, route=ROUTE, status="429") == 1
    total = sum(s.value for s in f["gateway_requests"][1] if s.name == "gateway_requests_total")
    assert total == 7


def test_histograms_by_worker(telemetry: Telemetry) -> None:
    traffic(telemetry)
    f = samples(telemetry)
    assert f["gateway_request_duration_seconds"][0] == "histogram"
    assert f["gateway_time_to_first_token_seconds"][0] == "histogram"
    assert value(f, "gateway_request_duration_seconds_count", worker="w1") == 3
    assert value(f, "gateway_time_to_first_token_seconds_count", worker="w1") == 3
    assert value(f, "gateway_time_to_first_token_seconds_count", worker="w2") == 3
    assert value(f, "gateway_time_to_first_token_seconds_sum", worker="w2") == pytest.approx(0.06)
    ttft_le = value(f, "gateway_time_to_first_token_seconds_bucket", worker="w2", le="0.025")
    assert ttft_le == 3


def test_decisions_and_match_ratio(telemetry: Telemetry) -> None:
    traffic(telemetry)
    f = samples(telemetry)
    assert value(f, "gateway_routing_decisions_total", policy="min_ttft", reason="prefix_hit") == 3
    assert value(f, "gateway_routing_decisions_total", policy="min_ttft", reason="load") == 1
    assert value(f, "gateway_routing_decisions_total", policy="min_ttft", reason="miss") == 3
    assert f["gateway_prefix_match_ratio"][0] == "histogram"
    assert value(f, "gateway_prefix_match_ratio_count", policy="min_ttft") == 7
    # 3 misses at 0.0; 4 decisions at 0.6 fall in le=0.6
    assert value(f, "gateway_prefix_match_ratio_bucket", policy="min_ttft", le="0.0") == 3
    assert value(f, "gateway_prefix_match_ratio_bucket", policy="min_ttft", le="0.6") == 7


def test_errors_retries_ejections_admission(telemetry: Telemetry) -> None:
    traffic(telemetry)
    f = samples(telemetry)
    assert value(f, "gateway_retries_total", route=ROUTE) == 1
    assert value(f, "gateway_upstream_errors_total", worker="w2", kind="connect") == 1
    assert value(f, "gateway_upstream_errors_total", worker="w2", kind="http_5xx") == 1
    assert value(f, "gateway_worker_ejections_total", worker="w2") == 1
    assert value(f, "gateway_admission_rejections_total", reason="queue_full") == 2
    assert value(f, "gateway_admission_rejections_total", reason="queue_timeout") == 0
    telemetry.upstream_error("w1", "not-a-kind")
    f = samples(telemetry)
    assert value(f, "gateway_upstream_errors_total", worker="w1", kind="other") == 1


def test_index_fidelity_tokens(telemetry: Telemetry) -> None:
    traffic(telemetry)
    f = samples(telemetry)
    # w1: 3 successes x 100 prompt, 60 predicted, 50 reported; w2: 2 successes, 0 predicted
    assert value(f, "gateway_worker_prompt_tokens_total", worker="w1") == 300
    assert value(f, "gateway_worker_predicted_cached_tokens_total", worker="w1") == 180
    assert value(f, "gateway_worker_reported_cached_tokens_total", worker="w1") == 150
    assert value(f, "gateway_worker_prompt_tokens_total", worker="w2") == 200
    reported = [s.labels for s in f["gateway_worker_reported_cached_tokens"][1]]
    assert {"worker": "w2"} not in reported  # w2 never reported: no series
    stats = telemetry.worker_stats()["w1"]
    assert (stats.requests, stats.reported_prompt_tokens, stats.reported_tokens) == (3, 300, 150)


def test_reported_prompt_tokens_count_only_requests_with_a_report(telemetry: Telemetry) -> None:
    """The captured hit rate's denominator: a stream without usage reports nothing, so its
    prompt counts in gateway_worker_prompt_tokens_total only."""
    traffic(telemetry)  # w1: 3 x 100 prompt tokens, all reported; w2: none reported
    rt = telemetry.begin_request("d", ROUTE, "m")
    rt.decided(record("w1", prompt=400))
    rt.finish(200)  # no cached_tokens in the answer
    f = samples(telemetry)
    assert value(f, "gateway_worker_prompt_tokens_total", worker="w1") == 700
    assert value(f, "gateway_worker_reported_prompt_tokens_total", worker="w1") == 300
    assert value(f, "gateway_worker_reported_cached_tokens_total", worker="w1") == 150
    assert {"worker": "w2"} not in [
        s.labels for s in f["gateway_worker_reported_prompt_tokens"][1]
    ]  # w2 never reported: no series, like its reported cached tokens


def test_pull_gauges_from_snapshot(telemetry: Telemetry) -> None:
    f = samples(telemetry)
    assert f["gateway_worker_in_flight_requests"][0] == "gauge"
    assert value(f, "gateway_worker_in_flight_requests", worker="w1") == 3
    assert value(f, "gateway_worker_in_flight_requests", worker="w2") == 4
    assert value(f, "gateway_worker_queued_requests", worker="w2") == 1
    assert value(f, "gateway_worker_healthy", worker="w1") == 1
    assert value(f, "gateway_worker_healthy", worker="w2") == 0
    assert value(f, "gateway_worker_health_flag", worker="w2", flag="ejected") == 1
    assert value(f, "gateway_worker_health_flag", worker="w2", flag="draining") == 0
    assert value(f, "gateway_worker_engine_waiting_requests", worker="w2") == 2
    assert value(f, "gateway_worker_engine_running_requests", worker="w1") == 5
    assert value(f, "gateway_worker_engine_token_usage_ratio", worker="w1") == 0.25
    assert value(f, "gateway_prefix_index_blocks", worker="w2") == 20
    assert value(f, "gateway_prefix_index_bytes", worker="w2") == 2000
    assert f["gateway_prefix_index_predicted_cached_tokens"][0] == "counter"
    assert value(f, "gateway_prefix_index_reported_cached_tokens_total", worker="w1") == 5
    assert value(f, "gateway_admission_queued_requests") == 1
    assert value(f, "gateway_admission_in_flight_requests") == 4


def test_every_name_is_prefixed_and_counters_end_in_total(telemetry: Telemetry) -> None:
    traffic(telemetry)
    for name, (kind, fam_samples) in samples(telemetry).items():
        assert name.startswith("gateway_"), name
        if kind == "counter":
            assert any(s.name == name + "_total" for s in fam_samples), name


def test_removed_worker_series_dropped_at_next_scrape(telemetry: Telemetry, fleet: Fleet) -> None:
    traffic(telemetry)
    fleet.workers = ["w1"]
    text = telemetry.render_prometheus().decode()
    assert 'worker="w2"' not in text
    assert 'worker="w1"' in text
    assert f'worker="{NO_WORKER}"' in text


def test_forget_worker_drops_series_at_once(telemetry: Telemetry) -> None:
    traffic(telemetry)
    telemetry.forget_worker("w1")
    lines = [ln for ln in telemetry.render_prometheus().decode().splitlines()]
    pushed = [ln for ln in lines if 'worker="w1"' in ln and ln.startswith("gateway_requests")]
    assert pushed == []
    assert "w1" not in telemetry.worker_stats()


def test_decision_record_gets_outcome(telemetry: Telemetry) -> None:
    rt = telemetry.begin_request("x", ROUTE)
    rec = record("w1")
    rt.decided(record("w2"))
    rt.upstream_failed("w2", "timeout")
    rt.decided(rec)
    rt.finish(200, reported_cached_tokens=40, ttft_s=0.5)
    rt.finish(500)  # only the first call counts
    assert rec.outcome is not None
    assert (rec.outcome.status, rec.outcome.ttft_s, rec.outcome.reported_cached_tokens) == (
        200, 0.5, 40,
    )  # fmt: skip
    assert rec.outcome.retries == 1
    f = samples(telemetry)
    assert value(f, "gateway_requests_total", worker="w1", route=ROUTE, status="200") == 1
    assert "gateway_requests_total" not in {
        s.name for s in f["gateway_requests"][1] if s.labels.get("status") == "500"
    }


def test_metrics_off_records_nothing(fleet: Fleet) -> None:
    t = Telemetry(TelemetryConfig(metrics=False), snapshot=fleet)
    traffic(t)
    text = t.render_prometheus().decode()
    assert "gateway_requests_total{" not in text
    assert "gateway_worker_in_flight_requests{" in text  # scrape-time figures still served
    assert t.worker_stats() == {}
    t.shutdown()


def test_registries_are_independent() -> None:
    a, b = Telemetry(), Telemetry()
    a.begin_request("r", ROUTE).finish(200)
    assert b"gateway_requests_total{" not in b.render_prometheus()
    a.shutdown()
    b.shutdown()
