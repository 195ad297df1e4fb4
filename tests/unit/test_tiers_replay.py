"""The offline replay with HiCache workers (issue 20): ``--hicache`` builds the workers'
host tier, the gateway's index believes it (or not: ``--no-host-tier``), and the
summary splits the hit rate by tier and sets the host tokens predicted beside those the
workers reported."""

from __future__ import annotations

from typing import Any

import pytest

from loadtests.replay.report import table_rows
from loadtests.replay.run import ReplayConfig, config_from_args, replay

# 96 sessions of 5 turns over 8 workers of 12,000 tokens: the conversations overflow the
# GPUs, not their host tiers
WORKLOAD = ("sessions=96", "turns=5", "system_prompt_len=256", "user_len=600",
            "answer_len=100", "think_time_s=20", "session_rate=4")  # fmt: skip


def _run(**changes: Any) -> dict[str, Any]:
    config = ReplayConfig(workers=8, capacity_tokens=12_000, policy="min_ttft",
                          workload="multi-turn", workload_args=WORKLOAD, bounds=False,
                          **changes)  # fmt: skip
    summary, _ = replay(config)
    return summary


def test_hicache_workers_report_host_hits_the_index_predicts() -> None:
    plain = _run()
    assert plain["tiers"]["host_hit_rate"] == 0
    blind = _run(hicache=True, host_tier=False)
    aware = _run(hicache=True)
    assert blind["tiers"]["predicted_host_tokens"] == 0 < blind["tiers"]["reported_host_tokens"]
    tiers = aware["tiers"]
    assert tiers["host_hit_rate"] > blind["tiers"]["host_hit_rate"]
    assert tiers["predicted_host_tokens"] == pytest.approx(tiers["reported_host_tokens"], rel=0.2)
    assert aware["hit_rate"] > blind["hit_rate"] > plain["hit_rate"]
    rows = dict(table_rows(aware))
    assert "hit rate by tier: device / host" in rows
    assert "hit rate by tier: device / host" not in dict(table_rows(plain))


def test_exact_mode_reads_the_host_tier_from_the_events() -> None:
    aware = _run(hicache=True, exact=True, page_size=16, limit=200)
    tiers = aware["tiers"]
    assert tiers["reported_host_tokens"] > 0
    assert tiers["predicted_host_tokens"] == pytest.approx(tiers["reported_host_tokens"], rel=0.1)
    blind = _run(hicache=True, exact=True, page_size=16, limit=200, host_tier=False)
    assert blind["tiers"]["predicted_host_tokens"] == 0


def test_the_command_line_sets_the_tiers() -> None:
    import argparse

    from loadtests.replay.run import add_common_args

    parser = argparse.ArgumentParser()
    add_common_args(parser)
    ns = parser.parse_args(["--workload", "multi-turn", "--hicache", "--hicache-ratio", "3",
                            "--hicache-write-policy", "write_back", "--no-host-tier"])  # fmt: skip
    config = config_from_args(ns, 1.0)
    assert (config.hicache, config.hicache_ratio, config.hicache_write_policy) == (
        True, 3.0, "write_back",
    )  # fmt: skip
    assert config.host_tier is False and config.hicache_link == "pcie-gen5-x16"
    lora = ReplayConfig(workers=2, capacity_tokens=12_000, policy="min_ttft",
                        workload="lora-tenants", hicache=True, bounds=False, limit=5)  # fmt: skip
    with pytest.raises(ValueError, match="LoRA"):
        replay(lora)
