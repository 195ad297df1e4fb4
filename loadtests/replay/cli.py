"""Offline replay: a workload or trace through the gateway's own routing parts and the
simulated SGLang worker model, on a virtual clock, with the bounds beside the result.

Usage::

    python -m loadtests.replay --trace loadtests/data/mooncake_synthetic.jsonl \\
        --workers 4 --capacity-tokens 200000 --policy min_ttft --limit 500 --out out/r1
    python -m loadtests.replay --workload generated-shared-prefix \\
        --workload-arg request_rate=20 --workers 8 --capacity-tokens 430000 --policy cache_aware
    python -m loadtests.replay sweep --trace ... --policy min_ttft \\
        --grid work_weight=0,0.5,1 --time-scales 1,2,3 --slo-s 2 --out out/sweep
    python -m loadtests.replay compare out/r1 out/r2     # one Markdown table

``--trace`` reads ``.jsonl`` as Mooncake and ``.csv`` as Azure 2023. ``--time-scale 3``
compresses arrivals threefold. ``--policy sglang_cache_aware`` selects the reference
re-implementation of sglang-router's rule (``loadtests/replay/sglang_rule.py``).
Outputs (``--out``): ``summary.json``, ``summary.md``, PNG charts; the table is printed.
See ``docs/REPLAY.md`` for every figure's definition.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtests.replay.bounds import compute_bounds
from loadtests.replay.metrics import summarize
from loadtests.replay.prompts import PromptBuilder, trace_block_requests
from loadtests.replay.report import render_table, write_outputs
from loadtests.replay.sglang_rule import REFERENCE_NAME, SglangCacheAware
from loadtests.replay.sim import Simulation
from loadtests.replay.workers import make_workers, prefill_time_fn
from loadtests.workloads import Workload, create_workload
from loadtests.workloads.traces import azure_trace, mooncake_trace
from policies.base import Policy
from policies.registry import create_policy


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """Everything one replay run depends on (picklable, for sweeps)."""

    workers: int
    capacity_tokens: int
    policy: str
    policy_args: dict[str, Any] = field(default_factory=dict)
    trace: str | None = None
    workload: str | None = None
    workload_args: tuple[str, ...] = ()
    limit: int = 0
    time_scale: float = 1.0
    profile: str | None = None
    seed: int = 0


def parse_policy_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs, values read as YAML scalars (as the gateway's CLI does)."""
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--policy-arg: expected KEY=VALUE, got {pair!r}")
        try:
            params[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            params[key.strip()] = raw
    return params


def load_workload(config: ReplayConfig) -> Workload:
    if config.trace is not None:
        reader = azure_trace if config.trace.endswith(".csv") else mooncake_trace
        workload = reader(path=config.trace, limit=config.limit, seed=config.seed)
    elif config.workload is not None:
        workload = create_workload(config.workload, config.workload_args)
    else:
        raise ValueError("give --trace PATH or --workload NAME")
    return workload.limited(config.limit).scaled(config.time_scale)


def make_policy(name: str, params: dict[str, Any]) -> Policy:
    if name == REFERENCE_NAME:
        try:
            return SglangCacheAware(**params)
        except TypeError as exc:
            raise ValueError(f"bad parameters for policy {name!r}: {exc}") from None
    return create_policy(name, **params)


def run_replay(config: ReplayConfig) -> dict[str, Any]:
    """Replay and summarise; the summary also holds ``config`` and ``wall_s``."""
    summary, _ = _run(config)
    return summary


def _run(config: ReplayConfig) -> tuple[dict[str, Any], Any]:
    started = time.perf_counter()
    workload = load_workload(config)
    policy = make_policy(config.policy, dict(config.policy_args))
    builder = PromptBuilder()
    workers = make_workers(config.workers, config.capacity_tokens, config.profile)
    sim = Simulation(policy, workers, config.capacity_tokens, builder.prepare, seed=config.seed)
    outcome = sim.run(workload.requests)
    capacity = config.workers * config.capacity_tokens
    blocks = [builder.bound_blocks(r) for r in workload.requests]
    bounds = compute_bounds(blocks, capacity)
    summary = summarize(outcome.records, outcome.intervals, outcome.worker_ids, bounds,
                        prefill_time_fn(config.profile))  # fmt: skip
    trace_blocks = trace_block_requests(list(workload.requests))
    if trace_blocks:  # Mooncake's own blocks, as PERFORMANCE.md section 2 counts them
        summary["bounds_block_level"] = compute_bounds(trace_blocks, capacity).block_rates()
    summary["config"] = {**asdict(config), "policy_describe": policy.describe()}
    summary["wall_s"] = time.perf_counter() - started
    return summary, outcome


def _common_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake .jsonl or Azure .csv trace")
    src.add_argument("--workload", help="a workload name (loadtests.workloads)")
    parser.add_argument("--workload-arg", action="append", default=[], metavar="K=V")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--capacity-tokens", type=int, default=430_000)
    parser.add_argument("--policy", default="min_ttft")
    parser.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--limit", type=int, default=0, help="replay the first K requests")
    parser.add_argument("--profile", default=None, help="simulator latency profile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="output folder")


def config_from_args(ns: argparse.Namespace, time_scale: float) -> ReplayConfig:
    return ReplayConfig(
        workers=ns.workers,
        capacity_tokens=ns.capacity_tokens,
        policy=ns.policy,
        policy_args=parse_policy_args(ns.policy_arg),
        trace=ns.trace,
        workload=ns.workload,
        workload_args=tuple(ns.workload_arg),
        limit=ns.limit,
        time_scale=time_scale,
        profile=ns.profile,
        seed=ns.seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "sweep":
        from loadtests.replay.sweep import sweep_main

        return sweep_main(args[1:])
    if args and args[0] == "compare":
        from loadtests.replay.compare import compare_main

        return compare_main(args[1:])
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common_args(parser)
    parser.add_argument("--time-scale", type=float, default=1.0)
    ns = parser.parse_args(args)
    try:
        config = config_from_args(ns, ns.time_scale)
        summary, outcome = _run(config)
    except ValueError as exc:
        parser.error(str(exc))
    print(render_table(summary))
    if ns.out is not None:
        for note in write_outputs(ns.out, summary, outcome.records, outcome.timelines):
            print(note)
        print(f"wrote {ns.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
