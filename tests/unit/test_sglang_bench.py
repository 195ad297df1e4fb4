"""The real-SGLang benchmark's and calibration's pure parts, without SGLang: reading
SGLang's counters, the engines' mean TTFT, the prefill and decode fits, the simulated
twin's command line, the bench's defaults per fleet and its table."""

from __future__ import annotations

import math

import pytest

from loadtests.engine import bench
from loadtests.engine.probe import EngineCounters, cache_delta, parse_prometheus
from loadtests.engine.runner import RunResult
from loadtests.engine.sglang_calibrate import DecodePoint, Point, fit_decode, fit_prefill
from loadtests.harness.sim_fleet import SimSettings
from simulator.model.profiles import get_profile

# The shape of a real 0.5.23 /metrics (trimmed): labelled samples, cache sources.
SGLANG_METRICS = """# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="m"} 100.0
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="m"} 900.0
sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="m"} 400.0
sglang:cached_tokens_total{cache_source="total",engine_type="unified",model_name="m"} 400.0
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 1.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 2.0
sglang:generation_tokens_total{engine_type="unified",is_streaming="true",model_name="m"} 7.0
sglang:time_to_first_token_seconds_sum{engine_type="unified",is_streaming="true"} 1.5
sglang:time_to_first_token_seconds_count{engine_type="unified",is_streaming="true"} 3.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.1"} 1.0
"""


def test_sglang_counters_sum_labels_and_prefer_the_total_source() -> None:
    c = EngineCounters.from_metrics(parse_prometheus(SGLANG_METRICS))
    assert (c.cached_tokens, c.computed_tokens) == (400.0, 600.0)  # total, not device+total
    assert (c.processing, c.deferred, c.predicted_tokens) == (1.0, 2.0, 7.0)
    assert (c.ttft_sum_s, c.ttft_count) == (1.5, 3.0)  # buckets not summed in
    no_total = SGLANG_METRICS.replace('cache_source="total"', 'cache_source="host"')
    assert EngineCounters.from_metrics(parse_prometheus(no_total)).cached_tokens == 800.0


def test_sglang_counters_before_any_request_are_zero() -> None:
    c = EngineCounters.from_metrics(parse_prometheus('sglang:num_running_reqs{a="b"} 0.0\n'))
    assert (c.cached_tokens, c.computed_tokens, c.ttft_count) == (0.0, 0.0, 0.0)


def test_delta_carries_the_engines_mean_ttft() -> None:
    before = [EngineCounters(10, 5, 0, 0, 0, 1.0, 2.0), EngineCounters(0, 0, 0, 0, 0)]
    after = [EngineCounters(20, 15, 0, 0, 0, 2.0, 4.0), EngineCounters(5, 5, 0, 0, 0, 1.0, 2.0)]
    delta = cache_delta(before, after)
    assert delta.engine_ttft_mean_s == pytest.approx(2.0 / 4.0)
    assert delta.cached_fraction == pytest.approx(15 / 30)
    assert math.isnan(cache_delta(before, before).engine_ttft_mean_s)


def test_fit_prefill_recovers_the_constants_that_made_the_points() -> None:
    true = {
        "prefill_fixed_s": 0.03, "prefill_per_token_s": 9e-5, "prefill_per_cached_token_s": 1e-5,
        "attention_per_pair_s": 2e-9, "cached_pair_s": 3e-8,
    }  # fmt: skip
    pts = []
    for n, c in [(250, 0), (1000, 0), (3000, 0), (200, 1000), (200, 3000), (16, 992), (500, 500)]:
        ttft = get_profile("tiny-cpu").with_overrides(**true).prefill_time(n, c)
        pts.append(Point("cold" if c == 0 else "cached", n, c, ttft, (ttft,)))
    fit = fit_prefill(pts)
    for name, value in true.items():
        assert fit[name] == pytest.approx(value, rel=1e-5), name


def test_fit_decode_is_the_line_through_two_contexts_never_falling() -> None:
    fit = fit_decode([DecodePoint(200, 0.010, ()), DecodePoint(3200, 0.013, ())])
    assert fit["decode_per_context_token_s"] == pytest.approx(1e-6)
    assert fit["decode_base_s"] == pytest.approx(0.0098)
    flat = fit_decode([DecodePoint(200, 0.012, ()), DecodePoint(3200, 0.011, ())])
    assert flat == {"decode_base_s": 0.012, "decode_per_context_token_s": 0.0}


def test_sim_twin_args_page_size_and_sglang_formula() -> None:
    args = SimSettings(capacity_tokens=8192, max_running_requests=None, page_size=16).args(2)
    assert "--max-running-requests" not in args
    assert args[args.index("--page-size") + 1] == "16"
    assert args[args.index("--capacity-tokens") + 1] == "8192"
    old = SimSettings().args(1)
    assert old[old.index("--max-running-requests") + 1] == "2"


def test_bench_defaults_per_fleet() -> None:
    def parsed(*argv: str) -> object:
        return bench.resolve_defaults(bench._parser().parse_args(list(argv)))

    real = parsed("--fleet", "sglang")
    assert (real.workers, real.max_total_tokens) == (2, 8192)  # type: ignore[attr-defined]
    twin = parsed("--fleet", "sim", "--sim-engine", "sglang", "--max-total-tokens", "8192")
    assert (twin.workers, twin.sim_profile) == (2, "tiny-sglang")  # type: ignore[attr-defined]
    llama = parsed()
    assert (llama.workers, llama.sim_profile) == (4, "tiny-llamacpp")  # type: ignore[attr-defined]
    get_profile("tiny-sglang")  # the twin's profile exists


def test_table_gets_the_engine_ttft_column_on_sglang() -> None:
    rows = [RunResult("gateway:min_ttft", 48, 0, 0.7, 0.1, 0.3, 9.0, 0.7, "", 0.085)]
    table = bench.markdown_table(rows)
    assert "engine TTFT mean" in table
    row = "| gateway:min_ttft | 0.70 | 0.70 | 0.085 s | 0.100 s | 0.300 s | 9.0 s | 0/48 |"
    assert row in table


def test_fit_prefill_never_returns_a_negative_constant() -> None:
    # Points an unconstrained fit explains with a negative attention term.
    raw = [(250, 0, 0.05), (1000, 0, 0.12), (3000, 0, 0.25), (200, 3000, 0.02)]
    pts = [Point("cold" if c == 0 else "cached", n, c, t, (t,)) for n, c, t in raw]
    fit = fit_prefill(pts)
    assert min(fit.values()) >= 0.0
