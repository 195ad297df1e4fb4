"""The drain and scale-out tables of BENCHMARKS.md (issue 20): every source x event x mode
x seed as an offline replay (``loadtests.replay.membership``), then one table per event.

    python -m loadtests.replay.drain_bench [--sources conversation,multi-turn]
        [--events drain,join] [--modes naive,rehome,cache_aware] [--seeds 0,1,2]
        [--jobs 2] --out out/drain

Sources (8 workers x 430,000 KV tokens, ``min_ttft``):

- ``conversation``: the Mooncake conversation trace at its own rate (x1), the first
  5,000 requests (23 minutes); the event at 900 s (caches long warm), figures over the
  600 s after it.
- ``multi-turn``: 3,000 chat sessions starting 4 per second (for 750 s), 8 turns each,
  a 2,048-token system prompt, 512-token questions, 256-token answers, 30 s between
  turns (an exponential mean); the event at 300 s (about 1,200 sessions open), figures
  over the 600 s after it.

Drain: the worker that served the most requests in the minute before (the busiest) is
drained and leaves 60 s later. Join: a ninth worker joins. The budget
is 32,000 pre-warm tokens per second (``--prewarm-tokens-per-s``; 4x the gateway's default,
under one simulated H100's prefill rate), the slow start window 60 s. Each run's summary is
written to ``--out/<source>-<event>-<mode>-s<seed>.json``; a run already there is read,
not run again (``--rerun`` runs it anyway). Rows: the mean over the seeds, and the range.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from loadtests.harness.stats import percentile
from loadtests.replay.membership import MODES, MembershipPlan
from loadtests.replay.run import ReplayConfig, run_replay

TRACE = "loadtests/data/mooncake_conversation.jsonl"
MULTI_TURN = (
    "sessions=3000", "session_rate=4", "turns=8", "system_prompt_len=2048", "user_len=512",
    "answer_len=256", "think_time_s=30",
)  # fmt: skip
EVENT_S = {"conversation": 900.0, "multi-turn": 300.0}


def config(
    source: str,
    event: str,
    mode: str,
    seed: int,
    rate: float,
    min_uses: int = 2,
    workload_args: Sequence[str] = MULTI_TURN,
    drain_worker: int = -1,
    max_home_queued: float = math.inf,
    max_home_share: float = math.inf,
) -> ReplayConfig:
    at = EVENT_S[source]
    plan = MembershipPlan(
        mode=mode,
        drain_worker=drain_worker if event == "drain" else None,
        drain_at_s=at,
        drain_period_s=60.0,
        join_at_s=at if event == "join" else None,
        window_s=600.0,
        prewarm_tokens_per_s=rate,
        min_uses=min_uses,
        prewarm_max_home_queued=max_home_queued,
        max_home_share=max_home_share,
        slow_start_s=60.0,
    )
    common: dict[str, Any] = {
        "workers": 8, "capacity_tokens": 430_000, "policy": "min_ttft", "seed": seed,
        "bounds": False, "membership": plan,
    }  # fmt: skip
    if source == "conversation":
        return ReplayConfig(trace=TRACE, limit=5000, **common)
    return ReplayConfig(workload="multi-turn", workload_args=tuple(workload_args), **common)


def _run(job: tuple[Path, ReplayConfig]) -> str:
    path, cfg = job
    summary = run_replay(cfg)
    keep = {"membership": summary["membership"], "wall_s": summary["wall_s"],
            "hit_rate": summary["hit_rate"], "ttft_s": summary["ttft_s"]}  # fmt: skip
    path.write_text(json.dumps(keep, default=str))
    return path.name


def _mean(values: Sequence[float]) -> tuple[float, float, float]:
    ok = [v for v in values if not math.isnan(v)]
    if not ok:
        return math.nan, math.nan, math.nan
    return sum(ok) / len(ok), min(ok), max(ok)


def _cell(values: Sequence[float], fmt: str) -> str:
    mean, lo, hi = _mean(values)
    if math.isnan(mean):
        return "n/a"
    if len(values) == 1 or lo == hi:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(lo, fmt)}-{format(hi, fmt)})"


def _pooled(groups: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The rows of every seed as one sample: TTFT p50 / p99, hit rate."""
    rows = [r for g in groups for r in (g.get("rows") or [])]
    ttfts = [t for t, _, _ in rows if t is not None]
    prompt = sum(p for _, p, _ in rows)
    nan = math.nan
    return {
        "requests": len(rows),
        "p50": percentile(ttfts, 50, "linear") if ttfts else nan,
        "p99": percentile(ttfts, 99, "linear") if ttfts else nan,
        "hit": sum(c for _, _, c in rows) / prompt if prompt else nan,
    }


def table(runs: dict[tuple[str, str, str], list[dict[str, Any]]], event: str) -> str:
    """One row per source and mode: the event's rows (affected sessions, or the new
    worker's requests) pooled over the seeds; every request in the window and the
    pre-warm as the mean over the seeds (range)."""
    rows = "affected" if event == "drain" else "new_worker"
    lines = [
        f"| source | mode | {rows} requests (seeds pooled) | TTFT p50 (s) | p99 (s) | hit rate "
        "| all in window: p99 (s) | hit rate | pre-warm tokens | / window prefill |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(runs.items(), key=lambda kv: (kv[0][0], MODES.index(kv[0][2])))
    for (source, ev, mode), figs in order:
        if ev != event:
            continue
        m = [f["membership"] for f in figs]
        pooled = _pooled([x[rows] for x in m])
        lines.append(
            f"| {source} | {mode} | {pooled['requests']} | {pooled['p50']:.3f} "
            f"| {pooled['p99']:.3f} | {pooled['hit']:.3f} "
            f"| {_cell([x['window']['ttft_p99'] for x in m], '.3f')} "
            f"| {_cell([x['window']['hit_rate'] for x in m], '.3f')} "
            f"| {_cell([x['prewarm_tokens'] for x in m], ',.0f')} "
            f"| {_cell([100 * x['prewarm_share_window'] for x in m], '.2f')} % |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.replay.drain_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--sources", default="conversation,multi-turn")
    p.add_argument("--events", default="drain,join")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--prewarm-tokens-per-s", type=float, default=32000.0)
    p.add_argument("--min-uses", type=int, default=2, help="drain.min_uses (2)")
    p.add_argument("--prewarm-max-home-queued", type=float, default=math.inf,
                   help="pre-warm a home only while its queued prefill tokens are at most "
                   "this (default: any)")  # fmt: skip
    p.add_argument("--max-home-share", type=float, default=math.inf,
                   help="a home's cap, x an even share (default inf: by load)")  # fmt: skip
    p.add_argument("--drain-worker", type=int, default=-1, help="its index (-1: the busiest)")
    p.add_argument("--multi-turn-arg", action="append", default=[], metavar="K=V",
                   help="override one of the multi-turn workload's arguments")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    keys = [(s, e, m, int(seed)) for s in args.sources.split(",") for e in args.events.split(",")
            for m in args.modes.split(",") for seed in args.seeds.split(",")]  # fmt: skip
    given = dict(a.split("=", 1) for a in args.multi_turn_arg)
    wargs = [f"{k}={given.pop(k, v)}" for k, v in (a.split("=", 1) for a in MULTI_TURN)]
    wargs += [f"{k}={v}" for k, v in given.items()]
    jobs = []
    for s, e, m, seed in keys:
        path = args.out / f"{s}-{e}-{m}-s{seed}.json"
        if args.rerun or not path.exists():
            cfg = config(s, e, m, seed, args.prewarm_tokens_per_s, args.min_uses, wargs,
                         args.drain_worker, args.prewarm_max_home_queued,
                         args.max_home_share)  # fmt: skip
            jobs.append((path, cfg))
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for name in pool.map(_run, jobs):
            print("done", name, flush=True)
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for s, e, m, seed in keys:
        path = args.out / f"{s}-{e}-{m}-s{seed}.json"
        runs.setdefault((s, e, m), []).append(json.loads(path.read_text()))
    for event in args.events.split(","):
        print(f"\n{event}:\n")
        print(table(runs, event))
    return 0


if __name__ == "__main__":
    sys.exit(main())
