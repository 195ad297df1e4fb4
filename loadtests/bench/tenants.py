"""The llm-d tenant workload in the offline replay: exact, approximate, random and the
peers' rule on one fleet, one table, llm-d's published figures beside.

    python -m loadtests.bench.tenants [--time-scale 1] [--workload-arg stage_scale=0.25]
        [--rows exact,approximate,random,cache_aware,sglang_rule] [--jobs 2] [--out DIR]

Every row is one :func:`loadtests.replay.run.run_replay` of the ``tenants`` workload
(``loadtests/workloads/multi_tenant.py``: llm-d's 150 tenants x 5 users, 6,000-token
contexts, 1,200-token questions, 1,000 output tokens, its 3 → 60 QPS ramp, sized to 73 %
of the fleet's KV) on the same simulated fleet: by default llm-d's, 8 workers of 307,328
KV tokens (one vLLM pod of 2 H100 each in the original), page 16, with the simulator's
H100 latency profile (``llama3-8b-h100``: the only H100 profile; it models Llama-3-8B on
one H100, not Qwen-32B on two). Rows (``--rows``):

* ``exact``: the default policy (``min_ttft``) with exact mode: the gateway follows every
  worker's KV events, applied ``--event-delay-ms`` after the step that made them
  (``loadtests/replay/exact.py``), hybrid predicted blocks on (the gateway's default);
* ``exact_no_hybrid``: the same without predicted blocks;
* ``approximate``: ``min_ttft`` on the approximate prefix index (no events);
* ``random``, ``cache_aware``: those policies of ``policies/``, approximate;
* ``sglang_rule``: the replay's reference re-implementation of sglang-router's
  ``cache_aware`` rule (``loadtests/replay/sglang_rule.py``).

Figures per row: TTFT p50 / p90 / mean, the token hit rate (cached fraction: Σ cached /
Σ prompt tokens, as the workers report), output tokens per second over the run (Σ output
tokens / (last finish - first arrival)), and the precision of the chosen worker's predicted
match against what it then reported. ``--time-scale X`` multiplies every arrival rate by
X (0.2: the same requests at 0.6 → 12 QPS). Rows run in up to ``--jobs`` processes (at
most 2). Bounds (OPT over every 16-token block) are off unless ``--bounds``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loadtests.replay.exact import DEFAULT_EVENT_DELAY_S
from loadtests.replay.report import json_safe
from loadtests.replay.run import ReplayConfig, run_replay
from loadtests.replay.sglang_rule import REFERENCE_NAME
from loadtests.workloads.multi_tenant import LLMD_POD_KV_TOKENS, LLMD_PODS, TENANTS_NAME


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    policy: str
    exact: bool = False
    hybrid: bool = True


ROWS: dict[str, Row] = {
    r.label: r
    for r in (
        Row("exact", "min_ttft", exact=True),
        Row("exact_no_hybrid", "min_ttft", exact=True, hybrid=False),
        Row("approximate", "min_ttft"),
        Row("random", "random"),
        Row("cache_aware", "cache_aware"),
        Row("sglang_rule", REFERENCE_NAME),
    )
}
DEFAULT_ROWS = ("exact", "approximate", "random", "cache_aware", "sglang_rule")

# llm-d, "KV-cache wins you can see" (llm-d.ai blog, 2025-09-24), summary table:
# (output tokens/s, TTFT p90 s, TTFT mean s); no p50 and no hit rate are published.
LLMD_PUBLISHED: dict[str, tuple[float, float, float]] = {
    "precise-scheduling": (8730.0, 0.542, 0.298),
    "approximate-scheduling": (6944.4, 31.083, 13.316),
    "load-scheduling": (4428.7, 94.865, 46.987),
    "random-scheduling": (4428.7, 92.551, 45.281),
}
LLMD_COUNTERPART = {
    "exact": "precise-scheduling",
    "exact_no_hybrid": "precise-scheduling",
    "approximate": "approximate-scheduling",
    "random": "random-scheduling",
}


def configs(ns: argparse.Namespace) -> list[tuple[Row, ReplayConfig]]:
    base = ReplayConfig(
        workers=ns.workers,
        capacity_tokens=ns.capacity_tokens,
        policy="min_ttft",
        workload=TENANTS_NAME,
        workload_args=(f"capacity_tokens={ns.workers * ns.capacity_tokens}", *ns.workload_arg),
        time_scale=ns.time_scale,
        profile=ns.profile,
        seed=ns.seed,
        page_size=ns.page_size,
        event_delay_s=ns.event_delay_ms / 1000,
        bounds=ns.bounds,
    )
    out = []
    for label in ns.rows.split(","):
        row = ROWS.get(label.strip())
        if row is None:
            raise SystemExit(f"unknown row {label!r}; known: {', '.join(ROWS)}")
        out.append((row, replace(base, policy=row.policy, exact=row.exact, hybrid=row.hybrid)))
    return out


def _f(value: Any, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def render(results: Sequence[tuple[Row, Mapping[str, Any]]]) -> str:
    """The rows as a Markdown table, llm-d's published figures beside."""
    lines = [
        "| row | policy | TTFT p50 (s) | p90 (s) | mean (s) | hit rate | output tok/s "
        "| precision | completed | llm-d counterpart: p90 (s) / output tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, s in results:
        t = s["ttft_s"]
        peer = LLMD_COUNTERPART.get(row.label)
        published = ""
        if peer is not None:
            tok, p90, _ = LLMD_PUBLISHED[peer]
            published = f"{peer}: {p90:g} / {tok:,.0f}"
        lines.append(
            f"| {row.label} | {row.policy} | {_f(t['p50'], 3)} | {_f(t['p90'], 3)} | "
            f"{_f(t['mean'], 3)} | {_f(s['hit_rate'], 3)} | "
            f"{_f(s['output_tokens_per_s'], 0)} | "
            f"{_f(s['index_fidelity']['precision_reported'], 3)} | "
            f"{s['completed']}/{s['requests']} | {published} |"
        )
    return "\n".join(lines)


def describe(results: Sequence[tuple[Row, Mapping[str, Any]]]) -> str:
    s = results[0][1]
    params = s["workload_params"]
    config = s["config"]
    return (
        f"tenants {params['tenants']} x {params['users_per_tenant']} users, context "
        f"{params['context_len']}, question {params['question_len']}, output "
        f"{params['output_len']} tokens; working set {params['working_set_tokens']:,} tokens "
        f"= {params['working_set_tokens'] / (config['workers'] * config['capacity_tokens']):.2f}"
        f" of {config['workers']} x {config['capacity_tokens']:,}; {s['requests']} requests, "
        f"time scale {config['time_scale']:g}, stage scale {params['stage_scale']:g}, "
        f"profile {config['profile']}, page {config['page_size']}, event delay "
        f"{config['event_delay_s'] * 1000:g} ms"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.tenants",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS))
    parser.add_argument("--workers", type=int, default=LLMD_PODS)
    parser.add_argument("--capacity-tokens", type=int, default=LLMD_POD_KV_TOKENS)
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="K=V",
        help="a parameter of the tenants workload, e.g. stage_scale=0.25",
    )
    parser.add_argument("--event-delay-ms", type=float, default=DEFAULT_EVENT_DELAY_S * 1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bounds", action="store_true", help="compute the bounds too")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    ns = parser.parse_args(argv)
    plan = configs(ns)
    started = time.perf_counter()
    jobs = max(1, min(ns.jobs, 2))
    if jobs == 1:
        summaries = [run_replay(c) for _, c in plan]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            summaries = list(pool.map(run_replay, [c for _, c in plan]))
    results = [(row, s) for (row, _), s in zip(plan, summaries, strict=True)]
    print(describe(results))
    print()
    print(render(results))
    walls = ", ".join(f"{row.label} {s['wall_s']:.0f} s" for row, s in results)
    print(f"\n{time.perf_counter() - started:.0f} s of wall time ({walls})")
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        rows = [{"row": asdict(r), "summary": s} for r, s in results]
        (ns.out / "results.json").write_text(json.dumps(json_safe(rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
