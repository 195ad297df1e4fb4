"""``python -m loadtests.micro.kv_events --workload tenants``: llm-d's tenant workload
live, open loop through the in-process gateway, one fresh fleet per mode."""

from __future__ import annotations

from loadtests.micro.kv_events import (
    DEFAULT_MODES,
    MODES,
    Args,
    fleet_config,
    gateway_overrides,
    run_tenant_mode,
    tenant_items,
    tenant_report,
)

SMALL = ["context_len=300", "question_len=40", "output_len=8", "users_per_tenant=3",
         "stages=20:3"]  # fmt: skip


def test_default_modes_and_real_tokenizer_wiring() -> None:
    assert DEFAULT_MODES == ("approximate", "exact", "hybrid")  # the historical default
    assert MODES["random"]["policy__name"] == "random"
    args = Args(tokenizer_path="/models/qwen")
    assert fleet_config(args).tokenizer_path == "/models/qwen"
    assert gateway_overrides("hybrid", args)["kv_events__tokenizer"] == "hf:/models/qwen"
    assert "kv_events__tokenizer" not in gateway_overrides("hybrid", Args())  # the simulator's


async def test_tenants_live_exact_and_random() -> None:
    args = Args(workers=2, capacity_tokens=6000, speed=10.0, workload="tenants")
    items, about = tenant_items(args, SMALL)
    assert "0.73 of 2 x 6,000" in about
    assert 40 <= len(items) <= 90
    assert all(b.at_s <= 3 / 10 for b in items)  # modelled seconds / speed
    results = {m: await run_tenant_mode(m, args, items) for m in ("hybrid", "random")}
    for r in results.values():
        assert len(r.outcomes) == len(items) and all(o.ok for o in r.outcomes)
        assert all(o.completion_tokens == 8 for o in r.outcomes)
    exact = results["hybrid"]
    assert exact.modes.get("exact", 0) > 0  # decisions made on the workers' events
    # mostly true: at speed 10 a CPU-starved loop (the shared 2-core machine under other
    # work) delays the events that confirm hybrid predictions, and a lagging index then
    # over-predicts a little (0.84-1.0 measured over 20 runs at load 4-5, the code of
    # the session before and after alike); 0.8 keeps "mostly confirmed by the events"
    assert exact.predicted > 0 and exact.true_predicted >= 0.8 * exact.predicted
    table = tenant_report(results)
    assert table.count("\n") == 3 and "| random |" in table
