"""``python -m loadtests.bench.tenants``: one table of replay rows, llm-d's figures beside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.bench.tenants import main

TINY = ["--workers", "2", "--capacity-tokens", "20000", "--workload-arg", "context_len=400",
        "--workload-arg", "question_len=40", "--workload-arg", "output_len=10",
        "--workload-arg", "stages=5:10", "--jobs", "1"]  # fmt: skip


def test_rows_print_beside_llmd_and_write_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*TINY, "--rows", "exact,approximate,random,sglang_rule", "--out",
                 str(tmp_path)])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    labels = [line.split("|")[1].strip() for line in lines]
    assert labels == ["row", "exact", "approximate", "random", "sglang_rule"]
    assert "precise-scheduling: 0.542 / 8,730" in lines[1]  # exact beside llm-d's precise
    assert "random-scheduling: 92.551 / 4,429" in lines[3]
    assert "working set" in out and "0.73 of 2 x 20,000" in out
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["row"]["label"] for r in rows] == ["exact", "approximate", "random", "sglang_rule"]
    exact = rows[0]["summary"]
    assert exact["config"]["exact"] and exact["exact"]["batches"] > 0
    assert exact["workload_params"]["tenants"] == round(0.73 * 40000 / (400 + 5 * 40))
    assert all(r["summary"]["completed"] == r["summary"]["requests"] > 0 for r in rows)


def test_unknown_row_is_refused() -> None:
    with pytest.raises(SystemExit):
        main([*TINY, "--rows", "exact,psychic"])
