"""Exact vs approximate vs hybrid prefix routing under capacity pressure (issues 9, 17).

    python -m loadtests.micro.kv_events [--workers 8] [--requests 400] [--concurrency 16]
    python -m loadtests.micro.kv_events --workload tenants [--workload-arg k=v ...]
        [--time-scale X] [--modes approximate,exact,hybrid,random] [--tokenizer-path DIR]

One in-process run per mode, each on a fresh simulated fleet with KV events on (the
approximate run simply does not follow them) and the gateway's default policy. Workload:
multi-tenant shared context sized to overflow the fleet's KV pool (like llm-d's
benchmark): ``tenants`` contexts of ``context_words`` words, each request one tenant's
context (Zipf-like popularity) plus a unique question, ``/generate`` with one output token,
so latency is time to first token plus one decode step.

Reported per mode: precision of predicted hits (Σ min(predicted, reported) / Σ predicted
cached tokens), recall-like cached fraction (Σ reported cached / Σ prompt tokens), latency
p50/p99 in modelled seconds (wall time multiplied by speed).

``--workload tenants``: llm-d's tenant workload instead (``loadtests/workloads/
multi_tenant.py``; sized to 0.73 of the fleet's KV, ``workers x capacity_tokens``; its
other parameters by ``--workload-arg``, its arrival rates times ``--time-scale``), sent
open loop at its arrival times (``loadtests.bench.client``: streamed chat completions,
TTFT = the first event) through the gateway to a fresh fleet per mode. Reported per mode:
TTFT p50 / p90 / mean (modelled seconds), the cached fraction, output tokens per modelled
second (Σ completion tokens / the run's wall time x speed), the precision of the chosen
worker's predicted match against the reported one (from the gateway's decision records)
and how many decisions each index mode made. ``random`` is the random policy (no events
followed). ``--tokenizer-path DIR``: the workers tokenize with that real tokenizer (its
chat template) and the gateway follows them with ``hf:DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway.http import app_keys
from loadtests.bench.client import Outcome, ReplayItem, replay
from loadtests.harness.inprocess import run_gateway
from loadtests.harness.stats import percentile
from loadtests.workloads import create_workload
from loadtests.workloads.multi_tenant import TENANTS_NAME
from simulator.fleet import SimConfig, SimulatedFleet
from simulator.model.profiles import DEFAULT_PROFILE

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
)
MODES: dict[str, dict[str, Any]] = {
    "approximate": {"kv_events__enabled": False},
    "exact": {"kv_events__enabled": True, "kv_events__hybrid": False},
    "hybrid": {"kv_events__enabled": True, "kv_events__hybrid": True},
    "random": {"kv_events__enabled": False, "policy__name": "random"},
}
DEFAULT_MODES = ("approximate", "exact", "hybrid")


@dataclass
class Args:
    workers: int = 8
    requests: int = 400
    concurrency: int = 16
    tenants: int = 40
    context_words: int = 600
    capacity_tokens: int = 8000
    speed: float = 20.0
    seed: int = 1
    profile: str = DEFAULT_PROFILE  # the workers' latency profile
    workload: str = "zipf"  # or "tenants"
    time_scale: float = 1.0  # tenants: arrival rates multiplied by this
    tokenizer_path: str = ""  # a real tokenizer directory for workers and gateway
    timeout_s: float = 300.0  # tenants: per request, wall seconds


@dataclass
class Result:
    predicted: int = 0
    true_predicted: int = 0
    reported: int = 0
    prompt: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0


def _prompts(args: Args) -> list[str]:
    rng = random.Random(args.seed)
    contexts = [
        " ".join(f"t{t}c{rng.randrange(10**6)}" for _ in range(args.context_words))
        for t in range(args.tenants)
    ]
    weights = [1.0 / (t + 1) ** 0.6 for t in range(args.tenants)]
    out = []
    for i in range(args.requests):
        tenant = rng.choices(range(args.tenants), weights)[0]
        out.append(f"{contexts[tenant]} question {i} " + " ".join(f"q{i}w{k}" for k in range(20)))
    return out


async def _one(
    session: aiohttp.ClientSession, url: str, prompt: str, result: Result, speed: float
) -> None:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
    started = time.perf_counter()
    async with session.post(f"{url}/generate", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            result.errors += 1
            return
        predicted = int(resp.headers.get("x-gateway-matched-tokens", "0"))
    result.latencies.append((time.perf_counter() - started) * speed)
    meta = data["meta_info"]
    reported = int(meta.get("cached_tokens") or 0)
    result.predicted += predicted
    result.true_predicted += min(predicted, reported)
    result.reported += reported
    result.prompt += int(meta["prompt_tokens"])


def fleet_config(args: Args) -> SimConfig:
    return SimConfig(
        speed=args.speed,
        page_size=16,
        capacity_tokens=args.capacity_tokens,
        kv_events_config=KV_CONFIG,
        tokenizer_path=args.tokenizer_path or None,
        profile=args.profile,
    )


def gateway_overrides(mode: str, args: Args) -> dict[str, Any]:
    overrides: dict[str, Any] = {"policy__name": "min_ttft", **MODES[mode]}
    if args.tokenizer_path:
        overrides["kv_events__tokenizer"] = f"hf:{args.tokenizer_path}"
    return overrides


async def run_mode(mode: str, args: Args, prompts: list[str]) -> Result:
    config = fleet_config(args)
    result = Result()
    async with await SimulatedFleet.start(args.workers, config) as fleet:
        overrides = gateway_overrides(mode, args)
        async with run_gateway(fleet.urls, **overrides) as gw, aiohttp.ClientSession() as s:
            await asyncio.sleep(0.5)  # discovery and subscriptions
            queue = list(reversed(prompts))

            async def client() -> None:
                while queue:
                    await _one(s, gw.url, queue.pop(), result, args.speed)

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return result


def report(results: dict[str, Result]) -> str:
    lines = [
        "| mode | precision of predicted hits | cached-token fraction | latency p50 (s) | "
        "latency p99 (s) | errors |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        precision = r.true_predicted / r.predicted if r.predicted else float("nan")
        lines.append(
            f"| {mode} | {precision:.3f} | {r.reported / max(1, r.prompt):.3f} | "
            f"{percentile(r.latencies, 50, 'upper'):.3f} | "
            f"{percentile(r.latencies, 99, 'upper'):.3f} | {r.errors} |"
        )
    return "\n".join(lines)


@dataclass
class TenantResult:
    outcomes: list[Outcome]
    wall_s: float
    speed: float
    predicted: int = 0
    true_predicted: int = 0
    modes: dict[str, int] = field(default_factory=dict)


def tenant_items(args: Args, workload_args: list[str]) -> tuple[list[ReplayItem], str]:
    """The tenants workload at ``args``' fleet size, as open-loop items in wall time."""
    capacity = args.workers * args.capacity_tokens
    w = create_workload(
        TENANTS_NAME, [f"capacity_tokens={capacity}", f"seed={args.seed}", *workload_args]
    ).scaled(args.time_scale)
    p = w.params
    about = (
        f"{p['tenants']} tenants x {p['users_per_tenant']} users, context {p['context_len']}, "
        f"question {p['question_len']}, output {p['output_len']} tokens; working set "
        f"{p['working_set_tokens']:,} = {p['working_set_tokens'] / capacity:.2f} of "
        f"{args.workers} x {args.capacity_tokens:,}; {len(w.requests)} requests over "
        f"{w.requests[-1].arrival_s:.0f} modelled s (time scale {args.time_scale:g})"
    )
    items = [
        ReplayItem(r.index, r.arrival_s / args.speed, orjson.dumps(r.body())) for r in w.requests
    ]
    return items, about


async def run_tenant_mode(mode: str, args: Args, items: list[ReplayItem]) -> TenantResult:
    async with await SimulatedFleet.start(args.workers, fleet_config(args)) as fleet:
        overrides = {**gateway_overrides(mode, args), "decisions__ring_size": len(items) + 16}
        async with run_gateway(fleet.urls, **overrides) as gw:
            await asyncio.sleep(0.5)  # discovery and subscriptions
            outcomes, wall = await replay(items, lambda _: gw.url, math.inf, args.timeout_s)
            result = TenantResult(outcomes, wall, args.speed)
            for rec in gw.app[app_keys.DECISIONS].latest(len(items) + 16):
                reported = rec.outcome.reported_cached_tokens if rec.outcome else None
                if reported is None:
                    continue
                result.predicted += rec.matched_tokens
                result.true_predicted += min(rec.matched_tokens, reported)
                mode_name = rec.index_mode or "approximate"
                result.modes[mode_name] = result.modes.get(mode_name, 0) + 1
    return result


def tenant_report(results: dict[str, TenantResult]) -> str:
    lines = [
        "| mode | TTFT p50 (s) | p90 (s) | mean (s) | cached fraction | output tok/s "
        "| precision | decisions by index mode | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        ok = [o for o in r.outcomes if o.ok and o.ttft_s is not None]
        ttfts = [(o.ttft_s or 0.0) * r.speed for o in ok]
        prompt = sum(o.prompt_tokens for o in ok)
        output = sum(o.completion_tokens for o in ok)
        precision = r.true_predicted / r.predicted if r.predicted else float("nan")
        modes = ", ".join(f"{k} {v}" for k, v in sorted(r.modes.items()))
        mean = sum(ttfts) / len(ttfts) if ttfts else float("nan")
        lines.append(
            f"| {mode} | {percentile(ttfts, 50, 'linear'):.3f} | "
            f"{percentile(ttfts, 90, 'linear'):.3f} | {mean:.3f} | "
            f"{sum(o.cached_tokens for o in ok) / max(1, prompt):.3f} | "
            f"{output / (r.wall_s * r.speed):,.0f} | {precision:.3f} | {modes} | "
            f"{len(r.outcomes) - len(ok)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Args()
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=", ".join(MODES))
    parser.add_argument("--workload-arg", action="append", default=[], metavar="K=V",
                        help="a parameter of the tenants workload")  # fmt: skip
    ns = parser.parse_args()
    args = Args(**{k: v for k, v in vars(ns).items() if k not in ("modes", "workload_arg")})
    modes = ns.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    if args.workload == TENANTS_NAME:
        items, about = tenant_items(args, ns.workload_arg)
        print(about)
        tenants = {m: asyncio.run(run_tenant_mode(m, args, items)) for m in modes}
        print(tenant_report(tenants))
        return
    if args.workload != "zipf":
        parser.error("--workload is zipf (the default) or tenants")
    prompts = _prompts(args)
    results = {m: asyncio.run(run_mode(m, args, prompts)) for m in modes}
    print(report(results))


if __name__ == "__main__":
    main()
