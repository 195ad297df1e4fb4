"""Worked example: tune the routing policy on your own traffic, then apply it live.

Run: ``python -m loadtests.bench.tuning_example``. Everything on 127.0.0.1,
bounded (two phases of ``--requests`` each), and stopped at the end.

1. Live, phase 1: simulated SGLang workers behind the gateway running ``round_robin``
   (what a gateway without prefix routing does); a shared-prefix workload (groups of
   requests sharing a long system prompt) arrives open-loop.
2. Export: ``GET /debug/trace`` → a Mooncake JSONL file of phase 1.
3. Replay that file offline under ``round_robin``, ``cache_aware`` and ``min_ttft`` on the
   same worker model, profile and capacity: the predicted cached fraction and TTFT.
4. Apply the best with ``PUT /admin/policy`` (no restart).
5. Live, phase 2: the same shape of traffic with fresh prompts (a new seed: phase 1's
   caches cannot help it). Its figures, beside the replay's prediction.

Live figures are the engines' own (``usage.prompt_tokens_details.cached_tokens`` over
``usage.prompt_tokens``; TTFT to the first content chunk, in modelled seconds).
Prints a Markdown table for BENCHMARKS.md ("Tuning on live traffic").
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests.harness.inprocess import run_gateway
from loadtests.harness.stats import percentile
from loadtests.replay.run import ReplayConfig, run_replay
from loadtests.workloads import create_workload
from loadtests.workloads.base import WorkloadRequest
from simulator.fleet import SimConfig, SimulatedFleet

WORKERS = 4
CAPACITY = 40_000
PROFILE = "llama3-8b-h100"
CANDIDATES = ("round_robin", "cache_aware", "min_ttft")
MODEL = "sim-model"


def _workload(seed: int, requests: int, rate: float) -> list[WorkloadRequest]:
    groups = max(1, requests // 8)
    args = [f"num_groups={groups}", "prompts_per_group=8", "system_prompt_len=2048",
            "question_len=128", "output_len=16", f"request_rate={rate}",
            f"seed={seed}"]  # fmt: skip
    return list(create_workload("generated-shared-prefix", args).requests)


async def _one(
    session: aiohttp.ClientSession, url: str, req: WorkloadRequest, t0: float, speed: float
) -> tuple[float, int, int]:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s / speed - time.perf_counter()))
    body = {**req.body(MODEL), "stream": True, "stream_options": {"include_usage": True}}
    sent, ttft = time.perf_counter(), None
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/chat/completions", data=orjson.dumps(body)) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[5:])
            if ttft is None and chunk.get("choices"):
                ttft = (time.perf_counter() - sent) * speed
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return ttft or 0.0, int(details.get("cached_tokens", 0)), int(usage.get("prompt_tokens", 0))


async def _phase(url: str, requests: list[WorkloadRequest], speed: float) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter() + 0.1
        results = await asyncio.gather(*(_one(session, url, r, t0, speed) for r in requests))
    ttfts = [t for t, _, _ in results]
    return {
        "cached": sum(c for _, c, _ in results) / max(1, sum(p for _, _, p in results)),
        "p50": percentile(ttfts, 50, "linear"),
        "p90": percentile(ttfts, 90, "linear"),
    }


def _replay(trace: Path, policy: str) -> dict[str, float]:
    summary = run_replay(ReplayConfig(WORKERS, CAPACITY, policy, trace=str(trace), profile=PROFILE))
    return {"cached": summary["hit_rate"], "p50": summary["ttft_s"]["p50"],
            "p90": summary["ttft_s"]["p90"]}  # fmt: skip


async def run(requests: int, rate: float, speed: float) -> list[tuple[str, str, dict[str, float]]]:
    """(step, policy, figures) rows, in order."""
    rows: list[tuple[str, str, dict[str, float]]] = []
    config = SimConfig(speed=speed, capacity_tokens=CAPACITY, profile=PROFILE)
    async with (
        await SimulatedFleet.start(WORKERS, config) as fleet,
        run_gateway(fleet.urls, policy__name="round_robin", load__poll_interval_s=0.2 / speed)
        as gw,
        aiohttp.ClientSession() as session,
    ):  # fmt: skip
        start = time.time()
        rows.append(("live, phase 1", "round_robin",
                     await _phase(gw.url, _workload(1, requests, rate), speed)))  # fmt: skip
        async with session.get(gw.url + "/debug/trace", params={"since": str(start)}) as resp:
            trace_text = await resp.read()
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "phase1.jsonl"
            trace.write_bytes(trace_text)
            predicted = {p: _replay(trace, p) for p in CANDIDATES}
        for policy, figures in predicted.items():
            rows.append(("replay of phase 1", policy, figures))
        best = max(CANDIDATES, key=lambda p: (predicted[p]["cached"], -predicted[p]["p50"]))
        async with session.put(gw.url + "/admin/policy", json={"name": best}) as resp:
            resp.raise_for_status()
        rows.append(("live, phase 2", best,
                     await _phase(gw.url, _workload(2, requests, rate), speed)))  # fmt: skip
    return rows


def _table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    lines = ["| step | policy | cached fraction | TTFT p50 (s) | TTFT p90 (s) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for step, policy, f in rows:
        lines.append(f"| {step} | {policy} | {f['cached']:.3f} | {f['p50']:.3f} | {f['p90']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96, help="per phase")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per modelled second")
    parser.add_argument("--speed", type=float, default=1.0, help="simulated worker speed-up")
    ns = parser.parse_args(argv)
    print(_table(asyncio.run(run(ns.requests, ns.rate, ns.speed))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
