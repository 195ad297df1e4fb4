"""A LoRA adapter's load time counts in the choice: min_ttft weighs ``setup_s``, and a
hot adapter's busy holders compete with idle workers that would load it (replication)."""

from __future__ import annotations

import random

from gateway.config import LoraConfig
from gateway.routing.lora import DEFAULT_LOAD_S, AdapterLoads, lora_candidates
from gateway.workers.registry import WorkerMetadata, WorkerRegistry
from policies.base import RouteContext, WorkerCost, WorkerView
from policies.min_ttft import MinTtftPolicy
from policies.round_robin import RoundRobinPolicy

COST = WorkerCost(prefill_per_token_s=1e-4, prefill_fixed_s=0.01, decode_step_s=0.01)


def _pick(holder_queue: int, setup_s: float) -> str:
    views = [
        WorkerView("holder", in_flight=4, queued_prefill_tokens=holder_queue, cost=COST),
        WorkerView("spare", cost=COST, setup_s=setup_s),
    ]
    ctx = RouteContext(prompt_tokens=500, candidates=views, rng=random.Random(0))
    return MinTtftPolicy().select(ctx).worker_id


def test_min_ttft_weighs_the_load_time() -> None:
    assert MinTtftPolicy.weighs_setup and not RoundRobinPolicy.weighs_setup
    assert _pick(holder_queue=0, setup_s=0.5) == "holder"  # an idle holder: no load
    assert _pick(holder_queue=50_000, setup_s=0.5) == "spare"  # 5 s of queue: load it
    assert _pick(holder_queue=50_000, setup_s=60.0) == "holder"  # a load dearer still


def _fleet() -> WorkerRegistry:
    reg = WorkerRegistry(0.5, lambda: 0.0)
    for port, adapters in ((1, {"a": "/lora/a"}), (2, {}), (3, {})):
        w, _ = reg.add(f"http://127.0.0.1:{port}", "sglang")
        w.flags.clear()
        w.metadata = WorkerMetadata(model="base", lora_enabled=port != 3)
        reg.set_adapters(w, adapters)
    return reg


def test_holders_are_offered_with_loadable_others_when_asked() -> None:
    reg = _fleet()
    holders = reg.candidates((), "base", "a")
    others = [w for w in reg.candidates((), "base") if "a" not in w.adapters]
    loads = AdapterLoads()
    plain = lora_candidates(holders, "a", LoraConfig(), reg, loads)
    assert [w.url for w in plain[0]] == ["http://127.0.0.1:1"] and plain[1:] == (None, {})
    widened, path, setup = lora_candidates(holders, "a", LoraConfig(), reg, loads, others)
    # worker 3 is not LoRA-enabled: never offered
    assert [w.url for w in widened] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert path == "/lora/a" and setup == {widened[1].id: DEFAULT_LOAD_S}
    assert lora_candidates(holders, "a", LoraConfig(unloaded="reject"), reg, loads, others)[1:] == (
        None,
        {},
    )
    spent = AdapterLoads(tokens=0.0)  # no load could start now: holders only
    assert (
        lora_candidates(holders, "a", LoraConfig(load_rate_per_s=0.001), reg, spent, others)[1]
        is None
    )


def test_the_load_time_is_learnt_from_timed_loads() -> None:
    loads = AdapterLoads()
    for _ in range(40):
        loads.timed(0.2)
    assert abs(loads.load_s - 0.2) < 0.01


def test_min_ttft_keeps_each_models_shares_apart() -> None:
    """Ten models of two workers each: one model's decisions must not reset another's
    shares (the bounded-load memory used to forget every worker not offered right now)."""
    policy = MinTtftPolicy()
    rng = random.Random(0)
    fleets = [[WorkerView(f"m{m}-w{i}", cost=COST) for i in range(2)] for m in range(10)]
    for _ in range(50):
        for fleet in fleets:
            policy.select(RouteContext(prompt_tokens=100, candidates=fleet, rng=rng))
    shares = policy._shares
    assert len(shares) == 20
    for fleet in fleets:
        assert abs(sum(shares[w.id] for w in fleet) - 1.0) < 1e-6


def test_replicas_are_offered_only_when_configured_and_full_slots_cost_twice() -> None:
    from gateway.routing.lora import adapter_candidates

    reg = _fleet()
    holders = reg.candidates((), "base", "a")
    off = adapter_candidates(reg, holders, (), "base", "a", LoraConfig(), AdapterLoads(), True)
    assert [w.url for w in off[0]] == ["http://127.0.0.1:1"]
    on_cfg = LoraConfig(replicate=True)
    blind = adapter_candidates(reg, holders, (), "base", "a", on_cfg, AdapterLoads(), False)
    assert [w.url for w in blind[0]] == ["http://127.0.0.1:1"]  # the policy ignores load time
    spare = reg.find("http://127.0.0.1:2")
    assert spare is not None
    spare.metadata.max_loaded_loras = 1
    reg.set_adapters(spare, {"b": "/lora/b"})  # its one slot is taken: a load evicts "b"
    on = adapter_candidates(reg, holders, (), "base", "a", on_cfg, AdapterLoads(), True)
    assert [w.url for w in on[0]] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert on[2] == {spare.id: 2 * DEFAULT_LOAD_S}
