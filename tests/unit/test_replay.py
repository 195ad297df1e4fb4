"""Offline replay: end to end on small slices, prompt preparation, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.routing.request import RequestSettings
from loadtests.replay.cli import main
from loadtests.replay.hashes import parse_body
from loadtests.replay.prompts import PromptBuilder
from loadtests.replay.run import ReplayConfig, run_replay
from loadtests.replay.sim import Simulation
from loadtests.replay.workers import make_workers
from loadtests.workloads import create_workload
from policies.registry import create_policy
from simulator.model.radix_cache import encode_tokens
from simulator.model.tokenizer import default_tokenizer

SYNTHETIC = str(Path(__file__).resolve().parents[2] / "loadtests/data/mooncake_synthetic.jsonl")


def test_cli_writes_summary_within_bounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:  # fmt: skip
    out = tmp_path / "run"
    code = main(["--trace", SYNTHETIC, "--workers", "4", "--capacity-tokens", "200000",
                 "--policy", "min_ttft", "--limit", "60", "--out", str(out)])  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    bounds = summary["bounds"]
    assert 0.0 <= summary["hit_rate"] <= bounds["opt"] <= bounds["infinite"] <= 1.0
    assert set(summary["ttft_s"]) == {"p50", "p90", "p99", "mean"}
    assert summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"]
    assert summary["requests"] == summary["completed"] == 60
    assert abs(sum(summary["worker_share"].values()) - 1.0) < 1e-9
    assert (out / "summary.md").exists()
    assert "hit rate" in capsys.readouterr().out


def test_prepared_trace_request_equals_the_slow_path() -> None:
    builder = PromptBuilder()
    req = create_workload("mooncake", ["limit=3"]).requests[2]
    prepared = builder.prepare(req)
    slow = parse_body(req, RequestSettings(), "default")
    assert prepared.route.block_hashes == slow.block_hashes
    expected = default_tokenizer().encode_chat(req.chat_messages())
    assert prepared.prompt_key == encode_tokens(expected)
    blocks = builder.bound_blocks(req)
    assert sum(blocks.tokens) == len(expected)


def test_prepared_chat_request_and_segment_blocks() -> None:
    builder = PromptBuilder()
    w = create_workload("multi-turn", ["sessions=2", "turns=3", "user_len=40", "answer_len=30"])
    for req in w.requests:
        prepared = builder.prepare(req)
        expected = default_tokenizer().encode_chat(req.chat_messages())
        assert prepared.prompt_key == encode_tokens(expected)
        blocks = builder.bound_blocks(req)
        assert sum(blocks.tokens) == len(expected)
    # Turn 2 of a session starts with every block of turn 1 but the generation prompt.
    first, second = [r for r in w.requests if r.session_id == "s0"][:2]
    a, b = builder.bound_blocks(first).ids, builder.bound_blocks(second).ids
    assert b[: len(a) - 1] == a[:-1]


def _run(policy: str, workload: list[str], limit: int = 0) -> dict[str, object]:
    config = ReplayConfig(workers=4, capacity_tokens=60_000, policy=policy,
                          workload="generated-shared-prefix", workload_args=tuple(workload),
                          limit=limit, seed=3)  # fmt: skip
    return run_replay(config)


GSP = ["num_groups=8", "prompts_per_group=8", "system_prompt_len=512", "question_len=32",
       "output_len=16", "request_rate=20"]  # fmt: skip


def test_replay_is_deterministic_and_cache_aware_beats_round_robin() -> None:
    a = _run("cache_aware", GSP)
    b = _run("cache_aware", GSP)
    assert a["hit_rate"] == b["hit_rate"] and a["ttft_s"] == b["ttft_s"]
    rr = _run("round_robin", GSP)
    assert isinstance(a["hit_rate"], float) and isinstance(rr["hit_rate"], float)
    assert a["hit_rate"] > rr["hit_rate"]
    bounds = a["bounds"]
    assert isinstance(bounds, dict)
    assert a["hit_rate"] <= bounds["opt"] <= bounds["infinite"]
    # 7 of 8 prompts of a group can reuse the 512-token system prompt (plus template).
    assert bounds["infinite"] == pytest.approx(7 / 8 * 515 / 560, abs=0.03)


def test_gateway_counters_drain_and_index_learns() -> None:
    w = create_workload("generated-shared-prefix", GSP)
    builder = PromptBuilder()
    sim = Simulation(create_policy("min_ttft"), make_workers(3, 60_000, None), 60_000,
                     builder.prepare)  # fmt: skip
    outcome = sim.run(w.requests)
    assert all(g.in_flight == 0 and g.queued_prefill_tokens == 0 for g in sim.gw)
    assert all(g.decoding_requests == 0 for g in sim.gw)
    assert sum(r.predicted_tokens for r in outcome.records) > 0
    assert all(r.first_token_s is not None and r.finish_s is not None for r in outcome.records)
    assert all(r.first_token_s >= r.arrival_s for r in outcome.records if r.first_token_s)
    assert {r.worker for r in outcome.records} <= set(outcome.worker_ids)


def test_reference_sglang_policy_runs() -> None:
    summary = _run("sglang_cache_aware", GSP, limit=30)
    assert summary["requests"] == 30
    bad = ReplayConfig(workers=2, capacity_tokens=60_000, policy="sglang_cache_aware",
                       policy_args={"nope": 1}, workload="generated-shared-prefix")  # fmt: skip
    with pytest.raises(ValueError, match="bad parameters"):
        run_replay(bad)
