import random

from hypothesis import given, settings
from hypothesis import strategies as st

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

    expected = {"round_robin", "random", "least_load", "cache_aware", "consistent_hash", "min_ttft",
                "dynamo_kv", "llmd_scorers", "preble_e2", "aibrix_prefix"}  # fmt: skip
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


def _views() -> st.SearchStrategy[list[WorkerView]]:
    from policies.base import EngineLoad, WorkerCost

    engine = st.one_of(
        st.none(),
        st.builds(
            EngineLoad,
            running_requests=st.integers(0, 500),
            waiting_requests=st.integers(0, 500),
            waiting_uncached_tokens=st.one_of(st.none(), st.integers(0, 10**6)),
        ),
    )
    cost = st.builds(
        WorkerCost,
        prefill_per_token_s=st.one_of(st.none(), st.floats(1e-7, 1e-3)),
        prefill_fixed_s=st.one_of(st.none(), st.floats(0.0, 0.5)),
    )
    view = st.builds(
        WorkerView,
        id=st.text("abcdef", min_size=1, max_size=4),
        in_flight=st.integers(0, 300),
        queued_prefill_tokens=st.integers(0, 10**6),
        decoding_requests=st.integers(0, 300),
        engine_load=engine,
        matched_tokens=st.integers(0, 10**5),
        cost=cost,
    )
    return st.lists(view, min_size=1, max_size=8, unique_by=lambda v: v.id)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_policy_tolerates_any_context(data: st.DataObject) -> None:
    from policies.base import REASONS
    from policies.registry import policy_names

    views = data.draw(_views())
    prompt = data.draw(st.integers(0, 10**5))
    key = data.draw(st.one_of(st.none(), st.text(max_size=8)))
    ids = {v.id for v in views}
    for name in policy_names():
        policy = create_policy(name)
        for seed in range(3):
            ctx = RouteContext(prompt, views, random.Random(seed), routing_key=key)
            decision = policy.select(ctx)
            assert decision.worker_id in ids and decision.reason in REASONS, name
