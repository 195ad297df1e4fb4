"""consistent_hash: key affinity on a ring, bounded load, ring rebuilt only on change."""

import math
import random
from collections import Counter

import pytest

from policies.base import REASON_AFFINITY, REASON_LOAD, RouteContext, WorkerView
from policies.consistent_hash import ConsistentHashPolicy
from policies.registry import create_policy


def workers(n: int, loads: dict[str, int] | None = None) -> list[WorkerView]:
    loads = loads or {}
    return [WorkerView(f"w{i}", in_flight=loads.get(f"w{i}", 0)) for i in range(n)]


def ctx(cands: list[WorkerView], key: str | None, seed: int = 0) -> RouteContext:
    return RouteContext(
        prompt_tokens=10, candidates=cands, rng=random.Random(seed), routing_key=key
    )


def test_capability() -> None:
    policy = create_policy("consistent_hash")
    assert policy.uses_routing_key and not policy.uses_prefix_match


def test_same_key_same_worker_and_keys_spread() -> None:
    policy = create_policy("consistent_hash")
    cands = workers(4)
    owners = {}
    for k in range(400):
        key = f"session-{k}"
        first = policy.select(ctx(cands, key, seed=k))
        assert first.reason == REASON_AFFINITY
        assert all(
            policy.select(ctx(cands, key, seed=s)).worker_id == first.worker_id for s in range(3)
        )
        owners[key] = first.worker_id
    spread = Counter(owners.values())
    assert len(spread) == 4 and min(spread.values()) > 50  # 160 virtual nodes: fairly even


def test_removing_a_worker_moves_only_its_keys() -> None:
    policy = create_policy("consistent_hash")
    four, three = workers(4), workers(3)
    keys = [f"k{i}" for i in range(300)]
    before = {k: policy.select(ctx(four, k)).worker_id for k in keys}
    after = {k: policy.select(ctx(three, k)).worker_id for k in keys}
    for k in keys:
        if before[k] != "w3":
            assert after[k] == before[k]


def test_bounded_load_walks_the_ring() -> None:
    policy = create_policy("consistent_hash", load_factor=1.25)
    cands = workers(4)
    owner = policy.select(ctx(cands, "hot")).worker_id
    loaded = workers(4, {owner: 10})  # total 11 -> cap ceil(1.25 * 11 / 4) = 4
    decision = policy.select(ctx(loaded, "hot"))
    assert decision.worker_id != owner and decision.reason == REASON_LOAD


@pytest.mark.parametrize("eps", [1.0, 1.25, 2.0])
def test_no_worker_above_bound_under_one_hot_key(eps: float) -> None:
    policy = ConsistentHashPolicy(load_factor=eps)
    loads = {f"w{i}": 0 for i in range(5)}
    rng = random.Random(1)
    for step in range(300):
        cands = [WorkerView(w, in_flight=n) for w, n in loads.items()]
        key = "hot" if step % 4 else f"k{rng.randrange(50)}"
        chosen = policy.select(RouteContext(10, cands, rng, routing_key=key)).worker_id
        total = sum(loads.values()) + 1
        assert loads[chosen] + 1 <= math.ceil(eps * total / len(loads))
        loads[chosen] += 1


def test_no_key_falls_back_to_least_load_random_ties() -> None:
    policy = create_policy("consistent_hash")
    cands = workers(3, {"w0": 4})
    seen = Counter(policy.select(ctx(cands, None, seed=s)).worker_id for s in range(100))
    assert set(seen) == {"w1", "w2"}
    assert policy.select(ctx(cands, None)).reason == REASON_LOAD


def test_ring_rebuilt_only_when_candidates_change() -> None:
    policy = ConsistentHashPolicy()
    cands = workers(4)
    for i in range(20):
        policy.select(ctx(cands, f"k{i}"))
    assert policy.rebuilds == 1
    policy.select(ctx(workers(4, {"w1": 3}), "k"))  # loads changed, set did not
    assert policy.rebuilds == 1
    policy.select(ctx(workers(3), "k"))
    policy.select(ctx(cands, "k"))  # back to the cached four-worker ring
    assert policy.rebuilds == 2


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        create_policy("consistent_hash", load_factor=0.9)
    with pytest.raises(ValueError):
        create_policy("consistent_hash", virtual_nodes=0)
