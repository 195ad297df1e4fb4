"""Routing capture, live (issue 22): per request the longest match on any candidate
(available, ``Choice.available_tokens``), the match at the chosen worker (captured) and
the worker's reported cached tokens (delivered); the routing core's rule, the decision
record, the ``gateway_prefix_tokens`` / ``gateway_prefix_capture_requests`` families (and
their per-model split) with honest denominators, and ``/dashboard/data``."""

from __future__ import annotations

import random
from contextvars import copy_context
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import make_policy_set
from gateway.config import config_from_dict
from gateway.http.debug import dashboard_data
from gateway.routing.cost_model import CostModel
from gateway.routing.decide import RoutingCore
from gateway.routing.decisions import CandidateScore, DecisionLog, DecisionRecord
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RouteRequest
from gateway.telemetry.hub import Telemetry
from gateway.workers.registry import Worker, WorkerRegistry

HASHES = [11, 12, 13, 14]  # four 64-character blocks of a 256-character prompt, 64 tokens


# --- the routing core's rule -----------------------------------------------------------


def _request(kind: ApiKind = ApiKind.CHAT) -> RouteRequest:
    hashes = [] if kind is ApiKind.EMBEDDINGS else list(HASHES)
    return RouteRequest(
        kind=kind, model=None, stream=False, include_usage=False, prompt_chars=256,
        prompt_tokens=64, block_hashes=hashes, routing_key=None, rid=None, body=b"{}",
    )  # fmt: skip


def _workers(n: int = 3) -> list[Worker]:
    registry = WorkerRegistry(0.5)
    for i in range(n):
        worker, _ = registry.add(f"http://127.0.0.1:{18101 + i}", "sglang")
        worker.flags.clear()
    return list(registry)


def _core(**policy: Any) -> tuple[RoutingCore, PrefixIndex]:
    index = PrefixIndex(block_tokens=16.0, max_blocks_per_worker=1000)
    cfg = config_from_dict({"policy": policy})
    return RoutingCore(make_policy_set(cfg.policy), index, CostModel(), random.Random(0)), index


def test_available_is_the_longest_match_on_any_candidate() -> None:
    core, index = _core(name="cache_aware")
    workers = _workers()
    index.record(HASHES[:3], workers[1].id)  # 3 of 4 blocks: 48 tokens
    index.record(HASHES[:1], workers[2].id)  # 16 tokens
    choice = core.choose(_request(), workers, 0.0)
    assert choice.indexed
    assert choice.available_tokens == 48 == max(v.matched_tokens for v in choice.views)
    assert choice.worker.id == workers[1].id and choice.matched_tokens == 48  # captured all


def test_a_policy_that_ignores_the_match_leaves_available_unknown() -> None:
    """round_robin consults no index: the fleet's best match is not computed (it would
    cost an index match per request), so available is None, not 0."""
    core, index = _core(name="round_robin")
    workers = _workers()
    index.record(HASHES, workers[0].id)
    choice = core.choose(_request(), workers, 0.0)
    assert not choice.indexed and choice.available_tokens is None
    cache_aware, _ = _core(name="cache_aware")
    embeddings = cache_aware.choose(_request(ApiKind.EMBEDDINGS), workers, 0.0)
    assert embeddings.available_tokens is None  # nothing hashed: no index consulted


def test_a_shadow_that_matches_makes_available_known_under_round_robin() -> None:
    """A shadow that reads the match has the index matched for every request, so the
    live round_robin's captured can be compared with what was available."""
    core, index = _core(name="round_robin", shadows=["cache_aware"])
    workers = _workers()
    index.record(HASHES, workers[0].id)
    picks = [core.choose(_request(), workers, 0.0) for _ in range(3)]
    assert {c.available_tokens for c in picks} == {64}
    assert {c.worker.id for c in picks} == {w.id for w in workers}  # it rotates
    assert sorted(c.matched_tokens for c in picks) == [0, 0, 64]  # captured < available twice


# --- telemetry -------------------------------------------------------------------------


def _record(captured: int, available: int | None, worker: str = "w1") -> DecisionRecord:
    cands = (CandidateScore(worker, captured), CandidateScore("w9", available or 0))
    return DecisionRecord(
        time=0.0, request_id="r", policy="p", worker=worker, reason="prefix_hit",
        candidates=cands, prompt_tokens=100, matched_tokens=captured,
        available_tokens=available,
    )  # fmt: skip


def _send(
    t: Telemetry, captured: int, available: int | None, delivered: int | None,
    status: int = 200, model: str | None = None,
) -> None:  # fmt: skip
    """One request's telemetry, in a context of its own (begin_request binds the request
    to the caller's context)."""

    def request() -> None:
        rt = t.begin_request("r", "/v1/chat/completions")
        rt.model_label = t.model_label(model)
        rt.decided(_record(captured, available))
        rt.finish(status, reported_cached_tokens=delivered)

    copy_context().run(request)


def _samples(t: Telemetry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = t.render_prometheus().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_families_sum_available_captured_delivered_over_honest_denominators() -> None:
    t = Telemetry()
    _send(t, 40, 100, 30, model="llama")  # reported
    _send(t, 0, 60, 0, model="llama")  # reported: a miss where 60 were available
    _send(t, 20, 50, None, model="qwen")  # a stream without usage: no report
    _send(t, 0, None, 10, model="qwen")  # round_robin: no index, available unknown
    _send(t, 10, 10, None)  # no model served: `other`
    _send(t, 90, 90, 90, status=502)  # failed: not counted
    s = _samples(t)
    tokens = {k: _value(s, "gateway_prefix_tokens_total", kind=k) for k in (
        "available", "captured", "delivered", "reported_available")}  # fmt: skip
    assert tokens == {
        "available": 100 + 60 + 50 + 10,
        "captured": 40 + 0 + 20 + 10,
        "delivered": 30 + 0,
        "reported_available": 100 + 60,  # delivered's denominator: the reported ones only
    }
    requests = "gateway_prefix_capture_requests_total"
    assert _value(s, requests, available="known", delivered="reported") == 2
    assert _value(s, requests, available="known", delivered="unreported") == 2
    assert _value(s, requests, available="unknown", delivered="reported") == 1
    assert (requests, (("available", "unknown"), ("delivered", "unreported"))) not in s
    model = "gateway_model_prefix_tokens_total"
    assert _value(s, model, model="llama", kind="available") == 160
    assert _value(s, model, model="llama", kind="delivered") == 30
    assert _value(s, model, model="qwen", kind="captured") == 20
    assert (
        "gateway_model_prefix_tokens_total",
        (("kind", "delivered"), ("model", "qwen")),
    ) not in s
    assert _value(s, "gateway_model_prefix_capture_requests_total", model="qwen",
                  available="unknown", delivered="reported") == 1  # fmt: skip
    summary = t.capture.summary()
    assert summary["captured_over_available"] == pytest.approx(70 / 220)
    assert summary["delivered_over_available"] == pytest.approx(30 / 160)
    assert (summary["requests"], summary["reported_requests"]) == (4, 2)
    assert (summary["unreported_requests"], summary["unindexed_requests"]) == (2, 1)
    t.shutdown()


def test_without_requests_the_ratios_are_none_and_delivered_is_not_capped() -> None:
    t = Telemetry()
    empty = t.capture.summary()
    assert empty["captured_over_available"] is None
    assert empty["delivered_over_available"] is None
    # a sibling prefilled just before can make the worker report more than was available
    _send(t, 10, 10, 25)
    assert t.capture.summary()["delivered_over_available"] == 2.5
    t.shutdown()


def test_dashboard_data_has_the_two_ratios_and_the_requests_behind_them() -> None:
    t = Telemetry()
    log = DecisionLog()
    _send(t, 30, 60, 30, model="llama")
    _send(t, 0, 40, None, model="llama")
    doc = dashboard_data(t, log)
    capture = doc["routing_capture"]
    assert capture["captured_over_available"] == pytest.approx(30 / 100)
    assert capture["delivered_over_available"] == pytest.approx(30 / 60)
    assert (capture["requests"], capture["reported_requests"]) == (2, 1)
    assert capture["unreported_requests"] == 1 and capture["unindexed_requests"] == 0
    (llama,) = doc["models"]
    assert llama["routing_capture"] == capture  # the only model
    t.shutdown()


def test_the_decision_record_carries_available() -> None:
    rec = _record(12, 48)
    assert rec.to_dict()["available_tokens"] == 48
    assert _record(12, None).to_dict()["available_tokens"] is None
