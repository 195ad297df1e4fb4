"""Decision records and the bounded decision log."""

from __future__ import annotations

import random

import orjson
import pytest

from gateway.routing.decisions import DecisionLog, DecisionOutcome, DecisionRecord
from policies.base import Decision, WorkerView


def make(i: int) -> DecisionRecord:
    return DecisionRecord(
        time=float(i), request_id=f"r{i}", policy="p", worker="w", reason="load", candidates=()
    )


def test_ring_is_bounded_and_newest_first() -> None:
    log = DecisionLog(capacity=5)
    for i in range(12):
        log.add(make(i))
    assert len(log) == 5
    assert [r.request_id for r in log.latest(3)] == ["r11", "r10", "r9"]
    assert [r.request_id for r in log.latest(100)] == ["r11", "r10", "r9", "r8", "r7"]
    assert log.latest(0) == []


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        DecisionLog(capacity=0)


def test_from_decision_keeps_candidates_scores_and_no_prompt() -> None:
    views = [WorkerView(id="w1", matched_tokens=48), WorkerView(id="w2", matched_tokens=0)]
    decision = Decision(worker_id="w1", reason="prefix_hit", scores={"w1": 0.2, "w2": 0.9})
    rec = DecisionRecord.from_decision(
        request_id="abc", policy="min_ttft", decision=decision, candidates=views,
        prompt_tokens=64, model="m", now=12.5,
    )  # fmt: skip
    assert rec.matched_tokens == 48
    assert rec.match_ratio == 0.75
    doc = rec.to_dict()
    assert doc["candidates"] == [
        {"worker": "w1", "matched_tokens": 48, "score": 0.2},
        {"worker": "w2", "matched_tokens": 0, "score": 0.9},
    ]
    assert doc["outcome"] is None
    rec.outcome = DecisionOutcome(200, 0.01, 40, 0, 0.2)
    doc = rec.to_dict()
    assert doc["outcome"]["reported_cached_tokens"] == 40
    assert set(doc) == {
        "time", "request_id", "model", "policy", "worker", "reason", "prompt_tokens",
        "matched_tokens", "matched_host_tokens", "available_tokens", "candidates", "outcome",
    }  # fmt: skip
    assert doc["available_tokens"] is None  # set by the router from the routing core's choice
    orjson.dumps(doc)


def test_non_finite_scores_serialise_as_null() -> None:
    views = [WorkerView(id="w1")]
    decision = Decision(worker_id="w1", reason="only_candidate", scores={"w1": float("inf")})
    rec = DecisionRecord.from_decision(
        request_id="x", policy="p", decision=decision, candidates=views, prompt_tokens=0
    )
    assert rec.to_dict()["candidates"][0]["score"] is None
    assert rec.match_ratio == 0.0


def test_random_traffic_never_exceeds_capacity() -> None:
    rng = random.Random(7)
    log = DecisionLog(capacity=64)
    for i in range(5000):
        log.add(make(i))
        assert len(log) <= 64
        k = rng.randint(1, 100)
        got = log.latest(k)
        assert len(got) == min(k, len(log))
        assert got[0].request_id == f"r{i}"
