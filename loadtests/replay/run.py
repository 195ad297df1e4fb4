"""One offline replay run: its configuration, the arguments that build it, and the run.

:class:`ReplayConfig` is everything a run depends on (picklable, so a sweep sends it to
worker processes); :func:`replay` loads the workload, builds the policy and the simulated
workers, runs :class:`~loadtests.replay.sim.Simulation` and summarises it with the
bounds beside. :func:`add_common_args` / :func:`config_from_args` are the command-line
arguments a replay (``cli``) and a sweep (``sweep``) share. Nothing here prints or writes.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.config.policyspec import parse_params
from gateway.workers.replies import host_tier_tokens
from loadtests.replay.bounds import compute_bounds
from loadtests.replay.exact import DEFAULT_EVENT_DELAY_S, ReplayExact
from loadtests.replay.lora import (
    LoraSettings,
    LoraSimulation,
    lora_simulation,
    make_lora_workers,
    workload_adapters,
)
from loadtests.replay.membership import (
    MembershipPlan,
    MembershipSimulation,
    add_membership_args,
    plan_from_args,
)
from loadtests.replay.metrics import summarize
from loadtests.replay.prompts import PromptBuilder, trace_block_requests
from loadtests.replay.sglang_rule import REFERENCE_NAME, SglangCacheAware
from loadtests.replay.sim import SimOutcome, Simulation
from loadtests.replay.workers import SimWorker, make_workers, prefill_time_fn
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
    page_size: int = 1  # the workers' radix page (SGLang --page-size; exact mode's block)
    # exact mode: the gateway follows every worker's KV events (loadtests.replay.exact)
    exact: bool = False
    hybrid: bool = True  # exact mode's predicted blocks (kv_events.hybrid, the default)
    event_delay_s: float = DEFAULT_EVENT_DELAY_S  # step end -> batch applied
    bounds: bool = True  # compute the bounds (OPT over every block reference)
    # a workload naming LoRA adapters (loadtests.replay.lora): the workers' slots, per
    # batch limit and load time, and the gateway's adapter affinity
    max_loaded_loras: int = 6
    max_loras_per_batch: int = 4
    lora_load_s: float = 0.2
    lora_affinity: bool = True
    # a drain or a scale-out during the run, and how the gateway handles it
    # (loadtests.replay.membership)
    membership: MembershipPlan | None = None
    # HiCache on the workers (simulator.model.hicache: SGLang's flags), and whether the
    # gateway believes their host tier (False: the device-only index of before issue 20;
    # exact mode then reads the GPU's events only)
    hicache: bool = False
    hicache_ratio: float | None = None
    hicache_write_policy: str = "write_through"
    hicache_link: str = "pcie-gen5-x16"
    host_tier: bool = True
    # the gateway's prefill gate (prefix_index.prefill_wait_s; 0: off): a sibling of a
    # request still in prefill on its worker waits for its first token (sim.py)
    prefill_wait_s: float = 2.0
    # the routing core's candidate shortlist above this many workers (policy.shortlist_above;
    # 0: never), as the live gateway's default
    shortlist_above: int = 64


def parse_policy_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs, values read as YAML scalars: the gateway's own reading of
    ``--policy-arg`` (``gateway.config.policyspec.parse_params``)."""
    try:
        return parse_params(pairs)
    except ValueError as exc:
        raise ValueError(f"--policy-arg: {exc}") from None


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
    summary, _ = replay(config)
    return summary


def replay(config: ReplayConfig) -> tuple[dict[str, Any], SimOutcome]:
    """Replay and summarise; also the simulation's outcome (records, timelines)."""
    started = time.perf_counter()
    workload = load_workload(config)
    policy = make_policy(config.policy, dict(config.policy_args))
    builder = PromptBuilder()
    exact = None
    if config.exact:
        exact = functools.partial(_exact, config)
    if any(r.adapter for r in workload.requests):  # LoRA workers, adapter-aware routing
        if config.hicache:
            raise ValueError("the LoRA replay runs without HiCache")
        sim: Simulation = _lora_sim(config, workload, policy, builder, exact)
    elif config.membership is not None:
        sim = _membership_sim(config, config.membership, policy, builder)
    else:
        hicache = _hicache_fields(config)
        workers = make_workers(config.workers, config.capacity_tokens, config.profile,
                               config.page_size, config.exact, hicache)  # fmt: skip
        sim = Simulation(policy, workers, config.capacity_tokens, builder.prepare,
                         seed=config.seed, exact=exact, host_tokens=_host_tokens(config),
                         tier_reports=config.hicache,
                         prefill_wait_s=config.prefill_wait_s,
                         shortlist_above=config.shortlist_above)  # fmt: skip
    try:
        outcome = sim.run(workload.requests)
    finally:
        if sim.exact is not None:
            sim.exact.close()
    capacity = config.workers * config.capacity_tokens
    bounds = None
    if config.bounds:
        bounds = compute_bounds([builder.bound_blocks(r) for r in workload.requests], capacity)
    summary = summarize(outcome.records, outcome.intervals, outcome.worker_ids, bounds,
                        prefill_time_fn(config.profile))  # fmt: skip
    trace_blocks = trace_block_requests(list(workload.requests)) if config.bounds else []
    if trace_blocks:  # Mooncake's own blocks, as PERFORMANCE.md section 2 counts them
        summary["bounds_block_level"] = compute_bounds(trace_blocks, capacity).block_rates()
    if isinstance(sim, LoraSimulation):
        summary["lora"] = sim.lora_summary()
    if isinstance(sim, MembershipSimulation):
        summary["membership"] = sim.figures()
    if not isinstance(sim, LoraSimulation):  # the LoRA replay's dispatch has no gate
        summary["prefill_gate"] = {"wait_s": config.prefill_wait_s, **sim.gate_figures()}
    if sim.exact is not None:
        summary["exact"] = {"fidelity": sim.exact.fidelity(), "batches": sim.exact.batches,
                            "modes": sim.exact.manager.modes()}  # fmt: skip
    summary["workload_params"] = dict(workload.params)
    summary["config"] = {**asdict(config), "policy_describe": policy.describe()}
    summary["wall_s"] = time.perf_counter() - started
    return summary, outcome


def _hicache_fields(config: ReplayConfig) -> dict[str, Any]:
    """The workers' ``SimConfig`` HiCache fields ({} without HiCache)."""
    if not config.hicache:
        return {}
    return {
        "enable_hierarchical_cache": True,
        "hicache_ratio": config.hicache_ratio,
        "hicache_write_policy": config.hicache_write_policy,
        "hicache_link": config.hicache_link,
    }


def _host_tokens(config: ReplayConfig) -> int | None:
    """Each worker's host-only tier as the live gateway reads it from the arguments
    ``/server_info`` shows (``gateway.workers.replies.host_tier_tokens``); None without
    HiCache or when the gateway is to ignore the tier."""
    if not (config.hicache and config.host_tier):
        return None
    device = config.capacity_tokens - config.capacity_tokens % config.page_size
    info = {
        "enable_hierarchical_cache": True,
        "hicache_ratio": 2.0 if config.hicache_ratio is None else config.hicache_ratio,
        "hicache_write_policy": config.hicache_write_policy,
    }
    return host_tier_tokens(info, device)


def _lora_sim(
    config: ReplayConfig,
    workload: Workload,
    policy: Policy,
    builder: PromptBuilder,
    exact: Callable[[Sequence[str], Callable[[], float]], ReplayExact] | None,
) -> LoraSimulation:
    """The LoRA fleet, warmed up; the reference sglang-router rule is adapter-blind."""
    lora = LoraSettings(
        max_loras_per_batch=config.max_loras_per_batch,
        max_loaded_loras=config.max_loaded_loras,
        load_s=config.lora_load_s,
        affinity=config.lora_affinity and config.policy != REFERENCE_NAME,
    )
    workers = make_lora_workers(config.workers, config.capacity_tokens, config.profile, lora,
                                config.page_size, kv_events=config.exact)  # fmt: skip
    adapters = workload_adapters(workload.requests, dict(workload.params))
    return lora_simulation(policy, workers, config.capacity_tokens, builder.prepare,
                           builder.model, lora, adapters, config.seed, exact)  # fmt: skip


def _membership_sim(
    config: ReplayConfig, plan: MembershipPlan, policy: Policy, builder: PromptBuilder
) -> MembershipSimulation:
    """The fleet with one drain or join (not with exact mode, LoRA or HiCache)."""
    if config.exact or config.hicache:
        raise ValueError("--drain / --join do not combine with --exact or --hicache")

    def fleet(n: int) -> list[SimWorker]:
        return make_workers(n, config.capacity_tokens, config.profile, config.page_size)

    workers, capacity = fleet(config.workers), config.capacity_tokens
    return MembershipSimulation(
        policy,
        workers,
        capacity,
        builder.prepare,
        plan,
        lambda: fleet(1)[0],
        config.seed,
        prefill_wait_s=config.prefill_wait_s,
    )


def _exact(config: ReplayConfig, worker_ids: Sequence[str], clock: Callable[[], float]
           ) -> ReplayExact:  # fmt: skip
    return ReplayExact(worker_ids, config.page_size, clock, config.hybrid, config.event_delay_s,
                       host_tier=config.host_tier)  # fmt: skip


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of a replay and of a sweep: source, fleet, policy, output folder."""
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
    parser.add_argument("--page-size", type=int, default=1, help="the workers' radix page")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="exact mode: route on the workers' KV events (use a page > 1)",
    )
    parser.add_argument(
        "--no-hybrid",
        action="store_true",
        help="exact mode without predicted blocks (kv_events.hybrid false)",
    )
    parser.add_argument(
        "--event-delay-ms",
        type=float,
        default=DEFAULT_EVENT_DELAY_S * 1000,
        help="exact mode: a step's end to its KV events applied",
    )
    parser.add_argument(
        "--no-bounds",
        action="store_true",
        help="skip the bounds (OPT over every block: slow on long runs)",
    )
    lora = parser.add_argument_group("LoRA (a workload naming adapters: lora-tenants)")
    lora.add_argument("--max-loaded-loras", type=int, default=6, help="adapter slots per worker")
    lora.add_argument("--max-loras-per-batch", type=int, default=4)
    lora.add_argument("--lora-load-s", type=float, default=0.2, help="modelled s per load")
    lora.add_argument("--no-lora-affinity", action="store_true",
                      help="adapter-blind routing (the gateway's --no-lora-affinity)")  # fmt: skip
    tiers = parser.add_argument_group("HiCache (the workers' host tier, issue 20)")
    tiers.add_argument("--hicache", action="store_true",
                       help="workers run --enable-hierarchical-cache")  # fmt: skip
    tiers.add_argument("--hicache-ratio", type=float, default=None, help="default 2.0")
    tiers.add_argument("--hicache-write-policy", default="write_through")
    tiers.add_argument("--hicache-link", default="pcie-gen5-x16",
                       help="simulator.model.transfer.HOST_LINK_PROFILES")  # fmt: skip
    tiers.add_argument("--no-host-tier", action="store_true",
                       help="the gateway ignores the host tier (the GPU's only)")  # fmt: skip
    add_membership_args(parser)
    gate = parser.add_argument_group("prefill gate (the gateway's, on by default)")
    gate.add_argument(
        "--prefill-wait-s",
        type=float,
        default=2.0,
        help="prefix_index.prefill_wait_s: a sibling's longest wait (0: off)",
    )
    gate.add_argument(
        "--no-prefill-gate",
        action="store_true",
        help="no prefill gate (as --prefill-wait-s 0): the replay before it",
    )
    parser.add_argument(
        "--shortlist-above",
        type=int,
        default=64,
        help="policy.shortlist_above: the candidate shortlist above N workers (0: never)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder")


def config_from_args(ns: argparse.Namespace, time_scale: float) -> ReplayConfig:
    """The :class:`ReplayConfig` of parsed :func:`add_common_args` at ``time_scale``."""
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
        page_size=ns.page_size,
        exact=ns.exact,
        hybrid=not ns.no_hybrid,
        event_delay_s=ns.event_delay_ms / 1000,
        bounds=not ns.no_bounds,
        max_loaded_loras=ns.max_loaded_loras,
        max_loras_per_batch=ns.max_loras_per_batch,
        lora_load_s=ns.lora_load_s,
        lora_affinity=not ns.no_lora_affinity,
        membership=plan_from_args(ns),
        hicache=ns.hicache,
        hicache_ratio=ns.hicache_ratio,
        hicache_write_policy=ns.hicache_write_policy,
        hicache_link=ns.hicache_link,
        host_tier=not ns.no_host_tier,
        prefill_wait_s=0.0 if ns.no_prefill_gate else ns.prefill_wait_s,
        shortlist_above=ns.shortlist_above,
    )
