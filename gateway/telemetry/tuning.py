"""What an operator tuning routing reads: shadow policies' agreement, A/B arms with
confidence intervals, policy changes, and recent traffic as a replayable trace.

Contract:
- :meth:`TuningTelemetry.decided` counts, per shadow policy, its agreement with the pick
  that routed the request, and for the routing pick and every shadow pick the matched
  tokens and the estimated TTFT (``gateway_shadow_*``): the totals divided by the
  decisions give what each policy would have had on average, on the same traffic.
- :meth:`TuningTelemetry.finished` feeds a successful answer of an A/B arm to
  :class:`ABStats` (the engine's reported ``cached_tokens`` and ``prompt_tokens``, and the
  TTFT) and to ``gateway_ab_*``. :meth:`ABStats.summary` gives, per arm over its last
  ``window`` answers, the cached fraction with a 95 % interval (ratio estimator, delta
  method) and TTFT p50/p99 with distribution-free 95 % intervals (order statistics), and a
  verdict per figure: ``B better``, ``A better`` or ``no difference shown`` (intervals
  of the difference or of the two arms overlap), so noise is not read as a result.
- :meth:`TuningTelemetry.changed` records a policy change, applied or refused
  (``gateway_policy_changes_total{result}``, and the last ones for the dashboard).
- :class:`TraceLog` keeps recent successful requests as the offline replay reads a
  Mooncake trace: arrival time, chained block ids at 512-token granularity (every k-th of
  the gateway's block hashes, k from the request's own characters per token, and the
  last one; at most ``MAX_TRACE_IDS`` per entry whatever count the worker reported, so
  a worker claiming huge ``prompt_tokens`` cannot make the ring hold every block hash),
  prompt and output token counts as the worker reported them. Never text:
  hashes and counts only (a hash of known text can still be confirmed, so the export is
  an admin route).

Cost: a few dict lookups per decision with shadows, a deque append per answer; the
intervals are computed when ``/debug/ab`` is read.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from gateway.routing.decisions import DecisionRecord
from gateway.routing.request import RouteRequest
from gateway.telemetry.metrics import CounterVec, HistogramVec, PushCollector

TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' block size, which the replay reads
# Block ids kept per trace entry: 1,024 blocks of 512 tokens is beyond any model's context.
MAX_TRACE_IDS = 1024
_Z95 = 1.96
NO_DIFFERENCE = "no difference shown"


@dataclass(frozen=True, slots=True)
class TraceEntry:
    time: float  # wall clock, seconds
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_mooncake(self, start: float) -> dict[str, Any]:
        return {
            "timestamp": round((self.time - start) * 1000),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }


class TraceLog:
    """A bounded ring of recent requests, exported as a Mooncake JSONL trace."""

    def __init__(self, capacity: int = 20_000) -> None:
        self._ring: deque[TraceEntry] = deque(maxlen=capacity)

    def add(self, req: RouteRequest, record: DecisionRecord) -> None:
        outcome = record.outcome
        if outcome is None or outcome.status != 200 or not req.block_hashes:
            return
        tokens = outcome.reported_prompt_tokens or req.prompt_tokens
        if tokens <= 0:
            return
        chars_per_token = req.prompt_chars / tokens
        step = max(1, round(TRACE_BLOCK_TOKENS * chars_per_token / req.block_chars))
        hashes = req.block_hashes
        step = max(step, math.ceil(len(hashes) / (MAX_TRACE_IDS - 1)))  # room for the last
        ids = hashes[step - 1 :: step]
        if not ids or ids[-1] != hashes[-1]:
            ids = [*ids, hashes[-1]]
        self._ring.append(
            TraceEntry(record.time, tokens, max(1, outcome.output_tokens or 1), tuple(ids))
        )

    def since(self, start: float) -> list[TraceEntry]:
        return [e for e in self._ring if e.time >= start]


@dataclass(frozen=True, slots=True)
class Interval:
    value: float | None
    low: float | None
    high: float | None

    def to_dict(self) -> dict[str, float | None]:
        return {"value": self.value, "low": self.low, "high": self.high}


def ratio_interval(num: Sequence[float], den: Sequence[float]) -> Interval:
    """sum(num) / sum(den) with a 95 % interval (delta method); None without data."""
    n = len(num)
    total = sum(den)
    if n == 0 or total <= 0:
        return Interval(None, None, None)
    r = sum(num) / total
    if n < 2:
        return Interval(r, None, None)
    mean_den = total / n
    resid = [a - r * b for a, b in zip(num, den, strict=True)]
    var = sum(x * x for x in resid) / (n - 1)
    se = math.sqrt(var / n) / mean_den
    return Interval(r, r - _Z95 * se, r + _Z95 * se)


def quantile_interval(values: Sequence[float], q: float) -> Interval:
    """The q-quantile with a distribution-free 95 % interval from order statistics."""
    n = len(values)
    if n == 0:
        return Interval(None, None, None)
    s = sorted(values)
    point = s[min(n - 1, max(0, math.ceil(q * n) - 1))]
    half = _Z95 * math.sqrt(n * q * (1 - q))
    lo, hi = math.floor(n * q - half), math.ceil(n * q + half)
    if lo < 1 or hi > n:
        return Interval(point, None, None)  # too few samples to bound it
    return Interval(point, s[lo - 1], s[hi - 1])


def _verdict(a: Interval, b: Interval, higher_is_better: bool) -> str:
    if None in (a.low, a.high, b.low, b.high):
        return NO_DIFFERENCE
    assert a.low is not None and a.high is not None and b.low is not None and b.high is not None
    if b.low > a.high:
        return "B better" if higher_is_better else "A better"
    if a.low > b.high:
        return "A better" if higher_is_better else "B better"
    return NO_DIFFERENCE


class ABStats:
    """Per-arm answers over a sliding window, and their comparison."""

    def __init__(self, window: int = 5_000) -> None:
        self._arms: dict[str, deque[tuple[float | None, int, int]]] = {}
        self._window = window

    def add(self, arm: str, ttft_s: float | None, cached: int, prompt: int) -> None:
        ring = self._arms.get(arm)
        if ring is None:
            ring = self._arms[arm] = deque(maxlen=self._window)
        ring.append((ttft_s, cached, prompt))

    def summary(self) -> dict[str, Any]:
        arms: dict[str, dict[str, Interval | int]] = {}
        for arm, ring in sorted(self._arms.items()):
            ttfts = [t for t, _, _ in ring if t is not None]
            arms[arm] = {
                "requests": len(ring),
                "cached_fraction": ratio_interval([c for _, c, _ in ring], [p for _, _, p in ring]),
                "ttft_p50_s": quantile_interval(ttfts, 0.5),
                "ttft_p99_s": quantile_interval(ttfts, 0.99),
            }
        doc: dict[str, Any] = {
            arm: {k: v.to_dict() if isinstance(v, Interval) else v for k, v in figs.items()}
            for arm, figs in arms.items()
        }
        if "A" in arms and "B" in arms:
            a, b = arms["A"], arms["B"]
            doc["verdict"] = {
                key: _verdict(a[key], b[key], key == "cached_fraction")  # type: ignore[arg-type]
                for key in ("cached_fraction", "ttft_p50_s", "ttft_p99_s")
            }
        return doc


class _UsedFamilies(PushCollector):
    """Families with at least one series: a gateway without shadows or a split exports
    none of theirs."""

    def collect(self) -> Iterator[Metric]:
        for fam in self._families:
            if fam.children:
                yield fam.collect()


class TuningTelemetry:
    """Shadow, A/B and policy-change figures of one gateway (see the module)."""

    def __init__(
        self, registry: CollectorRegistry, ttft_buckets: Sequence[float], window: int = 5_000
    ) -> None:
        self._shadow = CounterVec(
            "gateway_shadow_decisions",
            "Decisions a shadow policy scored, by whether it picked the routed worker.",
            ["shadow", "agrees"],
        )
        self._matched = CounterVec(
            "gateway_shadow_matched_tokens",
            "Matched tokens of each policy's pick (role: routed or shadow), on the same requests.",
            ["policy", "role"],
        )
        self._ttft = CounterVec(
            "gateway_shadow_estimated_ttft_seconds",
            "Estimated TTFT of each policy's pick (role: routed or shadow), summed.",
            ["policy", "role"],
        )
        self._ab_requests = CounterVec(
            "gateway_ab_requests", "Successful answers per A/B arm.", ["arm", "policy"]
        )
        self._ab_cached = CounterVec(
            "gateway_ab_cached_tokens", "Cached tokens the engines reported, per arm.", ["arm"]
        )
        self._ab_prompt = CounterVec(
            "gateway_ab_prompt_tokens", "Prompt tokens the engines reported, per arm.", ["arm"]
        )
        self._ab_ttft = HistogramVec(
            "gateway_ab_ttft_seconds", "Time to first token per A/B arm.", ["arm"], ttft_buckets
        )
        self._changes = CounterVec(
            "gateway_policy_changes", "Policy changes, applied or refused.", ["result"]
        )
        registry.register(
            _UsedFamilies(
                [
                    self._shadow,
                    self._matched,
                    self._ttft,
                    self._ab_requests,
                    self._ab_cached,
                    self._ab_prompt,
                    self._ab_ttft,
                    self._changes,
                ]
            )
        )
        self.ab = ABStats(window)
        self.trace = TraceLog()
        self.recent_changes: deque[dict[str, Any]] = deque(maxlen=20)
        self.running: dict[str, Any] | None = None  # the policy set, as last applied
        self._decisions: dict[str, int] = {}  # routed decisions compared, by policy

    def summary(self) -> dict[str, Any]:
        """For the dashboard: the running set, each policy's figures on the compared
        decisions (agreement, mean matched tokens, mean estimated TTFT), the A/B arms and
        the recent changes."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for (policy, role), child in self._matched.children.items():
            n = self._decisions.get(policy, 0) if role == "routed" else self._shadow_n(policy)
            ttft = self._ttft.children.get((policy, role))
            rows[(policy, role)] = {
                "policy": policy,
                "role": role,
                "decisions": n,
                "mean_matched_tokens": child.value / n if n else None,
                "mean_estimated_ttft_s": ttft.value / n if ttft is not None and n else None,
                "agreement": self._agreement(policy) if role == "shadow" else None,
            }
        return {
            "running": self.running,
            "policies": [rows[k] for k in sorted(rows, key=lambda k: (k[1] != "routed", k))],
            "ab": self.ab.summary(),
            "changes": list(self.recent_changes),
        }

    def _shadow_n(self, policy: str) -> int:
        return int(sum(c.value for (p, _), c in self._shadow.children.items() if p == policy))

    def _agreement(self, policy: str) -> float | None:
        n = self._shadow_n(policy)
        agree = self._shadow.children.get((policy, "true"))
        return (agree.value if agree is not None else 0.0) / n if n else None

    def decided(self, record: DecisionRecord) -> None:
        if not record.shadows:
            return
        self._decisions[record.policy] = self._decisions.get(record.policy, 0) + 1
        self._matched.labels(record.policy, "routed").inc(record.matched_tokens)
        if record.estimated_ttft_s is not None:
            self._ttft.labels(record.policy, "routed").inc(record.estimated_ttft_s)
        for pick in record.shadows:
            self._shadow.labels(pick.policy, "true" if pick.agrees else "false").inc()
            self._matched.labels(pick.policy, "shadow").inc(pick.matched_tokens)
            if pick.estimated_ttft_s is not None:
                self._ttft.labels(pick.policy, "shadow").inc(pick.estimated_ttft_s)

    def finished(self, record: DecisionRecord) -> None:
        outcome = record.outcome
        if record.arm is None or outcome is None or outcome.status != 200:
            return
        cached = outcome.reported_cached_tokens or 0
        prompt = outcome.reported_prompt_tokens or record.prompt_tokens
        self.ab.add(record.arm, outcome.ttft_s, cached, prompt)
        self._ab_requests.labels(record.arm, record.policy).inc()
        self._ab_cached.labels(record.arm).inc(cached)
        self._ab_prompt.labels(record.arm).inc(prompt)
        if outcome.ttft_s is not None:
            self._ab_ttft.labels(record.arm).observe(outcome.ttft_s)

    def changed(self, source: str, policies: dict[str, Any] | None, error: str | None) -> None:
        result = "refused" if error is not None else "applied"
        self._changes.labels(result).inc()
        if policies is not None:
            self.running = policies
        self.recent_changes.appendleft(
            {"time": time.time(), "source": source, "result": result, "policies": policies}
            | ({} if error is None else {"error": error})
        )
