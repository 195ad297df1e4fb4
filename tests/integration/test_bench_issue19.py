"""Issue 19's benchmarks at a tiny size: the offline replay's LoRA mode (adapter-aware
routing through the gateway's own rules, adapter-blind routing, sglang-router's rule) and
the live two-model bench (simulated workers of two models as subprocesses, the routers
in front)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtests.bench.live import router_available
from loadtests.micro.models import MODELS, served_by_model, two_model_workload
from loadtests.replay.cli import main as replay_main
from loadtests.replay.run import ReplayConfig, run_replay

ROOT = Path(__file__).resolve().parents[2]
# 6 tenants over 2 workers of 2 adapter slots: adapters must be loaded and evicted
LORA = ("tenants=6", "questions_per_tenant=2", "context_len=300", "question_len=40",
        "num_requests=60", "request_rate=8", "output_len=4")  # fmt: skip


def _replay(policy: str, affinity: bool = True) -> dict[str, Any]:
    config = ReplayConfig(
        workers=2, capacity_tokens=20_000, policy=policy, workload="lora-tenants",
        workload_args=LORA, bounds=False, max_loaded_loras=2, max_loras_per_batch=2,
        lora_affinity=affinity,
    )  # fmt: skip
    return run_replay(config)


def test_replay_routes_adapters_as_the_gateway_does() -> None:
    aware = _replay("min_ttft")
    lora = aware["lora"]
    assert aware["completed"] == aware["requests"] == 60
    assert lora["affinity"] and lora["rejected"] == 0 and lora["errors"] == {}
    # every request reached a worker holding its adapter or loading it for it: the
    # gateway made the loads, the workers never reloaded one implicitly
    assert lora["gateway_loads"] > 0
    assert lora["totals"]["loads"] == lora["gateway_loads"]
    assert lora["totals"]["reloads"] == 0
    assert lora["top_adapter"] == "tenant00"
    assert sum(lora["top_adapter_requests"].values()) > 0


@pytest.mark.parametrize(
    ("policy", "affinity"), [("min_ttft", False), ("sglang_cache_aware", True)]
)
def test_replay_blind_rows_leave_adapters_to_the_workers(policy: str, affinity: bool) -> None:
    blind = _replay(policy, affinity)
    lora = blind["lora"]
    assert blind["completed"] == 60
    assert not lora["affinity"]  # sglang-router's rule is adapter-blind whatever the flag
    assert lora["gateway_loads"] == 0
    assert lora["totals"]["reloads"] == lora["totals"]["loads"] > 0  # implicit reloads


def test_replay_cli_prints_the_lora_rows(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--workload", "lora-tenants", *(f"--workload-arg={a}" for a in LORA),
            "--workers", "2", "--capacity-tokens", "20000", "--max-loaded-loras", "2",
            "--max-loras-per-batch", "2", "--no-bounds", "--no-lora-affinity"]  # fmt: skip
    assert replay_main(args) == 0
    out = capsys.readouterr().out
    assert "LoRA routing" in out and "adapter-blind" in out
    assert "LoRA top adapter (tenant00) per worker" in out


def test_two_model_workload_and_the_counter_solution() -> None:
    outputs = dict(zip(MODELS, (3, 5), strict=True))
    workload = two_model_workload(["sessions=2", "turns=2", "session_rate=2"], outputs)
    assert [r.index for r, _ in workload] == list(range(8))
    assert {m for _, m in workload} == set(MODELS)
    for r, m in workload:
        assert r.max_tokens == outputs[m] and r.session_id is not None
        assert r.session_id.startswith(m + "/")
    # 3 of model-a and 2 of model-b: 5 requests, 3 x 3 + 2 x 5 generated tokens
    assert served_by_model(5, 19, outputs) == {MODELS[0]: 3.0, MODELS[1]: 2.0}


@pytest.mark.slow
def test_live_two_model_bench(tmp_path: Path) -> None:
    targets = ["gateway:round_robin"]
    if router_available():
        targets.append("sglang-router:round_robin")
    out = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "loadtests.micro.models", "--workers-per-model", "1",
        "--profile", "tiny-cpu", "--speed", "20", "--rounds", "1", "--results", str(out),
        "--workload-arg", "sessions=2", "--workload-arg", "turns=2",
        "--workload-arg", "system_prompt_len=64", "--workload-arg", "session_rate=4",
        "--workload-arg", "think_time_s=1", "--timeout", "20", "--targets", *targets,
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    by_target = {t["target"]: t for t in data["targets"]}
    assert sorted(by_target) == sorted(targets)
    for t in by_target.values():
        assert (t["ok"], t["sent"]) == (8, 8)
        assert all(w["exact"] for w in t["workers"])
        for m in MODELS:  # the counters account for every request of each model
            assert sum(w["served"][m] for w in t["workers"]) == data["per_model_requests"][m]
    gateway = by_target["gateway:round_robin"]
    assert gateway["wrong_model_share"] == gateway["wrong_model_share_headers"] == 0.0
    if "sglang-router:round_robin" in by_target:
        assert by_target["sglang-router:round_robin"]["wrong_model_share_headers"] is None
    assert "| gateway:round_robin | 8 / 8 |" in done.stdout
