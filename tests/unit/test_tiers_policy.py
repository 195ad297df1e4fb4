"""Cache tiers in the policy and the telemetry (issue 20): ``min_ttft`` prices a host hit
by its load back (a GPU hit < a host hit < a miss), tier-blind when the load is free; the
relay reads ``cached_tokens_details`` from bodies and streams; decision records and
``gateway_prefix_tokens_total`` carry the host parts."""

from __future__ import annotations

import random
from contextvars import copy_context

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.forward.relay import CachedTiers, cached_tiers
from gateway.routing.decisions import CandidateScore, DecisionOutcome, DecisionRecord
from gateway.telemetry.hub import Telemetry
from policies.base import Decision, RouteContext, WorkerView
from policies.min_ttft import DEFAULT_HOST_LOAD_PER_TOKEN_S, MinTtftPolicy
from policies.registry import create_policy

PROMPT = 12_000


def _views(matched: int, host: int) -> WorkerView:
    return WorkerView(id="w", matched_tokens=matched, matched_host_tokens=host)


def test_a_host_hit_costs_between_a_gpu_hit_and_a_miss() -> None:
    policy = MinTtftPolicy()
    device, _ = policy.estimate(_views(11_900, 0), PROMPT)
    host, _ = policy.estimate(_views(11_900, 11_900), PROMPT)
    half, _ = policy.estimate(_views(11_900, 6_000), PROMPT)
    miss, _ = policy.estimate(_views(0, 0), PROMPT)
    assert device < half < host < miss
    # the load back: 0.2 ms + 2.45 us per token (PCIe 5.0 x16, Llama-3-8B's KV)
    assert host == pytest.approx(0.2e-3 + DEFAULT_HOST_LOAD_PER_TOKEN_S * 11_900 + 0.0)
    assert miss / host > 9  # a prefill is about nine times a load back


def test_a_load_shorter_than_the_compute_is_hidden_by_it() -> None:
    """SGLang loads layer by layer under the compute: the step takes the longer one."""
    policy = MinTtftPolicy()
    device, _ = policy.estimate(_views(2_000, 0), PROMPT)
    host, _ = policy.estimate(_views(2_000, 2_000), PROMPT)
    assert host == device


def test_tier_blind_prices_a_host_hit_as_a_gpu_hit() -> None:
    blind = MinTtftPolicy(host_load_per_token_s=0.0, host_load_fixed_s=0.0)
    assert blind.estimate(_views(11_900, 11_900), PROMPT) == blind.estimate(
        _views(11_900, 0), PROMPT
    )
    assert blind.describe()["host_load_per_token_s"] == 0.0
    made = create_policy("min_ttft", host_load_per_token_s=1e-6)
    assert isinstance(made, MinTtftPolicy) and made.describe()["host_load_per_token_s"] == 1e-6
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            MinTtftPolicy(host_load_per_token_s=bad)
        with pytest.raises(ValueError):
            MinTtftPolicy(host_load_fixed_s=bad)


def test_between_equal_matches_the_gpu_one_wins() -> None:
    """The same long prefix on one worker's GPU and another's host, both idle: the GPU
    holder is chosen; tier-blind, either (at random)."""
    views = [
        WorkerView(id="gpu", matched_tokens=11_900),
        WorkerView(id="host", matched_tokens=11_900, matched_host_tokens=11_900),
    ]
    ctx = RouteContext(prompt_tokens=PROMPT, candidates=views, rng=random.Random(0))
    picks = {MinTtftPolicy().select(ctx).worker_id for _ in range(20)}
    assert picks == {"gpu"}
    blind = MinTtftPolicy(host_load_per_token_s=0.0, host_load_fixed_s=0.0)
    rng = random.Random(1)
    blind_picks = {blind.select(RouteContext(PROMPT, views, rng)).worker_id for _ in range(40)}
    assert blind_picks == {"gpu", "host"}


# --- the relay reads cached_tokens_details -------------------------------------------


def test_cached_tiers_from_meta_info_sglext_and_streams() -> None:
    generate = {"text": "x", "meta_info": {"cached_tokens": 48,
                "cached_tokens_details": {"device": 16, "host": 32}}}  # fmt: skip
    assert cached_tiers(orjson.dumps(generate)) == CachedTiers(16, 32)
    chat = {"choices": [], "sglext": {"cached_tokens_details": {"device": 5, "host": 0,
            "storage": 7, "storage_backend": "mooncake"}}}  # fmt: skip
    assert cached_tiers(orjson.dumps(chat)) == CachedTiers(5, 0, 7)
    miss = {"meta_info": {"cached_tokens": 0, "cached_tokens_details": None}}
    assert cached_tiers(orjson.dumps(miss)) is None
    assert cached_tiers(b'{"usage": {"cached_tokens": 3}}') is None
    stream = b"".join(
        b"data: " + orjson.dumps(c) + b"\n\n"
        for c in (
            {"meta_info": {"cached_tokens_details": {"device": 1, "host": 2}}},
            {"meta_info": {"cached_tokens_details": {"host": 9, "device": 3}}},
        )
    )
    assert cached_tiers(stream) == CachedTiers(3, 9)  # the last one, keys in any order
    nested = b'{"cached_tokens_details": {"device": {"x": 1}, "host": 2}}'
    assert cached_tiers(nested) is None  # not SGLang's flat object: not read
    huge = b'{"cached_tokens_details": {"device": 1, "pad": "' + b"x" * 4096 + b'"}}'
    assert cached_tiers(huge) is None  # bounded: an object this long is not read


# --- decision records and metrics -------------------------------------------------------


def test_the_decision_record_carries_the_tiers() -> None:
    views = [WorkerView(id="w1", matched_tokens=64, matched_host_tokens=48),
             WorkerView(id="w2", matched_tokens=16)]  # fmt: skip
    rec = DecisionRecord.from_decision(
        request_id="r", policy="min_ttft", decision=Decision("w1", "prefix_hit"),
        candidates=views, prompt_tokens=100,
    )  # fmt: skip
    assert (rec.matched_tokens, rec.matched_host_tokens) == (64, 48)
    rec.outcome = DecisionOutcome(200, 0.1, 60, reported_device_tokens=12, reported_host_tokens=48)
    doc = rec.to_dict()
    assert doc["matched_host_tokens"] == 48
    assert doc["candidates"][0]["matched_host_tokens"] == 48
    assert "matched_host_tokens" not in doc["candidates"][1]  # nothing on its host
    assert (doc["outcome"]["reported_device_tokens"], doc["outcome"]["reported_host_tokens"]) == (
        12, 48,
    )  # fmt: skip


def _send(t: Telemetry, captured: int, host: int, reported: int | None,
          tiers: tuple[int, int] | None) -> None:  # fmt: skip
    def request() -> None:
        rt = t.begin_request("r", "/generate")
        rec = DecisionRecord(
            time=0.0, request_id="r", policy="p", worker="w1", reason="prefix_hit",
            candidates=(CandidateScore("w1", captured, None, host),), prompt_tokens=100,
            matched_tokens=captured, available_tokens=captured, matched_host_tokens=host,
        )  # fmt: skip
        rec.outcome = DecisionOutcome(
            200, 0.1, reported,
            reported_device_tokens=None if tiers is None else tiers[0],
            reported_host_tokens=None if tiers is None else tiers[1],
        )  # fmt: skip
        rt.decided(rec)
        rt.finish(200, reported_cached_tokens=reported)

    copy_context().run(request)


def test_prefix_tokens_count_the_host_parts() -> None:
    t = Telemetry()
    _send(t, 64, 0, 60, None)  # no HiCache: no host series at all
    text = t.render_prometheus().decode()
    assert 'kind="captured_host"' not in text and 'kind="delivered_host"' not in text
    _send(t, 64, 48, 60, (12, 48))
    _send(t, 32, 32, 30, (30, 0))  # believed on the host, found on the GPU
    _send(t, 16, 0, None, None)  # no report
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(t.render_prometheus().decode())
        for s in fam.samples
    }
    tokens = "gateway_prefix_tokens_total"
    assert samples[(tokens, (("kind", "captured_host"),))] == 48 + 32
    assert samples[(tokens, (("kind", "delivered_host"),))] == 48
    assert samples[(tokens, (("kind", "captured"),))] == 64 + 64 + 32 + 16
    model = "gateway_model_prefix_tokens_total"
    assert samples[(model, (("kind", "captured_host"), ("model", "other")))] == 80
    summary = t.capture.summary()
    assert (summary["captured_host_tokens"], summary["delivered_host_tokens"]) == (80, 48)
    assert summary["tier_reports"] == 2
    t.shutdown()
