"""least_load: power of two choices on in-flight + engine queue."""

import random
from collections import Counter

import pytest

from policies.base import REASON_LOAD, REASON_ONLY_CANDIDATE, EngineLoad, RouteContext, WorkerView
from policies.registry import create_policy


def ctx(workers: list[WorkerView], seed: int = 0) -> RouteContext:
    return RouteContext(prompt_tokens=100, candidates=workers, rng=random.Random(seed))


def test_picks_lower_of_the_two_sampled() -> None:
    policy = create_policy("least_load")
    workers = [WorkerView("busy", in_flight=10), WorkerView("idle", in_flight=0)]
    for seed in range(20):
        decision = policy.select(ctx(workers, seed))
        assert decision.worker_id == "idle"
        assert decision.reason == REASON_LOAD
        assert decision.scores == {"busy": 10.0, "idle": 0.0}


def test_engine_queue_counts() -> None:
    policy = create_policy("least_load")
    queued = EngineLoad(waiting_requests=7)
    workers = [WorkerView("a", in_flight=2, engine_load=queued), WorkerView("b", in_flight=5)]
    assert policy.select(ctx(workers)).worker_id == "b"


def test_ties_at_random() -> None:
    policy = create_policy("least_load")
    workers = [WorkerView(f"w{i}") for i in range(2)]
    seen = Counter(policy.select(ctx(workers, s)).worker_id for s in range(200))
    assert set(seen) == {"w0", "w1"} and min(seen.values()) > 50


def test_never_picks_the_busiest_of_many() -> None:
    policy = create_policy("least_load")
    workers = [WorkerView(f"w{i}", in_flight=i) for i in range(5)]
    rng = random.Random(3)
    chosen = Counter(policy.select(RouteContext(100, workers, rng)).worker_id for _ in range(500))
    assert "w4" not in chosen
    assert chosen["w0"] > chosen["w3"]


def test_full_sample_is_plain_least_load() -> None:
    policy = create_policy("least_load", sample_size=10)
    workers = [WorkerView(f"w{i}", in_flight=5 - i) for i in range(5)]
    assert all(policy.select(ctx(workers, s)).worker_id == "w4" for s in range(20))


def test_single_candidate_and_bad_params() -> None:
    policy = create_policy("least_load")
    assert policy.select(ctx([WorkerView("only")])).reason == REASON_ONLY_CANDIDATE
    with pytest.raises(ValueError):
        create_policy("least_load", sample_size=0)
