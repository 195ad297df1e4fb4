"""The offline replay with the gateway's prefill gate: GRPO siblings arriving together on
one simulated SGLang worker busy with another prompt's prefill (so that they meet in its
queue: on an idle worker the first starts a step alone at its arrival). With the gate, the
group's first is prefilled alone and the others are sent at its first token, as hits;
without it they are prefilled together in the next batch, each computing the whole
prompt."""

from __future__ import annotations

import dataclasses

from loadtests.replay.metrics import RequestRecord
from loadtests.replay.prompts import PromptBuilder
from loadtests.replay.run import ReplayConfig, run_replay
from loadtests.replay.sim import Simulation
from loadtests.replay.workers import make_workers
from loadtests.workloads import create_workload
from loadtests.workloads.base import WorkloadRequest
from policies.registry import create_policy

GROUPS = ["steps=1", "prompts_per_step=2", "n=8", "instruction_len=0", "output_len=16"]


def _miss(r: RequestRecord) -> bool:
    return r.cached_tokens < 16  # the chat template's first tokens at most


def _requests() -> list[WorkloadRequest]:
    """Another prompt at 0 (the first of a group sharing nothing), then eight siblings
    together at 1 ms, while it is prefilled."""
    reqs = sorted(create_workload("rollouts", GROUPS).requests, key=lambda r: r.index)
    other, group = reqs[0], [r for r in reqs if r.group != reqs[0].group]
    assert len(group) == 8 and len({r.messages for r in group}) == 1
    return [other, *(dataclasses.replace(r, arrival_s=0.001) for r in group)]


def _replay(prefill_wait_s: float) -> tuple[list[RequestRecord], dict[str, float]]:
    policy = create_policy("min_ttft")
    sim = Simulation(policy, make_workers(1, 200_000, None, 1), 200_000, PromptBuilder().prepare,
                     prefill_wait_s=prefill_wait_s)  # fmt: skip
    outcome = sim.run(_requests())
    records = sorted(outcome.records, key=lambda r: r.arrival_s)  # stable: index order
    return records[1:], sim.gate_figures()


def test_siblings_arriving_together_one_miss_then_hits_with_the_gate() -> None:
    records, gate = _replay(2.0)
    first, siblings = records[0], records[1:]
    assert len(siblings) == 7 and all(r.finish_s is not None for r in records)
    assert _miss(first)
    assert all(r.cached_tokens >= r.prompt_tokens // 2 for r in siblings)
    assert (gate["held"], gate["released"], gate["timed_out"]) == (7, 7, 0)
    # held until the first's first token: the client's TTFT counts from its arrival
    assert first.first_token_s is not None
    assert all(r.first_token_s is not None and r.first_token_s > first.first_token_s
               for r in siblings)  # fmt: skip
    assert all(r.ttft_s is not None and r.ttft_s > (first.ttft_s or 0.0) for r in siblings)


def test_siblings_arriving_together_all_miss_without_the_gate() -> None:
    records, gate = _replay(0.0)
    assert len(records) == 8 and all(_miss(r) for r in records)
    assert gate == {"held": 0, "released": 0, "timed_out": 0, "waited_s": 0.0}


def test_the_summary_counts_the_gate_and_the_flag_turns_it_off() -> None:
    def config(wait_s: float) -> ReplayConfig:
        return ReplayConfig(workers=1, capacity_tokens=200_000, policy="min_ttft",
                            workload="rollouts", workload_args=tuple(GROUPS), bounds=False,
                            prefill_wait_s=wait_s)  # fmt: skip

    on, off = run_replay(config(2.0)), run_replay(config(0.0))
    assert on["prefill_gate"]["held"] > 0 and off["prefill_gate"]["held"] == 0
    assert on["prefill_gate"]["wait_s"] == 2.0 and off["prefill_gate"]["wait_s"] == 0.0
    assert on["hit_rate"] > off["hit_rate"]
