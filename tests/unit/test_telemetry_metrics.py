"""Lock-free counters and histograms: exposition matches Prometheus semantics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metrics import CounterVec, HistogramVec, PushCollector


def scrape(
    *families: CounterVec | HistogramVec,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(PushCollector(families))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    h = HistogramVec("h_seconds", "doc", ["worker"], [0.1, 1.0, 0.5])
    child = h.labels("w1")
    for v in (0.05, 0.1, 0.3, 0.5, 2.0, 7.0):
        child.observe(v)
    got = scrape(h)
    bucket = {le: got[("h_seconds_bucket", (("le", le), ("worker", "w1")))]
              for le in ("0.1", "0.5", "1.0", "+Inf")}  # fmt: skip
    assert bucket == {"0.1": 2, "0.5": 4, "1.0": 4, "+Inf": 6}
    assert got[("h_seconds_count", (("worker", "w1"),))] == 6
    assert got[("h_seconds_sum", (("worker", "w1"),))] == 9.95


def test_counter_total_suffix_and_no_created_series() -> None:
    c = CounterVec("c", "doc", ["worker", "kind"])
    c.labels("w1", "connect").inc()
    c.labels("w1", "connect").inc(2)
    c.labels("w2", "timeout").inc()
    got = scrape(c)
    assert got[("c_total", (("kind", "connect"), ("worker", "w1")))] == 3
    assert not any(name.endswith("_created") for name, _ in got)


def test_remove_worker_drops_only_its_children() -> None:
    c = CounterVec("c", "doc", ["worker", "kind"])
    h = HistogramVec("h", "doc", ["worker"], [1.0])
    plain = CounterVec("p", "doc", ["route"])
    for w in ("w1", "w2"):
        c.labels(w, "connect").inc()
        h.labels(w).observe(0.5)
    plain.labels("/generate").inc()
    for fam in (c, h, plain):
        fam.remove_worker("w1")
    assert list(c.children) == [("w2", "connect")]
    assert list(h.children) == [("w2",)]
    assert list(plain.children) == [("/generate",)]
