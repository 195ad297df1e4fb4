"""The llm-d tenant workload: sizing by KV capacity, staged Poisson ramp, inference-perf's
cycle over every (tenant, user) prompt."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loadtests.workloads import create_workload
from loadtests.workloads.arrivals import parse_stages, staged_arrivals
from loadtests.workloads.multi_tenant import (
    LLMD_POD_KV_TOKENS,
    LLMD_PODS,
    size_for_capacity,
    working_set_tokens,
)
from loadtests.workloads.text import PIECE_CHARS


def test_llmd_defaults_size_150_tenants_at_73_percent() -> None:
    capacity = LLMD_PODS * LLMD_POD_KV_TOKENS
    assert size_for_capacity(capacity, 0.73, 0, 6000, 5, 1200) == (150, 6000)
    assert working_set_tokens(150, 6000, 5, 1200) / capacity == pytest.approx(0.732, abs=1e-3)
    # sizing the context instead: 20 tenants at the same fraction
    tenants, context = size_for_capacity(capacity, 0.73, 20, 0, 5, 1200)
    assert tenants == 20
    assert working_set_tokens(20, context, 5, 1200) == pytest.approx(0.73 * capacity, abs=20)
    with pytest.raises(ValueError):
        size_for_capacity(capacity, 0.73, 10, 100, 5, 1200)  # neither left to size
    with pytest.raises(ValueError):
        size_for_capacity(1000, 0.73, 10, 0, 5, 1200)  # questions alone exceed it


def test_staged_arrivals_follow_each_stage_rate() -> None:
    stages = parse_stages("4:500,40:100")
    times = staged_arrivals(random.Random(1), stages)
    first = sum(1 for t in times if t < 500)
    second = sum(1 for t in times if 500 <= t < 600)
    assert first == pytest.approx(2000, rel=0.06) and second == pytest.approx(4000, rel=0.06)
    assert times == sorted(times) and times[-1] < 600
    with pytest.raises(ValueError):
        parse_stages("3:20,10")
    with pytest.raises(ValueError):
        parse_stages("0:20")


def test_tenants_workload_cycles_every_prompt_once_per_round() -> None:
    w = create_workload(
        "tenants",
        ["capacity_tokens=60000", "context_len=600", "question_len=60", "output_len=20",
         "users_per_tenant=3", "stages=10:50,30:30"],
    )  # fmt: skip
    p = w.params
    assert p["tenants"] == round(0.73 * 60000 / (600 + 3 * 60)) == 56
    prompts = p["tenants"] * 3
    assert len(w.requests) == pytest.approx(10 * 50 + 30 * 30, rel=0.1)
    assert all(r.max_tokens == 20 for r in w.requests)
    first_round = [r.session_id for r in w.requests[:prompts]]
    assert len(set(first_round)) == prompts  # each (tenant, user) exactly once
    second_round = [r.session_id for r in w.requests[prompts : 2 * prompts]]
    assert second_round == first_round  # the same shuffled order again
    for r in w.requests[:prompts]:
        system, question = r.messages
        assert len(system.content) == 600 * PIECE_CHARS
        assert len(question.content) == 60 * PIECE_CHARS  # no jitter, as inference-perf
    contexts: dict[str | None, set[str]] = {}
    for r in w.requests:
        contexts.setdefault(r.group, set()).add(r.messages[0].content)
    assert len(contexts) == 56 and all(len(c) == 1 for c in contexts.values())


def test_llmd_ramp_and_stage_scale() -> None:
    full = create_workload("tenants")
    assert full.params["tenants"] == 150
    # llm-d's stages: 50 s at 15 QPS, then 3 -> 60 QPS; ~17,000 requests over 502 s
    assert len(full.requests) == pytest.approx(17_084, rel=0.03)
    assert 495 < full.requests[-1].arrival_s < 502
    per_window = Counter(int(r.arrival_s // 25) for r in full.requests)
    assert per_window[19] > 10 * per_window[2]  # 60 QPS at the end, 3 QPS at 50-70 s
    quarter = create_workload("tenants", ["stage_scale=0.25"])
    assert len(quarter.requests) == pytest.approx(len(full.requests) / 4, rel=0.05)


def test_multi_tenant_keeps_its_uniform_picks_and_linear_ramp() -> None:
    w = create_workload("multi-tenant", ["tenants=4", "users_per_tenant=2",
                                          "num_requests=200"])  # fmt: skip
    assert len(w.requests) == 200 and w.params["order"] == "random"
    with pytest.raises(ValueError):
        create_workload("multi-tenant", ["order=sorted"])
