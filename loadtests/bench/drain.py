"""A drain and a scale-out live (issue 20): naive against cache-aware, through the gateway
on simulated SGLang workers.

    python -m loadtests.bench.drain [--event drain|join|both] [--workers 4] [--speed 1]
        [--workload-arg k=v ...] [--at 40] [--drain-period 20] [--window 60]

Per event and mode, a fresh fleet (``python -m simulator``, ``--workers`` + 1 processes'
worth of workers in one subprocess, profile ``llama3-8b-h100``) and a fresh gateway
subprocess (``min_ttft``); the same seeded ``multi-turn`` workload, open loop at its
arrival times (÷ ``--speed``) through ``loadtests.bench.client``.

- **drain**: at ``--at`` s, ``POST /workers/{id}/drain`` of the worker that served the
  most sessions' last request so far, and ``DELETE`` it ``--drain-period`` s later.
  *Naive*: ``?rehome=false`` and no prompt store; *cache-aware*: the gateway keeps prompts
  (``--prompt-store-bytes``), re-homes and pre-warms (``--prewarm-tokens-per-sec``).
  Affected sessions: those whose last request before the drain that worker served; their
  requests arriving within ``--window`` s of the drain are the figures' rows.
- **join**: the gateway starts with ``--workers`` workers, and at ``--at`` s ``POST
  /workers`` adds one more. *Naive*: it takes requests at once; *cache-aware*: slow start
  (``--slow-start-window-secs``) and the shared prefix pre-warmed. Rows: every request
  within the window, and those the new worker served.

Reported: TTFT p50 / p99 (modelled s: wall x ``--speed``), the hit rate from the usage
the workers reported, the prefill tokens computed (prompt minus cached) by the window's
requests, and the pre-warm's own (the drain's or join's report: ``tokens_reported``); the
machine's 1-minute load average (the machine is shared: live TTFTs carry its noise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests.bench.client import Outcome, ReplayItem, replay
from loadtests.harness.gateway_proc import run_gateway
from loadtests.harness.sim_fleet import SimSettings, run_sim_fleet
from loadtests.harness.stats import percentile
from loadtests.workloads import create_workload

DEFAULT_WORKLOAD = (
    "sessions=240", "session_rate=3", "turns=6", "system_prompt_len=1024", "user_len=256",
    "answer_len=96", "think_time_s=12",
)  # fmt: skip
MODES = ("naive", "cache_aware")


@dataclass
class Run:
    event: str
    mode: str
    outcomes: list[Outcome] = field(default_factory=list)
    sessions: dict[int, str] = field(default_factory=dict)  # request index -> session
    arrivals: dict[int, float] = field(default_factory=dict)  # request index -> modelled s
    target: str = ""  # the drained or joined worker's URL
    report: dict[str, Any] | None = None  # the drain's / join's report
    load_1m: float = 0.0


def _gateway_args(event: str, mode: str, args: argparse.Namespace) -> list[str]:
    out = ["--log-level", "warning"]
    if mode == "cache_aware":
        out += ["--prompt-store-bytes", str(64 << 20),
                "--prewarm-tokens-per-sec", str(args.prewarm_tokens_per_s)]  # fmt: skip
        if event == "join":
            out += ["--slow-start-window-secs", str(args.slow_start_s / args.speed)]
    return out


async def _event(run: Run, gw: str, urls: Sequence[str], args: argparse.Namespace) -> None:
    """The drain or the join, at ``--at`` modelled seconds (wall: ÷ speed)."""
    await asyncio.sleep(args.at / args.speed)
    async with aiohttp.ClientSession() as session:
        if run.event == "join":
            run.target = urls[-1]
            async with session.post(gw + "/workers", json={"url": run.target}) as resp:
                added = await resp.json()
            await asyncio.sleep(args.window / args.speed)
            async with session.get(f"{gw}/workers/{added['id']}/join") as resp:
                run.report = await resp.json() if resp.status == 200 else None
            return
        # the worker that served most of the last 200 decisions: where sessions live
        async with session.get(gw + "/debug/decisions?limit=200") as resp:
            recent = [d["worker"] for d in (await resp.json())["decisions"]]
        async with session.get(gw + "/workers") as resp:
            url_of = {w["id"]: w["url"] for w in (await resp.json())["workers"]}
        wid = max(set(recent), key=recent.count)
        run.target = url_of[wid]
        query = "" if run.mode == "cache_aware" else "?rehome=false&prewarm=false"
        async with session.post(f"{gw}/workers/{wid}/drain{query}") as resp:
            assert resp.status == 202, await resp.text()
        await asyncio.sleep(args.drain_period / args.speed)
        async with session.get(f"{gw}/workers/{wid}/drain") as resp:
            run.report = await resp.json()
        async with session.delete(f"{gw}/workers/{wid}") as resp:
            assert resp.status == 200


def run_one(event: str, mode: str, args: argparse.Namespace, log_dir: Path) -> Run:
    wl = create_workload("multi-turn", list(args.workload_arg or DEFAULT_WORKLOAD))
    items = [
        ReplayItem(r.index, r.arrival_s / args.speed, orjson.dumps(r.body(model="tiny-llama")))
        for r in wl.requests
    ]
    run = Run(event, mode)
    run.sessions = {r.index: r.session_id or "" for r in wl.requests}
    run.arrivals = {r.index: r.arrival_s for r in wl.requests}
    settings = SimSettings(profile="llama3-8b-h100", speed=args.speed,
                           capacity_tokens=args.capacity_tokens,
                           max_running_requests=None)  # fmt: skip
    k = args.workers + (1 if event == "join" else 0)
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(run_sim_fleet(k, settings, log_dir / f"{event}-{mode}"))
        start = urls[: args.workers]
        extra = _gateway_args(event, mode, args)
        proc = stack.enter_context(
            run_gateway(start, "min_ttft", log_dir / f"{event}-{mode}.log", extra)
        )

        async def go() -> None:
            until = (args.at + args.window) / args.speed
            todo = [i for i in items if i.at_s <= until]
            event_task = asyncio.create_task(_event(run, proc.url, urls, args))
            outcomes, _ = await replay(todo, lambda _: proc.url, until + 5, args.timeout)
            run.outcomes = outcomes
            await event_task

        asyncio.run(go())
    run.load_1m = os.getloadavg()[0]
    return run


def figures(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """The rows (module docstring)."""
    t0, t1 = args.at, args.at + args.window
    window = [o for o in run.outcomes if t0 <= run.arrivals[o.index] < t1]
    if run.event == "drain":
        before = [o for o in run.outcomes if run.arrivals[o.index] < t0 and o.worker]
        last: dict[str, str] = {}
        for o in sorted(before, key=lambda o: run.arrivals[o.index]):
            last[run.sessions[o.index]] = o.worker or ""
        homed = {s for s, w in last.items() if w == run.target}
        rows = [o for o in window if run.sessions[o.index] in homed]
    else:
        rows = [o for o in window if o.worker == run.target]
    prewarm = 0
    if run.report is not None and run.report.get("prewarm"):
        prewarm = int(run.report["prewarm"]["tokens_reported"])
    computed = sum(o.prompt_tokens - o.cached_tokens for o in window if o.ok)
    return {
        "event": run.event, "mode": run.mode, "target": run.target,
        "rows": _group(rows, args.speed), "window": _group(window, args.speed),
        "prefill_tokens_window": computed, "prewarm_tokens": prewarm,
        "prewarm_share_window": prewarm / computed if computed else float("nan"),
        "report": run.report, "load_1m": run.load_1m,
        "errors": sum(1 for o in run.outcomes if not o.ok),
    }  # fmt: skip


def _group(outcomes: Sequence[Outcome], speed: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    ttfts = [(o.ttft_s or 0.0) * speed for o in ok if o.ttft_s is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "requests": len(outcomes),
        "ttft_p50": percentile(ttfts, 50, "linear") if ttfts else float("nan"),
        "ttft_p99": percentile(ttfts, 99, "linear") if ttfts else float("nan"),
        "hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else float("nan"),
    }


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| event | mode | rows | TTFT p50 (s) | p99 (s) | hit rate | window p99 (s) "
        "| window hit | pre-warm tokens | / window prefill | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in results:
        r, w = f["rows"], f["window"]
        lines.append(
            f"| {f['event']} | {f['mode']} | {r['requests']} | {r['ttft_p50']:.3f} "
            f"| {r['ttft_p99']:.3f} | {r['hit_rate']:.3f} | {w['ttft_p99']:.3f} "
            f"| {w['hit_rate']:.3f} | {f['prewarm_tokens']:,} "
            f"| {f['prewarm_share_window']:.2%} | {f['load_1m']:.1f} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.drain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--event", choices=("drain", "join", "both"), default="both")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--capacity-tokens", type=int, default=60_000)
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--workload-arg", action="append", metavar="K=V")
    p.add_argument("--at", type=float, default=40.0, help="the event, modelled s")
    p.add_argument("--drain-period", type=float, default=20.0)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--prewarm-tokens-per-s", type=float, default=8000.0)
    p.add_argument("--slow-start-s", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=None, help="results.json here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    events = ("drain", "join") if args.event == "both" else (args.event,)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-drain-") as tmp:
        for event in events:
            for mode in MODES:
                results.append(figures(run_one(event, mode, args, Path(tmp)), args))
                print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
