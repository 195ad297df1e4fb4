"""``python -m loadtests.replay compare DIR...``: one Markdown table of several runs.

Each ``DIR`` (or ``DIR/summary.json``) is a finished replay; rows keep the given order.
Columns: policy, token hit rate, hit efficiency against OPT and pooled LRU, TTFT mean /
p90 / p99, prefill-work efficiency, load imbalance (mean over 60 s windows), captured /
available (``routing_capture``, actual); the bounds of the first run head the table (the
runs are expected to share a workload). ``--chart PNG`` also draws hit rate against p99
TTFT, one point per run, with the OPT and pooled-LRU lines.

``compare --matrix SWEEP_DIR...``: several sweeps (one workload each, several policies:
``sweep --policies``) as workload x policy tables of hit rate, p99 TTFT and captured /
available.
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


def _load_sweep(path: str) -> dict[str, Any]:
    p = Path(path)
    data: dict[str, Any] = json.loads((p / "sweep.json" if p.is_dir() else p).read_text())
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
        "| prefill-work eff. | imbalance | captured / available |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        t, e = s["ttft_s"], s["efficiency"]
        lines.append(
            f"| {_label(s)} | {_f(s['hit_rate'], 3)} | {_f(e['opt'], 2)} | "
            f"{_f(e['lru_pooled'], 2)} | {_f(t['mean'], 2)} | {_f(t['p90'], 2)} | "
            f"{_f(t['p99'], 2)} | {_f(s['prefill_work_efficiency'], 2)} | "
            f"{_f(s['load_imbalance']['mean'], 2)} | {_f(captured_ratio(s), 3)} |"
        )
    return "\n".join(lines) + "\n"


def captured_ratio(summary: Mapping[str, Any]) -> float | None:
    """The run's actual captured / available (``routing_capture``), None if absent."""
    capture = summary.get("routing_capture")
    if not capture:
        return None
    value: float | None = capture["actual"]["captured_over_available"]
    return value


def _source(summary: Mapping[str, Any]) -> str:
    """The run's workload: the trace's file name or the workload's name."""
    config = summary.get("config", {})
    trace = config.get("trace")
    return Path(trace).stem if trace else str(config.get("workload", "?"))


FIGURES: tuple[tuple[str, str, int], ...] = (
    ("token hit rate", "hit_rate", 3),
    ("TTFT p99 (s)", "p99", 2),
    ("captured / available (actual)", "capture", 3),
)


def _figure(summary: Mapping[str, Any], key: str) -> float | None:
    if key == "p99":
        value: float | None = summary["ttft_s"]["p99"]
        return value
    if key == "capture":
        return captured_ratio(summary)
    hit: float | None = summary[key]
    return hit


def matrix_tables(sweeps: Sequence[Mapping[str, Any]]) -> str:
    """Workloads (one sweep each) x policies: one Markdown table per figure of
    :data:`FIGURES`, rows in the given order, columns in each policy's first appearance."""
    rows: list[tuple[str, dict[str, Mapping[str, Any]]]] = []
    policies: list[str] = []
    for sweep in sweeps:
        cells: dict[str, Mapping[str, Any]] = {}
        for row in sweep["rows"]:
            summary = row["summary"]
            policy = _label(summary)
            cells[policy] = summary
            if policy not in policies:
                policies.append(policy)
        first = sweep["rows"][0]
        rows.append((f"{_source(first['summary'])} x{first['time_scale']:g}", cells))
    out: list[str] = []
    for title, key, digits in FIGURES:
        out += [f"{title}:", "", "| workload | " + " | ".join(policies) + " |",
                "|---|" + "---|" * len(policies)]  # fmt: skip
        for name, cells in rows:
            values = [_f(_figure(cells[p], key), digits) if p in cells else "-" for p in policies]
            out.append(f"| {name} | " + " | ".join(values) + " |")
        out.append("")
    return "\n".join(out)


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
    if args and args[0] == "--matrix":
        if len(args) < 2:
            print("usage: python -m loadtests.replay compare --matrix SWEEP_DIR [SWEEP_DIR ...]")
            return 2
        print(matrix_tables([_load_sweep(a) for a in args[1:]]), end="")
        return 0
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
