"""Exact mode in the offline replay: the gateway's KV-event consumer fed by the simulated
workers' own events, after a delay, and its predictions against what workers report."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadtests.replay.exact import ReplayExact
from loadtests.replay.prompts import PromptBuilder
from loadtests.replay.run import ReplayConfig, run_replay
from loadtests.replay.workers import ModelWorker
from loadtests.workloads import create_workload
from simulator.config import SimConfig

PAGE = 16
# tenants whose working set overflows the fleet (1.2x its KV): evictions the approximate
# index does not see
OVERFLOW = ("capacity_tokens=80000", "capacity_fraction=1.2", "context_len=800",
            "question_len=100", "output_len=30", "users_per_tenant=3",
            "stages=4:40,12:40")  # fmt: skip


def _prompt_keys(n: int) -> list[bytes]:
    w = create_workload("tenants", ["tenants=2", "capacity_tokens=0", "context_len=300",
                                    "question_len=40", "stages=10:2"])  # fmt: skip
    builder = PromptBuilder()
    return [builder.prepare(r).prompt_key for r in w.requests[:n]]


def test_a_workers_events_reach_the_index_after_the_delay_only() -> None:
    now = [0.0]
    worker = ModelWorker(SimConfig(capacity_tokens=20_000, page_size=PAGE), kv_events=True)
    exact = ReplayExact(["w"], PAGE, lambda: now[0], hybrid=False, delay_s=0.05)
    key = _prompt_keys(1)[0]
    tokens = len(key) // 4
    assert exact.request(key).match(["w"]) == {"w": 0}  # followed, nothing stored yet
    worker.submit("r0", key, 4, 0.0)
    step = worker.step(0.0)
    assert step is not None
    end = step[0]
    batch = worker.kv_batch(end)
    assert batch is not None and worker.kv_batch(end) is None  # drained
    exact.publish("w", batch, end)
    now[0] = end + 0.049
    exact.deliver(now[0])
    assert exact.request(key).match(["w"]) == {"w": 0}  # still in flight to the gateway
    now[0] = end + 0.05
    exact.deliver(now[0])
    expected = (tokens - 1) // PAGE * PAGE  # whole pages, at most prompt - 1 tokens
    assert exact.request(key).match(["w"]) == {"w": expected}
    assert worker.true_match(key) == expected  # what the worker would report now
    exact.close()


def test_hybrid_predicts_a_dispatched_prompt_before_its_events() -> None:
    now = [1.0]
    exact = ReplayExact(["w", "v"], PAGE, lambda: now[0], hybrid=True)
    key = _prompt_keys(1)[0]
    exact.request(key).dispatched("w")
    match = exact.request(key).match(["w", "v"])
    assert match["w"] == (len(key) // 4 - 1) // PAGE * PAGE and match["v"] == 0
    exact.close()


def test_exact_mode_predicts_what_workers_then_report() -> None:
    base = ReplayConfig(workers=4, capacity_tokens=20_000, policy="min_ttft",
                        workload="tenants", workload_args=OVERFLOW, page_size=PAGE,
                        bounds=False)  # fmt: skip
    exact = run_replay(replace(base, exact=True, hybrid=False))
    approx = run_replay(base)
    fid, fid_approx = exact["index_fidelity"], approx["index_fidelity"]
    assert fid["predicted_tokens"] > 0.3 * exact["prompt_tokens"]  # it does predict hits
    assert fid["precision_reported"] >= 0.99  # and the workers then report them
    assert exact["exact"]["fidelity"]["exact"]["precision"] >= 0.99  # the manager agrees
    assert exact["exact"]["batches"] > 100
    # the approximate index, on the same workload, keeps believing in evicted prefixes
    assert fid_approx["precision_reported"] < 0.9
    assert exact["requests"] == exact["completed"] == approx["requests"]


def test_a_negative_event_delay_is_refused() -> None:
    with pytest.raises(ValueError):
        ReplayExact(["w"], PAGE, lambda: 0.0, delay_s=-1.0)
