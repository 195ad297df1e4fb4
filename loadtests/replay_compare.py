"""``python -m loadtests.replay compare DIR...``: one Markdown table of several runs.

Each ``DIR`` (or ``DIR/summary.json``) is a finished replay; rows keep the given order.
Columns: policy, token hit rate, hit efficiency against OPT and pooled LRU, TTFT mean /
p90 / p99, prefill-work efficiency, load imbalance (mean over 60 s windows); the bounds of
the first run head the table (the runs are expected to share a workload).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _load(path: str) -> dict[str, Any]:
    p = Path(path)
    data: dict[str, Any] = json.loads((p / "summary.json" if p.is_dir() else p).read_text())
    return data


def _f(value: Any, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _label(summary: Mapping[str, Any]) -> str:
    config = summary.get("config", {})
    args = config.get("policy_args") or {}
    extra = " " + json.dumps(args, sort_keys=True) if args else ""
    return f"{config.get('policy', '?')}{extra}"


def compare_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    if not summaries:
        return ""
    b = summaries[0]["bounds"]
    lines = [
        f"Bounds (token level): H_inf {_f(b['infinite'], 3)}, OPT {_f(b['opt'], 3)}, "
        f"LRU pooled {_f(b['lru_pooled'], 3)}.",
        "",
        "| policy | hit rate | / OPT | / LRU pooled | TTFT mean | p90 | p99 (s) "
        "| prefill-work eff. | imbalance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        t, e = s["ttft_s"], s["efficiency"]
        lines.append(
            f"| {_label(s)} | {_f(s['hit_rate'], 3)} | {_f(e['opt'], 2)} | "
            f"{_f(e['lru_pooled'], 2)} | {_f(t['mean'], 2)} | {_f(t['p90'], 2)} | "
            f"{_f(t['p99'], 2)} | {_f(s['prefill_work_efficiency'], 2)} | "
            f"{_f(s['load_imbalance']['mean'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def compare_main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m loadtests.replay compare DIR [DIR ...]")
        return 2
    print(compare_table([_load(a) for a in argv]), end="")
    return 0
