"""The real-engine harness's pure parts (no engine needed): counters, workload, table."""

from __future__ import annotations

import math

import pytest

from loadtests.engine.bench import direct_route, markdown_table
from loadtests.engine.client import ChatResult
from loadtests.engine.probe import EngineCounters, cache_delta, parse_prometheus
from loadtests.engine.runner import RunResult, reported_fraction
from loadtests.engine.workload import (
    SharedPrefixSpec,
    capacity_hint_args,
    shared_prefix_requests,
)
from loadtests.harness.stats import percentile

METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 2312
llamacpp:prompt_tokens_cached_total 4618
llamacpp:requests_processing 1
llamacpp:requests_deferred 0
llamacpp:tokens_predicted_total 20
"""


def counters(computed: float, cached: float) -> EngineCounters:
    return EngineCounters(computed, cached, 0.0, 0.0, 0.0)


def test_parse_prometheus_and_counters() -> None:
    samples = parse_prometheus(METRICS)
    assert samples["llamacpp:prompt_tokens_cached_total"] == 4618
    c = EngineCounters.from_metrics(samples)
    assert (c.computed_tokens, c.cached_tokens, c.processing, c.predicted_tokens) == (
        2312, 4618, 1, 20,
    )  # fmt: skip
    with pytest.raises(KeyError, match="requests_deferred"):
        EngineCounters.from_metrics({k: v for k, v in samples.items() if "deferred" not in k})


def test_cache_delta_sums_workers() -> None:
    before = [counters(100, 0), counters(50, 50)]
    after = [counters(300, 600), counters(250, 250)]
    delta = cache_delta(before, after)
    assert (delta.computed_tokens, delta.cached_tokens) == (400, 800)
    assert delta.cached_fraction == pytest.approx(800 / 1200)
    assert cache_delta([], []).cached_fraction == 0.0
    with pytest.raises(ValueError):
        cache_delta(before, after[:1])


def test_workload_is_deterministic_and_shuffled() -> None:
    spec = SharedPrefixSpec(num_prefixes=4, per_prefix=3, prefix_tokens=50, message_tokens=5)
    a, b = shared_prefix_requests(spec), shared_prefix_requests(spec)
    assert [r.body for r in a] == [r.body for r in b]
    assert sorted(r.prefix_id for r in a) == [p for p in range(4) for _ in range(3)]
    assert [r.prefix_id for r in a] != sorted(r.prefix_id for r in a)
    same_prefix = [r for r in a if r.prefix_id == a[0].prefix_id]
    systems = {r.body["messages"][0]["content"] for r in same_prefix}
    users = {r.body["messages"][1]["content"] for r in same_prefix}
    assert len(systems) == 1 and len(users) == 3
    assert len(a[0].body["messages"][0]["content"].split()) == 50  # one syllable a token
    salted = shared_prefix_requests(SharedPrefixSpec(4, 3, 50, 5, text_salt=1))
    assert [r.prefix_id for r in salted] == [r.prefix_id for r in a]
    assert salted[0].body["messages"][0]["content"] != a[0].body["messages"][0]["content"]
    longest = max(sum(len(m["content"]) for m in r.body["messages"]) for r in a)
    assert capacity_hint_args(a, 2) == ["--max-tree-size", str(2 * longest)]


def test_direct_routes() -> None:
    requests = shared_prefix_requests(SharedPrefixSpec(8, 2, 10, 2))
    urls = ["u0", "u1", "u2", "u3"]
    sticky = direct_route("sticky", urls)
    assert all(sticky(r) == urls[r.prefix_id % 4] for r in requests)
    rr = direct_route("round_robin", urls)
    assert [rr(r) for r in requests[:5]] == ["u0", "u1", "u2", "u3", "u0"]
    with pytest.raises(ValueError):
        direct_route("nope", urls)


def test_quantile_fraction_and_table() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50, "linear") == 3.0
    assert percentile([7.0], 90, "linear") == 7.0
    assert math.isnan(percentile([], 50, "linear"))
    ok = ChatResult(True, 200, 0.1, 0.2, prompt_tokens=100, cached_tokens=60)
    failed = ChatResult(False, 500, None, 0.1, error="boom")
    assert reported_fraction([ok, ok, failed]) == pytest.approx(0.6)
    rows = [
        RunResult("gateway:min_ttft", 3, 1, 0.5, 0.1, 0.2, 9.0, 0.6, "boom"),
        RunResult("gateway:x", 0, 0, *(float("nan"),) * 4, error="did not start"),
    ]
    table = markdown_table(rows)
    assert "| gateway:min_ttft | 0.50 | 0.60 | 0.100 s | 0.200 s | 9.0 s | 1/3 |" in table
    assert "not run: did not start" in table
