"""The live benchmark: a short run with two contenders, and its pure helpers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.bench.live import parse_spec, write_benchmarks
from loadtests.bench.report import WorkloadReport
from loadtests.harness.stats import percentile

ROOT = Path(__file__).resolve().parents[2]


def test_parse_spec_separates_bench_settings() -> None:
    name, params, bench = parse_spec("mooncake:limit=10,capacity_tokens=4096,speed=2")
    assert name == "mooncake"
    assert params == ["limit=10", "speed=2"]
    assert bench == {"capacity_tokens": 4096}
    assert parse_spec("azure") == ("azure", [], {})


def test_quantile_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0], 50, "nearest") == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99, "nearest") == 4.0


def test_write_benchmarks_replaces_only_its_section(tmp_path: Path) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# B\n\n## A\n\nkeep a\n\n## Live benchmark\n\nold\n\n## Z\n\nkeep z\n")
    png = tmp_path / "w-ttft-cdf.png"
    png.write_bytes(b"png")
    report = WorkloadReport("w", "setup line", {"infinite": 0.5, "lru_pooled": 0.4})
    write_benchmarks([report], ["a note"], [png], "python -m loadtests.bench", doc,
                     tmp_path / "docs" / "bench")  # fmt: skip
    text = doc.read_text()
    assert "keep a" in text and "keep z" in text and "old" not in text
    assert "Command: `python -m loadtests.bench`" in text
    assert "![w-ttft-cdf](docs/bench/w-ttft-cdf.png)" in text
    assert (tmp_path / "docs" / "bench" / "w-ttft-cdf.png").exists()
    assert text.index("## Live benchmark") < text.index("## Z")


@pytest.mark.slow
def test_short_benchmark_run_produces_its_table(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "loadtests.bench.live", "--workers", "2", "--speed", "20",
        "--contenders", "gateway:min_ttft", "direct", "--results", str(out),
        "--workload", "generated-shared-prefix:num_groups=4,prompts_per_group=4,"
        "output_len=8,request_rate=40,capacity_tokens=65536",
        "--max-seconds", "5", "--timeout", "20",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = (out / "report.md").read_text()
    assert "| gateway:min_ttft | 16 / 16 | 0 | 0 |" in report
    assert "| direct | 16 / 16 | 0 | 0 |" in report
    assert "pooled LRU" in report
    data = json.loads((out / "results.json").read_text())
    results = data["workloads"][0]["results"]
    assert [r["contender"] for r in results] == ["gateway:min_ttft", "direct"]
    for r in results:
        assert r["failed"] == 0
        assert sum(r["worker_requests"].values()) == 16
        assert 0.0 < r["cached_fraction"] <= 1.0
