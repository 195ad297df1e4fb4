"""Results of the live benchmark: per-contender summary, Markdown tables, PNG charts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.bench.client import Outcome
from loadtests.bench.workers import WorkerDelta
from loadtests.harness.stats import percentile


@dataclass
class ContenderResult:
    """One contender's run of one workload."""

    workload: str
    contender: str
    outcomes: list[Outcome]
    wall_s: float
    workers: list[WorkerDelta]
    speed: float = 1.0  # modelled seconds per wall second
    busy: list[float] = field(default_factory=list)  # sampled busy fraction per worker
    note: str = ""
    load_1m: float = float("nan")  # the machine's 1-min load average after the run
    rounds: int = 1

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def ok(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def shed(self) -> int:
        return sum(o.shed for o in self.outcomes)

    @property
    def failed(self) -> int:
        return self.sent - self.ok - self.shed

    @property
    def ttfts(self) -> list[float]:
        return [o.ttft_s for o in self.outcomes if o.ok and o.ttft_s is not None]

    @property
    def latencies(self) -> list[float]:
        return [o.latency_s for o in self.outcomes if o.ok]

    @property
    def throughput(self) -> float:
        """Completed requests per wall second, from the first send to the last answer."""
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cached_fraction(self) -> float:
        """Δcached / Δprompt tokens summed over the workers (their own counters)."""
        prompt = sum(w.prompt_tokens for w in self.workers)
        return sum(w.cached_tokens for w in self.workers) / prompt if prompt else 0.0

    @property
    def reported_fraction(self) -> float:
        """The same from the responses' usage (a cross-check)."""
        prompt = sum(o.prompt_tokens for o in self.outcomes if o.ok)
        return sum(o.cached_tokens for o in self.outcomes if o.ok) / prompt if prompt else 0.0

    @property
    def max_share(self) -> float:
        """The busiest worker's request share over the fair share (1 = even)."""
        total = sum(w.requests for w in self.workers)
        if not total or not self.workers:
            return float("nan")
        return max(w.requests for w in self.workers) / total * len(self.workers)

    @property
    def busy_spread(self) -> tuple[float, float]:
        """(max, mean) modelled prefill busy seconds per worker."""
        busy = [w.prefill_busy_s for w in self.workers] or [0.0]
        return max(busy), sum(busy) / len(busy)

    @property
    def prefill_utilisation(self) -> float:
        """Mean modelled prefill busy time per worker over the run's modelled duration."""
        _, mean = self.busy_spread
        return mean / (self.wall_s * self.speed) if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        ttft, lat = self.ttfts, self.latencies
        return {
            "workload": self.workload,
            "contender": self.contender,
            "sent": self.sent,
            "ok": self.ok,
            "shed": self.shed,
            "failed": self.failed,
            "ttft_ms": {q: percentile(ttft, p, "nearest") * 1e3 for q, p in _QS.items()},
            "e2e_ms": {q: percentile(lat, p, "nearest") * 1e3 for q, p in _QS.items()},
            "throughput_rps": self.throughput,
            "wall_s": self.wall_s,
            "cached_fraction": self.cached_fraction,
            "reported_fraction": self.reported_fraction,
            "worker_requests": {w.url: w.requests for w in self.workers},
            "worker_prefill_busy_s": {w.url: w.prefill_busy_s for w in self.workers},
            "max_share": self.max_share,
            "prefill_utilisation": self.prefill_utilisation,
            "busy_fraction": self.busy,
            "load_1m": self.load_1m,
            "rounds": self.rounds,
            "ttft_s": [round(t, 5) for t in ttft],
            "errors": sorted({o.error for o in self.outcomes if o.error})[:5],
            "note": self.note,
        }


def merge(runs: Sequence[ContenderResult]) -> ContenderResult:
    """Several rounds of one contender as one result: outcomes pooled, wall times and
    worker deltas summed, busy fractions averaged, the highest load kept."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    workers = [
        WorkerDelta(
            url=w.url,
            prompt_tokens=sum(r.workers[i].prompt_tokens for r in runs),
            cached_tokens=sum(r.workers[i].cached_tokens for r in runs),
            requests=sum(r.workers[i].requests for r in runs),
            prefill_busy_s=sum(r.workers[i].prefill_busy_s for r in runs),
        )
        for i, w in enumerate(first.workers)
    ]
    busy = [sum(r.busy[i] for r in runs) / len(runs) for i in range(len(first.busy))]
    return ContenderResult(
        first.workload, first.contender, [o for r in runs for o in r.outcomes],
        sum(r.wall_s for r in runs), workers, first.speed, busy,
        "; ".join(sorted({r.note for r in runs if r.note})),
        max(r.load_1m for r in runs), len(runs),
    )  # fmt: skip


_QS = {"p50": 50, "p90": 90, "p99": 99}


@dataclass
class WorkloadReport:
    """A workload's bounds and setup line beside its contenders' results."""

    workload: str
    setup: str
    bounds: dict[str, float]  # infinite, opt, lru_pooled token hit rates for N x C
    results: list[ContenderResult] = field(default_factory=list)


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:,.0f}"


def markdown(report: WorkloadReport) -> str:
    lru = report.bounds.get("lru_pooled", float("nan"))
    lines = [
        f"### {report.workload}",
        "",
        report.setup,
        "",
        f"Bounds for the pooled N x C: H_inf {report.bounds.get('infinite', 0):.3f}, "
        f"OPT {report.bounds.get('opt', 0):.3f}, pooled LRU {lru:.3f} (token hit rates).",
        "",
        "| contender | ok / sent | shed | failed | TTFT p50 / p90 / p99 ms | e2e p50 / p99 ms "
        "| req/s | cached (workers) | ÷ LRU bound | busiest worker x fair | busy mean / max "
        "| prefill util | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        t50, t90, t99 = (percentile(r.ttfts, p, "nearest") for p in (50, 90, 99))
        e50, e99 = (percentile(r.latencies, p, "nearest") for p in (50, 99))
        busy = r.busy or [float("nan")]
        ratio = r.cached_fraction / lru if lru else float("nan")
        lines.append(
            f"| {r.contender} | {r.ok} / {r.sent} | {r.shed} | {r.failed} "
            f"| {_ms(t50)} / {_ms(t90)} / {_ms(t99)} | {_ms(e50)} / {_ms(e99)} "
            f"| {r.throughput:.2f} | {r.cached_fraction:.3f} "
            f"| {ratio:.2f} | {r.max_share:.2f} | {sum(busy) / len(busy):.2f} / {max(busy):.2f} "
            f"| {r.prefill_utilisation:.2f} | {r.load_1m:.1f} |"
        )
    notes = [f"- {r.contender}: {r.note}" for r in report.results if r.note]
    return "\n".join(lines + (["", *notes] if notes else []))


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def _tick_label(value: float, minor: bool) -> str:
    """Plain numbers on a log axis; minor ticks labelled at 2 and 5 only."""
    if value <= 0:
        return ""
    lead = round(value / 10 ** math.floor(math.log10(value)))
    return f"{value:g}" if not minor or lead in (2, 5) else ""


def _plain_log_ticks(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick_label(v, False)))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: _tick_label(v, True)))


def charts(report: WorkloadReport, out_dir: Path) -> list[Path]:
    """TTFT CDF per contender and hit rate vs p99 TTFT; returns the PNG paths
    (none if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths: list[Path] = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in report.results:
        ttft = sorted(t * 1e3 for t in r.ttfts)
        if ttft:
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            ax.step(ttft, ys, where="post", label=r.contender, linewidth=1.2)
    ax.set_xscale("log")
    _plain_log_ticks(ax)
    ax.set_xlabel("TTFT (ms, wall clock, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {report.workload}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = out_dir / f"{_slug(report.workload)}-ttft-cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in report.results:
        p99 = percentile(r.ttfts, 99, "nearest") * 1e3
        if not math.isnan(p99):
            ax.scatter([p99], [r.cached_fraction], s=25)
            ax.annotate(r.contender, (p99, r.cached_fraction), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")  # fmt: skip
    for key, style, x, ha in (("infinite", "--", 0.01, "left"), ("lru_pooled", ":", 0.99, "right")):
        if key in report.bounds:
            ax.axhline(report.bounds[key], linestyle=style, color="grey", linewidth=0.9)
            ax.annotate(f"{key} bound", (x, report.bounds[key]), xycoords=("axes fraction",
                        "data"), fontsize=7, va="bottom", ha=ha, color="grey")  # fmt: skip
    ax.set_xscale("log")
    _plain_log_ticks(ax)
    ax.set_xlabel("p99 TTFT (ms, wall clock, log scale)")
    ax.set_ylabel("cached-token fraction (workers' counters)")
    ax.set_title(f"Hit rate vs p99 TTFT: {report.workload}")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = out_dir / f"{_slug(report.workload)}-hit-vs-p99.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths
