"""``python -m loadtests.replay compare DIR...``: one Markdown table of several runs.

Each ``DIR`` (or ``DIR/summary.json``) is a finished replay; rows keep the given order.
Columns: policy, token hit rate, hit efficiency against OPT and pooled LRU, TTFT mean /
p90 / p99, prefill-work efficiency, load imbalance (mean over 60 s windows); the bounds of
the first run head the table (the runs are expected to share a workload). ``--chart PNG``
also draws hit rate against p99 TTFT, one point per run, with the OPT and pooled-LRU lines.
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


def write_chart(path: Path, summaries: Sequence[Mapping[str, Any]], title: str) -> None:
    """Hit rate against p99 TTFT, one labelled point per run, the bounds as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        x, y = s["ttft_s"]["p99"], s["hit_rate"]
        ax.scatter([x], [y], s=18)
        ax.annotate(_label(s), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    bounds = summaries[0]["bounds"]
    for key, style in (("opt", "--"), ("lru_pooled", ":")):
        ax.axhline(bounds[key], linestyle=style, color="grey", linewidth=0.8)
        ax.annotate(key, (ax.get_xlim()[1], bounds[key]), fontsize=7, ha="right", va="bottom")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT p99 (s, log)")
    ax.set_ylabel("token hit rate")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_main(argv: Sequence[str]) -> int:
    args = list(argv)
    chart: Path | None = None
    if "--chart" in args:
        at = args.index("--chart")
        chart = Path(args[at + 1])
        del args[at : at + 2]
    if not args:
        print("usage: python -m loadtests.replay compare DIR [DIR ...] [--chart PNG]")
        return 2
    summaries = [_load(a) for a in args]
    print(compare_table(summaries), end="")
    if chart is not None:
        try:
            write_chart(chart, summaries, chart.stem)
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[bench]'): chart skipped")
    return 0
