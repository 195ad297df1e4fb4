"""Replay output: the printed table, ``summary.json``, ``summary.md`` and PNG charts.

Charts need matplotlib (the ``bench`` extra); without it they are skipped with a note and
everything else is still written. The Agg backend is selected inside the chart functions,
never at import time, so importing this module has no side effects.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.replay.metrics import RequestRecord


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def table_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) rows of the human table."""
    b, e, t = summary["bounds"], summary["efficiency"], summary["ttft_s"]
    lb, imb, fid = summary["ttft_over_lb"], summary["load_imbalance"], summary["index_fidelity"]
    rows = [
        ("requests (completed)", f"{summary['requests']} ({summary['completed']})"),
        ("hit rate (tokens)", _fmt(summary["hit_rate"])),
        ("bound H_inf / OPT / LRU pooled", f"{_fmt(b['infinite'])} / {_fmt(b['opt'])} / "
         f"{_fmt(b['lru_pooled'])}"),
        ("efficiency vs OPT / H_inf / LRU", f"{_fmt(e['opt'])} / {_fmt(e['infinite'])} / "
         f"{_fmt(e['lru_pooled'])}"),
        ("prefill-work efficiency", _fmt(summary["prefill_work_efficiency"])),
        ("worker utilisation", _fmt(summary["utilisation"], 2)),
        ("TTFT p50 / p90 / p99 / mean (s)", " / ".join(_fmt(t[k]) for k in ("p50", "p90", "p99",
                                                                            "mean"))),
        ("TTFT / TTFT_LB p50 / p99", f"{_fmt(lb['p50'], 2)} / {_fmt(lb['p99'], 2)}"),
        (f"load imbalance per {imb['window_s']:.0f} s (mean / max)",
         f"{_fmt(imb['mean'], 2)} / {_fmt(imb['max'], 2)}"),
        ("index precision / recall / regret", f"{_fmt(fid['precision'])} / "
         f"{_fmt(fid['recall'])} / {_fmt(fid['regret'])}"),
        ("precision against reported cached", _fmt(fid.get("precision_reported", math.nan))),
        ("output tokens/s", _fmt(summary.get("output_tokens_per_s", math.nan), 0)),
        *capture_rows(summary.get("routing_capture")),
        ("worker share", " ".join(_fmt(v, 2) for v in summary["worker_share"].values())),
    ]  # fmt: skip
    rows += lora_rows(summary.get("lora"))
    tiers = summary.get("tiers")
    if tiers and tiers.get("reported_host_tokens"):  # HiCache workers loaded some back
        rows.append(("hit rate by tier: device / host", f"{_fmt(tiers['device_hit_rate'])} / "
                     f"{_fmt(tiers['host_hit_rate'])}"))  # fmt: skip
        rows.append(("host tokens predicted / reported", f"{tiers['predicted_host_tokens']:,.0f}"
                     f" / {tiers['reported_host_tokens']:,.0f}"))  # fmt: skip
    exact = summary.get("exact")
    if exact is not None:
        modes = exact["fidelity"]
        rows.append(
            (
                "exact mode: requests per mode",
                ", ".join(f"{m} {int(f['requests'])}" for m, f in sorted(modes.items())) or "none",
            )
        )
        rows.append(("exact mode: KV-event batches", str(exact["batches"])))
    rows.append(("wall time (s)", _fmt(summary.get("wall_s", math.nan), 1)))
    return rows  # fmt: skip


def capture_rows(capture: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """Rows for ``routing_capture`` (``metrics.routing_capture``), actual then predicted."""
    if not capture:
        return []
    rows = []
    for basis in ("actual", "predicted"):
        c = capture[basis]
        tokens = " / ".join(f"{c[k] or 0:,.0f}" for k in ("available_tokens", "captured_tokens",
                                                           "delivered_tokens"))  # fmt: skip
        rows.append((f"capture ({basis}): available / captured / delivered tokens", tokens))
        rows.append((f"capture ({basis}): captured / available, delivered / available",
                     f"{_fmt(_num(c['captured_over_available']))} / "
                     f"{_fmt(_num(c['delivered_over_available']))}"))  # fmt: skip
    return rows


def lora_rows(lora: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """Rows for a LoRA run's ``lora`` (``loadtests.replay.lora``)."""
    if not lora:
        return []
    counters = lora["counters"].values()
    per = " · ".join("/".join(str(c[k]) for k in ("loads", "reloads", "evictions"))
                     for c in counters)  # fmt: skip
    totals = "/".join(str(lora["totals"][k]) for k in ("loads", "reloads", "evictions"))
    errors = ", ".join(f"{k}: {v}" for k, v in lora["errors"].items()) or "none"
    top = lora["top_adapter_requests"].values()
    return [
        ("LoRA routing", "adapter-aware" if lora["affinity"] else "adapter-blind"),
        ("LoRA loads / implicit reloads / evictions", f"{per} (Σ {totals})"),
        ("LoRA gateway loads; errors; rejected", f"{lora['gateway_loads']}; {errors}; "
         f"{lora['rejected']}"),
        (f"LoRA top adapter ({lora['top_adapter']}) per worker", " / ".join(map(str, top))),
        ("LoRA its busiest holder's share of all", _fmt(lora["top_holder_share"], 3)),
    ]  # fmt: skip


def _num(value: Any) -> Any:
    """NaN for a figure ``summary.json`` stored as null."""
    return math.nan if value is None else value


def render_table(summary: Mapping[str, Any]) -> str:
    rows = table_rows(summary)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def render_markdown(summary: Mapping[str, Any], charts: Sequence[str]) -> str:
    head = summary.get("config", {})
    lines = ["# Offline replay", "", "```", json.dumps(head, indent=1), "```", ""]
    lines += ["| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in table_rows(summary)]
    lines += [""] + [f"![{Path(c).stem}]({Path(c).name})" for c in charts]
    return "\n".join(lines) + "\n"


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_outputs(
    out: Path,
    summary: Mapping[str, Any],
    records: Sequence[RequestRecord],
    timelines: Mapping[str, Sequence[tuple[float, int, float]]],
) -> list[str]:
    """Write summary.json, summary.md and charts into ``out``; return notes to print."""
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    charts: list[str] = []
    try:
        charts = write_charts(out, summary, records, timelines)
    except ImportError:
        notes.append("matplotlib is not installed (pip install -e '.[bench]'): charts skipped")
    (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    (out / "summary.md").write_text(render_markdown(summary, charts))
    return notes


def write_charts(
    out: Path,
    summary: Mapping[str, Any],
    records: Sequence[RequestRecord],
    timelines: Mapping[str, Sequence[tuple[float, int, float]]],
) -> list[str]:
    """TTFT CDF, per-worker share, per-worker queue and cache-occupancy timelines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[str] = []
    ttfts = sorted(r.ttft_s for r in records if r.ttft_s is not None)
    fig, ax = plt.subplots(figsize=(6, 4))
    if ttfts:
        ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))])
        ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF — hit rate {_fmt(summary['hit_rate'])}")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "ttft_cdf.png"))
    plt.close(fig)

    fig, (ax_q, ax_c) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for worker, points in timelines.items():
        if points:
            xs = [p[0] for p in points]
            ax_q.plot(xs, [p[1] for p in points], label=worker, linewidth=0.8)
            ax_c.plot(xs, [p[2] for p in points], label=worker, linewidth=0.8)
    ax_q.set_ylabel("requests queued + running")
    ax_c.set_ylabel("KV of live requests (fraction)")
    ax_c.set_xlabel("virtual time (s)")
    ax_q.legend(fontsize=6, ncol=4)
    paths.append(_save(fig, out / "worker_timelines.png"))
    plt.close(fig)
    return paths


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)
