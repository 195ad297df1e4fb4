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
