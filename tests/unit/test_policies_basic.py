import random

from policies.base import RouteContext, WorkerView
from policies.registry import create_policy


def _ctx(n: int, seed: int = 0) -> RouteContext:
    return RouteContext(
        prompt_tokens=10,
        candidates=[WorkerView(id=f"w{i}") for i in range(n)],
        rng=random.Random(seed),
    )


def test_round_robin_cycles() -> None:
    policy = create_policy("round_robin")
    chosen = [policy.select(_ctx(3)).worker_id for _ in range(6)]
    assert chosen == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_random_covers_all() -> None:
    policy = create_policy("random")
    ctx = _ctx(4, seed=1)
    assert {policy.select(ctx).worker_id for _ in range(200)} == {"w0", "w1", "w2", "w3"}


def test_unknown_policy_named() -> None:
    try:
        create_policy("nope")
    except ValueError as exc:
        assert "nope" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_registry_lists_every_policy_and_the_default() -> None:
    from policies.registry import DEFAULT_POLICY, policy_names

    expected = {"round_robin", "random", "least_load", "cache_aware", "consistent_hash", "min_ttft"}
    assert set(policy_names()) == expected
    assert DEFAULT_POLICY == "min_ttft"


def test_every_policy_returns_a_candidate_with_a_known_reason() -> None:
    from policies.base import REASONS, EngineLoad
    from policies.registry import policy_names

    views = [
        WorkerView(
            id="a", in_flight=3, matched_tokens=40, engine_load=EngineLoad(waiting_requests=2)
        ),
        WorkerView(id="b", in_flight=0),
        WorkerView(id="c", in_flight=1, queued_prefill_tokens=500, decoding_requests=1),
    ]
    for name in policy_names():
        policy = create_policy(name)
        for key in (None, "session"):
            ctx = RouteContext(
                prompt_tokens=100, candidates=views, rng=random.Random(0), routing_key=key
            )
            decision = policy.select(ctx)
            assert decision.worker_id in {"a", "b", "c"}, name
            assert decision.reason in REASONS, name
            assert set(decision.scores) <= {"a", "b", "c"}
        assert policy.describe()["name"] == name


def test_bad_parameter_named() -> None:
    try:
        create_policy("min_ttft", no_such_knob=1)
    except ValueError as exc:
        assert "min_ttft" in str(exc)
    else:
        raise AssertionError("expected ValueError")
