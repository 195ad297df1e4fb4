"""The PD benchmark end to end at a tiny size: the offline replay's PD mode and the live
bench (simulated prefill and decode workers as subprocesses, the routers in front)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.bench.live import router_available
from loadtests.bench.pd import Arm, Fleets, router_command
from loadtests.replay.pd import PDConfig, Row, SglangPdPrefill, run_pd, run_row
from policies.base import RouteContext, WorkerView

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ("num_groups=3", "prompts_per_group=4", "output_len=8", "request_rate=4", "seed=1")


def _config(prefill_policy: str, decode_policy: str) -> PDConfig:
    return PDConfig(
        prefill=2, decode=2, capacity_tokens=20_000, prefill_policy=prefill_policy,
        decode_policy=decode_policy, workload="generated-shared-prefix",
        workload_args=WORKLOAD, profile="llama3-8b-h100",
    )  # fmt: skip


def test_replay_pd_serves_every_request_with_prefill_side_hits() -> None:
    summary = run_pd(_config("min_ttft", "least_load"))
    assert summary["completed"] == summary["requests"] == 12
    assert summary["rejected"] == 0
    # 3 groups of 4: the group's system prompt is cached for most of its later requests
    assert 0.3 < summary["hit_rate"] < 1.0
    assert len(summary["worker_share"]) == 2  # the prefill workers
    assert sum(summary["decode_steps"].values()) > 0
    assert summary["ttft_s"]["p50"] > 0 and summary["requests_per_s"] > 0


def test_replay_pd_reference_rule_and_regular_fleet_run() -> None:
    base = _config("min_ttft", "least_load")
    pd = run_row(Row.parse("pd:sglang_pd_prefill/round_robin"), base)
    regular = run_row(Row.parse("regular:min_ttft"), base)
    assert pd["completed"] == regular["completed"] == 12
    assert len(regular["worker_share"]) == 4  # N + M regular workers
    assert regular["tpot_s"]["p50"] > 0 and pd["tpot_s"]["p50"] > 0


def _view(wid: str, in_flight: int) -> WorkerView:
    return WorkerView(id=wid, in_flight=in_flight)


def test_sglang_pd_prefill_is_random_unless_imbalanced() -> None:
    policy = SglangPdPrefill()
    balanced = [_view("a", 3), _view("b", 0)]
    picks = {
        policy.select(RouteContext(100, balanced, random.Random(seed))).worker_id
        for seed in range(20)
    }
    assert picks == {"a", "b"}  # no prefix tree: a random worker
    imbalanced = [_view("a", 100), _view("b", 10), _view("c", 10)]
    decision = policy.select(RouteContext(100, imbalanced, random.Random(0)))
    assert (decision.worker_id, decision.reason) == ("b", "imbalance")


def test_both_routers_get_the_same_pd_flags() -> None:
    fleets = Fleets(["http://127.0.0.1:1"], [9001], ["http://127.0.0.1:2"], [])
    tails = []
    for spec in ("pd:gateway:min_ttft/least_load", "pd:sglang-router:cache_aware/round_robin"):
        cmd = router_command(Arm.parse(spec), fleets, 30000)
        tails.append(cmd[cmd.index("--pd-disaggregation") :])
    for tail, policy, decode in zip(tails, ("min_ttft", "cache_aware"),
                                    ("least_load", "round_robin"), strict=True):  # fmt: skip
        assert tail == [
            "--pd-disaggregation", "--prefill-policy", policy, "--decode-policy", decode,
            "--prefill", "http://127.0.0.1:1", "9001", "--decode", "http://127.0.0.1:2",
        ]  # fmt: skip
    with pytest.raises(ValueError):
        Arm.parse("pd:gateway:min_ttft")  # a PD arm names its decode policy


@pytest.mark.slow
def test_live_pd_bench_runs_every_arm(tmp_path: Path) -> None:
    arms = ["pd:gateway:min_ttft/least_load", "regular:gateway:min_ttft"]
    if router_available():
        arms.append("pd:sglang-router:cache_aware/round_robin")
    out = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "loadtests.bench.pd", "--speed", "10", "--capacity-tokens",
        "20000", "--workload", "generated-shared-prefix:" + ",".join(WORKLOAD),
        "--max-seconds", "5", "--timeout", "20", "--results", str(out), "--arms", *arms,
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    by_arm = {a["arm"]: a for a in data["arms"]}
    assert sorted(by_arm) == sorted(arms)
    for spec, a in by_arm.items():
        assert (a["ok"], a["failed"], a["shed"]) == (12, 0, 0), (spec, a["errors"])
        assert 0.0 < a["reported_fraction"] < 1.0
        assert a["reported_fraction"] == pytest.approx(a["cached_fraction"])
        requests = a["worker_requests"].values()
        assert sum(requests) == 12  # prefill workers on PD, every worker when regular
        if spec.startswith("pd:"):
            assert len(requests) == 2 and sum(a["decode_requests"].values()) == 12
    assert "| pd:gateway:min_ttft/least_load | 12 / 12 | 0 |" in (out / "report.md").read_text()
