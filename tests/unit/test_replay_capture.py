"""Routing capture in the replay: available / captured / delivered per request, summed in
the summary and the report; sweeps over several policies and the workload x policy tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtests.replay.compare import compare_main, matrix_tables
from loadtests.replay.metrics import RequestRecord, routing_capture
from loadtests.replay.report import render_table
from loadtests.replay.run import ReplayConfig, run_replay
from loadtests.replay.sweep import sweep_main

AGENTS = ("agents=6", "agent_types=2", "steps=4", "system_prompt_len=300", "tools=3",
          "task_len=40", "call_len=10", "result_len=80", "agent_rate=2")  # fmt: skip


def _record(i: int, best: int, true: int, cached: int, predicted: int, available: int | None
            ) -> RequestRecord:  # fmt: skip
    return RequestRecord(index=i, arrival_s=0.0, worker="w", prompt_tokens=1000, output_tokens=1,
                         predicted_tokens=predicted, true_match_tokens=true, best_match_tokens=best,
                         cached_tokens=cached, available_predicted_tokens=available)  # fmt: skip


def test_routing_capture_sums_both_ways() -> None:
    records = [_record(0, 800, 600, 650, 500, 900), _record(1, 200, 200, 100, 0, None)]
    capture = routing_capture(records)
    assert capture["actual"] == {
        "available_tokens": 1000.0, "captured_tokens": 800.0, "delivered_tokens": 750.0,
        "captured_over_available": 0.8, "delivered_over_available": 0.75,
    }  # fmt: skip
    predicted = capture["predicted"]  # only the request for which an index was consulted
    assert predicted["requests"] == 1.0 and predicted["available_tokens"] == 900.0
    assert predicted["captured_over_available"] == pytest.approx(500 / 900)
    assert predicted["delivered_over_available"] == pytest.approx(650 / 900)
    empty = routing_capture([_record(0, 0, 0, 0, 0, None)])
    assert math.isnan(empty["actual"]["captured_over_available"])
    assert math.isnan(empty["predicted"]["captured_over_available"])


def _replay(policy: str) -> dict[str, object]:
    config = ReplayConfig(workers=3, capacity_tokens=60_000, policy=policy, workload="agentic",
                          workload_args=AGENTS, seed=1, bounds=False)  # fmt: skip
    return run_replay(config)


def test_replay_summary_and_report_carry_the_capture() -> None:
    summary = _replay("cache_aware")
    capture = summary["routing_capture"]
    assert isinstance(capture, dict)
    actual, predicted = capture["actual"], capture["predicted"]
    assert 0 < actual["captured_tokens"] <= actual["available_tokens"]
    assert actual["delivered_tokens"] > 0
    assert 0.0 < actual["captured_over_available"] <= 1.0
    assert predicted["requests"] == summary["requests"] == 24
    assert 0 < predicted["captured_tokens"] <= predicted["available_tokens"]
    assert predicted["delivered_tokens"] == actual["delivered_tokens"]
    table = render_table(summary)
    assert "capture (actual): captured / available" in table
    assert "capture (predicted): available / captured / delivered tokens" in table


def test_a_policy_blind_to_prefixes_has_no_predicted_capture() -> None:
    summary = _replay("round_robin")
    capture = summary["routing_capture"]
    assert isinstance(capture, dict)
    assert capture["predicted"]["requests"] == 0.0
    assert math.isnan(capture["predicted"]["captured_over_available"])
    assert capture["actual"]["available_tokens"] > 0
    assert "nan / nan" in render_table(summary)


def test_sweep_over_policies_and_the_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                            ) -> None:  # fmt: skip
    out = tmp_path / "agentic"
    args = ["--workload", "agentic", *[f"--workload-arg={a}" for a in AGENTS],
            "--workers", "3", "--capacity-tokens", "60000", "--no-bounds", "--jobs", "1",
            "--policies", "aibrix_prefix,round_robin", "--out", str(out)]  # fmt: skip
    assert sweep_main(args) == 0
    result = json.loads((out / "sweep.json").read_text())
    assert [r["policy"] for r in result["rows"]] == ["aibrix_prefix", "round_robin"]
    assert set(result["goodput_time_scale"]) == {"aibrix_prefix {}", "round_robin {}"}
    assert result["rows"][1]["summary"]["routing_capture"]["predicted"]["requests"] == 0
    assert "| aibrix_prefix | {} | 1 |" in (out / "sweep.md").read_text()
    tables = matrix_tables([result])
    assert tables.count("| workload | aibrix_prefix | round_robin |") == 3
    assert "| agentic x1 |" in tables
    capsys.readouterr()
    assert compare_main(["--matrix", str(out)]) == 0
    assert "captured / available (actual):" in capsys.readouterr().out
