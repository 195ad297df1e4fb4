"""Sweep grid, Pareto front, goodput at an SLO, and the comparison table."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.replay.compare import compare_main, compare_table
from loadtests.replay.sweep import goodput, pareto_front, parse_grid, sweep_main


def test_parse_grid_is_the_cartesian_product_with_yaml_scalars() -> None:
    grid = parse_grid(["a=1,2", "b=x,0.5"])
    assert grid == [{"a": 1, "b": "x"}, {"a": 1, "b": 0.5}, {"a": 2, "b": "x"},
                    {"a": 2, "b": 0.5}]  # fmt: skip
    assert parse_grid([]) == [{}]


def test_pareto_front_keeps_non_dominated_points() -> None:
    pts = [(0.3, 5.0), (0.2, 2.0), (0.25, 6.0), (0.1, 1.0), (0.3, 4.0)]
    assert sorted(pareto_front(pts)) == [1, 3, 4]


def test_goodput_is_the_largest_scale_meeting_the_slo() -> None:
    def row(scale: float, p90: float) -> dict[str, object]:
        return {"policy_args": {"w": 1}, "time_scale": scale, "summary": {"ttft_s": {"p90": p90}}}

    rows = [row(1, 0.5), row(2, 1.5), row(3, 4.0)]
    assert goodput(rows, 2.0, "p90") == {'{"w": 1}': 2}
    assert goodput(rows, 0.1, "p90") == {'{"w": 1}': None}


def test_tiny_sweep_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    code = sweep_main(["--workload", "generated-shared-prefix", "--workload-arg", "num_groups=2",
                       "--workload-arg", "prompts_per_group=4", "--workload-arg",
                       "system_prompt_len=256", "--workload-arg", "output_len=8",
                       "--workers", "2", "--capacity-tokens", "50000", "--policy", "min_ttft",
                       "--grid", "work_weight=0,1", "--time-scales", "1", "--jobs", "1",
                       "--out", str(out)])  # fmt: skip
    assert code == 0
    result = json.loads((out / "sweep.json").read_text())
    assert [r["policy_args"] for r in result["rows"]] == [{"work_weight": 0}, {"work_weight": 1}]
    assert (out / "sweep.md").exists()
    summaries = [r["summary"] for r in result["rows"]]
    table = compare_table(summaries)
    assert table.count("| min_ttft") == 2
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summaries[0]))
    assert compare_main([str(run), "--chart", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0
