"""``python -m loadtests.replay sweep``: a grid over policy arguments and time scales,
for one policy (``--policy``) or several (``--policies a,b,c``: every policy on the grid).

Every point is one :func:`loadtests.replay.run.run_replay` in a worker process
(``ProcessPoolExecutor``, at most ``--jobs`` at once, default 2). Results: ``sweep.json``
(one summary per point), ``sweep.md`` (a table), ``pareto.png`` (hit rate against p99 TTFT,
Pareto-optimal points joined) and the goodput at the SLO per setting: the largest time
scale at which ``--slo-quantile`` % of requests meet ``TTFT <= --slo-s``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtests.replay.report import json_safe
from loadtests.replay.run import ReplayConfig, add_common_args, config_from_args, run_replay


def parse_grid(items: Sequence[str]) -> list[dict[str, Any]]:
    """``["a=1,2", "b=x"]`` → every combination as policy-arg dicts (YAML scalars)."""
    import yaml

    axes: list[tuple[str, list[Any]]] = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--grid: expected KEY=V1,V2,..., got {item!r}")
        axes.append((key.strip(), [yaml.safe_load(v) for v in values.split(",")]))
    names = [k for k, _ in axes]
    return [dict(zip(names, combo, strict=True)) for combo in
            itertools.product(*(v for _, v in axes))] or [{}]  # fmt: skip


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated in (higher hit rate, lower p99)."""
    front = []
    for i, (hit, p99) in enumerate(points):
        dominated = any(
            (h >= hit and p <= p99) and (h > hit or p < p99)
            for j, (h, p) in enumerate(points) if j != i
        )  # fmt: skip
        if not dominated and not math.isnan(p99):
            front.append(i)
    return front


def setting(row: Mapping[str, Any], with_policy: bool) -> str:
    """A row's policy setting: its arguments as JSON, after its policy's name if asked."""
    args = json.dumps(row["policy_args"], sort_keys=True)
    return f"{row['policy']} {args}" if with_policy else args


def goodput(rows: Sequence[Mapping[str, Any]], slo_s: float, quantile: str) -> dict[str, Any]:
    """Per policy setting, the largest time scale meeting the SLO at ``quantile``
    (settings named by their arguments, after the policy when rows hold several)."""
    best: dict[str, Any] = {}
    several = len({row.get("policy") for row in rows}) > 1
    for row in rows:
        key = setting(row, several)
        value = row["summary"]["ttft_s"][quantile]
        ok = value is not None and not math.isnan(value) and value <= slo_s
        if ok:
            best[key] = max(best.get(key) or 0.0, row["time_scale"])
        else:
            best.setdefault(key, None)
    return best


def _point(config: ReplayConfig) -> dict[str, Any]:
    return run_replay(config)


def sweep_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.replay sweep")
    add_common_args(parser)
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2")
    parser.add_argument("--time-scales", default="1", help="comma-separated, e.g. 1,2,3")
    parser.add_argument("--slo-s", type=float, default=2.0, help="TTFT target (s)")
    parser.add_argument("--slo-quantile", choices=["p50", "p90", "p99"], default="p90")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--policies",
        default="",
        help="comma-separated policies, each run on the whole grid (default: --policy)",
    )
    ns = parser.parse_args(argv)
    base = config_from_args(ns, 1.0)
    scales = [float(s) for s in ns.time_scales.split(",")]
    policies = [p.strip() for p in ns.policies.split(",") if p.strip()] or [base.policy]
    configs = [
        replace(base, policy=policy, policy_args={**base.policy_args, **args}, time_scale=scale)
        for policy in policies for args in parse_grid(ns.grid) for scale in scales
    ]  # fmt: skip
    with ProcessPoolExecutor(max_workers=max(1, min(ns.jobs, 2))) as pool:
        summaries = list(pool.map(_point, configs))
    rows = [
        {"policy": c.policy, "policy_args": c.policy_args, "time_scale": c.time_scale,
         "summary": s}
        for c, s in zip(configs, summaries, strict=True)
    ]  # fmt: skip
    result = {"rows": rows, "slo_s": ns.slo_s, "slo_quantile": ns.slo_quantile,
              "goodput_time_scale": goodput(rows, ns.slo_s, ns.slo_quantile)}  # fmt: skip
    out: Path = ns.out or Path("replay-sweep")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(json_safe(result), indent=2) + "\n")
    title = ", ".join(policies)
    (out / "sweep.md").write_text(render_sweep(result, title))
    print(render_sweep(result, title))
    try:
        write_pareto(out / "pareto.png", rows, title)
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): chart skipped")
    return 0


def _n(value: Any, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def render_sweep(result: Mapping[str, Any], policy: str) -> str:
    lines = [f"policy {policy}: hit rate and TTFT per setting and time scale", "",
             "| policy | policy args | time scale | hit rate | OPT | TTFT mean | p90 | p99 "
             "| captured / available |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["rows"]:
        s, t = row["summary"], row["summary"]["ttft_s"]
        capture = (s.get("routing_capture") or {}).get("actual", {})
        lines.append(
            f"| {row.get('policy', policy)} | {json.dumps(row['policy_args'], sort_keys=True)} "
            f"| {row['time_scale']:g} | {_n(s['hit_rate'], 3)} | {_n(s['bounds']['opt'], 3)} "
            f"| {_n(t['mean'], 2)} | {_n(t['p90'], 2)} | {_n(t['p99'], 2)} "
            f"| {_n(capture.get('captured_over_available'), 3)} |"
        )
    lines += ["", f"goodput at TTFT {result['slo_quantile']} <= {result['slo_s']} s "
              "(largest time scale meeting it):", ""]  # fmt: skip
    for key, scale in result["goodput_time_scale"].items():
        lines.append(f"- {key}: {scale if scale is not None else 'none of the scales'}")
    return "\n".join(lines) + "\n"


def write_pareto(path: Path, rows: Sequence[Mapping[str, Any]], policy: str) -> None:
    """Hit rate against p99 TTFT per point; the Pareto front joined per time scale (only
    settings under the same load are comparable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for scale in sorted({r["time_scale"] for r in rows}):
        group = [r for r in rows if r["time_scale"] == scale]
        pts = [(r["summary"]["hit_rate"], r["summary"]["ttft_s"]["p99"]) for r in group]
        front = sorted(pareto_front(pts), key=lambda i: pts[i][1])
        dots = ax.scatter([p[1] for p in pts], [p[0] for p in pts], s=14, label=f"x{scale:g}")
        ax.plot([pts[i][1] for i in front], [pts[i][0] for i in front], linewidth=1,
                color=dots.get_facecolor()[0])  # fmt: skip
        several = len({r.get("policy") for r in rows}) > 1
        for r, (hit, p99) in zip(group, pts, strict=True):
            label = setting(r, several)
            ax.annotate(label, (p99, hit), fontsize=5, xytext=(2, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT p99 (s, log)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"{policy}: hit rate vs p99 TTFT (lines: Pareto front per time scale)",
                 fontsize=8)  # fmt: skip
    ax.legend(fontsize=7, title="time scale", title_fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
