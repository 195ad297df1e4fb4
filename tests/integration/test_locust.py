"""A bounded headless Locust run against the gateway in front of simulated workers.

Locust (gevent) runs as a subprocess: importing it here would monkey-patch this process.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.harness.gateway_proc import run_gateway
from loadtests.harness.sim_fleet import SimSettings, run_sim_fleet

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtests" / "locust" / "locustfile.py"
SIM = SimSettings(profile="llama3-8b-h100", speed=20.0, capacity_tokens=65536,
                  max_running_requests=16)  # fmt: skip


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_headless_locust_reports_ttft_and_cached_fraction(tmp_path: Path) -> None:
    with (
        run_sim_fleet(2, SIM, tmp_path / "sim") as urls,
        run_gateway(urls, "min_ttft", tmp_path / "gateway.log", ["--log-level", "warning"]) as gw,
    ):
        prefix = tmp_path / "out"
        cmd = [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE),
            "--headless", "-u", "4", "-r", "4", "-t", "6s", "--host", gw.url,
            "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING",
            "--workload", "generated-shared-prefix",
            "--workload-arg", "num_groups=4", "--workload-arg", "prompts_per_group=4",
            "--workload-arg", "output_len=8", "--seed", "3",
        ]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    stats = {(r["Type"], r["Name"]): r for r in _rows(Path(f"{prefix}_stats.csv"))}
    full = stats[("POST", "generated-shared-prefix")]
    ttft = stats[("TTFT", "generated-shared-prefix")]
    assert int(full["Request Count"]) > 0
    assert int(full["Failure Count"]) == 0
    assert int(ttft["Request Count"]) == int(full["Request Count"])
    assert float(ttft["Average Response Time"]) <= float(full["Average Response Time"])
    prefix_rows = {r["metric"]: r["value"] for r in _rows(Path(f"{prefix}_prefix.csv"))}
    assert float(prefix_rows["cached_fraction"]) > 0.5  # 4 groups share long prefixes
    shares = [k for k in prefix_rows if k.startswith("worker_share http://127.0.0.1:")]
    assert 1 <= len(shares) <= 2
    assert "prefix summary (generated-shared-prefix)" in done.stdout
