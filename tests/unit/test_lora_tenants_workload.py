"""The ``lora-tenants`` workload (issue 19's adapter benchmark): one adapter and one
shared context per tenant, Zipf popularity over tenants, deterministic by seed; and the
benchmark's warm-up order."""

from __future__ import annotations

from collections import Counter

import pytest

from loadtests.workloads import create_workload
from loadtests.workloads.lora import adapter_name, warmup_orders, zipf_weights


def test_each_tenant_has_its_adapter_and_its_context() -> None:
    w = create_workload("lora-tenants", ["tenants=12", "num_requests=400", "seed=3"])
    contexts: dict[str, str] = {}
    for r in w.requests:
        assert r.group is not None and r.adapter == adapter_name(int(r.group[1:]))
        body = r.body(model="base")
        assert body["model"] == f"base:{r.adapter}"
        system = r.messages[0].content
        assert contexts.setdefault(r.adapter, system) == system  # one context per tenant
    assert len(set(contexts.values())) == len(contexts)  # and no two tenants share one
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests)


def test_popularity_is_zipf() -> None:
    n, s = 8, 1.0
    w = create_workload("lora-tenants", tenants=n, zipf_s=s, num_requests=6000, seed=1)
    counts = Counter(r.adapter for r in w.requests)
    weights = zipf_weights(n, s)
    assert sum(weights) == pytest.approx(1.0)
    for t in range(n):
        assert counts[adapter_name(t)] / 6000 == pytest.approx(weights[t], abs=0.02)
    assert counts[adapter_name(0)] > 2 * counts[adapter_name(3)]  # 1 vs 1/4


def test_deterministic_by_seed() -> None:
    def bodies(seed: int) -> list[tuple[float, object]]:
        w = create_workload("lora-tenants", tenants=6, num_requests=50, seed=seed)
        return [(r.arrival_s, r.body()) for r in w.requests]

    assert bodies(5) == bodies(5)
    assert bodies(5) != bodies(6)


def test_warmup_loads_every_adapter_and_stripes_the_last_ones() -> None:
    adapters = [adapter_name(t) for t in range(10)]
    orders = warmup_orders(adapters, workers=4, slots=3)
    for order in orders:
        assert sorted(order) == adapters  # each worker loads each adapter once
    assert [o[-3:] for o in orders] == [
        [adapters[k], adapters[k + 4], adapters[(k + 8) % 10]] for k in range(4)
    ]
