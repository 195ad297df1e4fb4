"""The A/B arms' statistics and the policy set's split (gateway.telemetry.tuning,
gateway.routing.policy_set, gateway.config.policyspec)."""

from __future__ import annotations

import random

import pytest

from gateway.config.policyspec import parse_policy_spec
from gateway.routing.policy_set import ARM_B, PolicySet
from gateway.routing.request import ApiKind, RequestSettings, RouteRequest, parse_request
from gateway.telemetry.tuning import (
    NO_DIFFERENCE,
    ABStats,
    quantile_interval,
    ratio_interval,
)
from policies.registry import create_policy


def test_quantile_interval_covers_the_true_median() -> None:
    rng = random.Random(1)
    covered = 0
    for _ in range(200):
        sample = [rng.random() for _ in range(200)]  # true median 0.5
        ci = quantile_interval(sample, 0.5)
        assert ci.low is not None and ci.high is not None and ci.value is not None
        assert ci.low <= ci.value <= ci.high
        covered += ci.low <= 0.5 <= ci.high
    assert 180 <= covered <= 200  # a 95 % interval: about 190 of 200
    assert quantile_interval([1.0] * 10, 0.99).low is None  # too few to bound a tail
    assert quantile_interval([], 0.5).value is None


def test_ratio_interval_of_cached_fractions() -> None:
    rng = random.Random(2)
    prompts = [rng.randint(500, 1500) for _ in range(400)]
    cached = [round(p * min(1.0, max(0.0, rng.gauss(0.6, 0.2)))) for p in prompts]
    ci = ratio_interval(cached, prompts)
    assert ci.value == pytest.approx(sum(cached) / sum(prompts))
    assert ci.low is not None and ci.high is not None
    assert ci.low < 0.6 < ci.high and ci.high - ci.low < 0.06


def test_a_real_difference_is_told_from_noise() -> None:
    rng = random.Random(3)
    same, better = ABStats(), ABStats()
    for _ in range(300):
        for stats, b_hit in ((same, 0.5), (better, 0.8)):
            stats.add("A", rng.uniform(0.1, 0.3), round(1000 * rng.uniform(0.4, 0.6)), 1000)
            stats.add(
                "B",
                rng.uniform(0.1, 0.3),
                round(1000 * rng.uniform(b_hit - 0.1, b_hit + 0.1)),
                1000,
            )
    assert same.summary()["verdict"]["cached_fraction"] == NO_DIFFERENCE
    assert better.summary()["verdict"]["cached_fraction"] == "B better"
    assert better.summary()["verdict"]["ttft_p50_s"] == NO_DIFFERENCE


def _req(key: str | None, text: str = "x" * 200) -> RouteRequest:
    headers = {"x-session-id": key} if key else {}
    body = b'{"messages":[{"role":"user","content":"%s"}]}' % text.encode()
    return parse_request(ApiKind.CHAT, body, headers, RequestSettings())


def test_the_split_is_stable_and_proportional() -> None:
    policies = PolicySet(create_policy("cache_aware"), ab=create_policy("round_robin"),
                         ab_fraction=0.25)  # fmt: skip
    arms = [policies.arm(_req(f"session-{i}"))[0] for i in range(2000)]
    assert 0.21 < arms.count(ARM_B) / 2000 < 0.29
    assert [policies.arm(_req(f"session-{i}"))[0] for i in range(2000)] == arms
    no_split = PolicySet(create_policy("cache_aware"))
    assert no_split.arm(_req("s"))[0] is None
    with pytest.raises(ValueError):
        PolicySet(create_policy("cache_aware"), ab_fraction=1.5)


def test_policy_specs() -> None:
    assert parse_policy_spec("min_ttft") == ("min_ttft", {})
    assert parse_policy_spec("cache_aware:cache_threshold=0.5, balance_abs_threshold=8") == (
        "cache_aware",
        {"cache_threshold": 0.5, "balance_abs_threshold": 8},
    )
    for bad in ("", ":x=1", "min_ttft:work_weight", "min_ttft:=1"):
        with pytest.raises(ValueError):
            parse_policy_spec(bad)
