"""Exact vs approximate vs hybrid prefix routing under capacity pressure (issue 9).

    python -m loadtests.micro.kv_events [--workers 8] [--requests 400] [--concurrency 16]

One in-process run per mode, each on a fresh simulated fleet with KV events on (the
approximate run simply does not follow them) and the gateway's default policy. Workload:
multi-tenant shared context sized to overflow the fleet's KV pool (like llm-d's
benchmark): ``tenants`` contexts of ``context_words`` words, each request one tenant's
context (Zipf-like popularity) plus a unique question, ``/generate`` with one output token,
so latency is time to first token plus one decode step.

Reported per mode: precision of predicted hits (Σ min(predicted, reported) / Σ predicted
cached tokens), recall-like cached fraction (Σ reported cached / Σ prompt tokens), latency
p50/p99 in modelled seconds (wall time multiplied by speed).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtests.harness.inprocess import run_gateway
from loadtests.harness.stats import percentile
from simulator.fleet import SimConfig, SimulatedFleet

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
)
MODES: dict[str, dict[str, Any]] = {
    "approximate": {"kv_events__enabled": False},
    "exact": {"kv_events__enabled": True, "kv_events__hybrid": False},
    "hybrid": {"kv_events__enabled": True, "kv_events__hybrid": True},
}


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


async def run_mode(mode: str, args: Args, prompts: list[str]) -> Result:
    config = SimConfig(
        speed=args.speed,
        page_size=16,
        capacity_tokens=args.capacity_tokens,
        kv_events_config=KV_CONFIG,
    )
    result = Result()
    async with await SimulatedFleet.start(args.workers, config) as fleet:
        overrides = {"policy__name": "min_ttft", **MODES[mode]}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Args()
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--modes", default=",".join(MODES))
    ns = parser.parse_args()
    args = Args(**{k: v for k, v in vars(ns).items() if k != "modes"})
    prompts = _prompts(args)
    results = {m: asyncio.run(run_mode(m, args, prompts)) for m in ns.modes.split(",")}
    print(report(results))


if __name__ == "__main__":
    main()
