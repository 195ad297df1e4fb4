"""Figures of one replay run, as defined in ``../shared/docs/PERFORMANCE.md`` §1.

Inputs are what the replay recorded: one :class:`RequestRecord` per request, the busy
intervals of each worker, and the bounds of the request sequence. Everything here is a
pure function of them; nothing is simulated.

* ``hit_rate``: Σ cached tokens reported by the workers / Σ prompt tokens (token level).
* ``efficiency``: ``hit_rate`` over each bound (``opt``, ``infinite``, ``lru_pooled``).
* ``prefill_work_efficiency``: ``W_min / W_router``, where ``W`` sums the prefill time of
  every prompt (the profile's latency model, attention term included) with the OPT hits
  (``W_min``) or with the hits the workers reported (``W_router``).
* ``ttft_s``: p50/p90/p99/mean of time to first token; ``ttft_over_lb`` p50/p99 of
  TTFT / TTFT_LB, where TTFT_LB is the prefill time with OPT hits and no queueing.
* ``utilisation``: Σ worker busy time / (workers x time from first arrival to last
  finish).
* ``load_imbalance``: per window of ``window_s`` seconds, max over workers of busy time /
  mean over workers; reported as the mean and the max over windows with any work.
* ``index_fidelity``: predicted = tokens the prefix index believed cached on the chosen
  worker; true = the chosen worker's real match at dispatch. Precision = Σ min / Σ
  predicted, recall = Σ min / Σ true; regret = Σ (best real match over all workers -
  chosen worker's real match) / Σ prompt tokens. ``precision_reported`` = Σ min(predicted,
  reported cached tokens) / Σ predicted: against what the worker then reported (as the
  gateway's own fidelity counters), which a later admission can lower.
* ``output_tokens_per_s``: Σ output tokens of finished requests / (last finish - first
  arrival), the fleet's output throughput over the run.
* ``routing_capture``: per request the longest match anywhere (*available*), the match at
  the chosen worker (*captured*) and the cached tokens the worker reported (*delivered*),
  summed, with captured / available and delivered / available; ``actual`` from the
  workers' caches at dispatch, ``predicted`` from what the gateway's index told the
  policy (:func:`routing_capture`). Delivered can exceed available: a sibling dispatched
  just before may be prefilled by the time this request's prefill starts.
* ``tiers`` (HiCache workers): the hit rate split by where the workers found the cached
  tokens (``device``: their GPU; ``host``: loaded back from their host tier, as
  ``cached_tokens_details`` reports), and the host tokens the gateway predicted at the
  chosen worker (``predicted_host_tokens``) against those reported.

Without bounds (``bounds=None``: a run too long for OPT) every bound-derived figure is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtests.harness.stats import percentile
from loadtests.replay.bounds import Bounds

PrefillTime = Callable[[int, int], float]  # (new tokens, cached tokens) -> seconds


@dataclass(slots=True)
class RequestRecord:
    """What the replay saw of one request."""

    index: int
    arrival_s: float
    worker: str
    prompt_tokens: int  # the worker's own count (chat template included)
    output_tokens: int
    predicted_tokens: int  # prefix index's belief for the chosen worker
    true_match_tokens: int  # the chosen worker's real match at dispatch
    best_match_tokens: int  # the best real match over all workers at dispatch
    cached_tokens: int = 0  # reported by the worker with the first token
    first_token_s: float | None = None
    finish_s: float | None = None
    # the longest match the gateway predicted on any candidate (the routing core's views);
    # None when it consulted no index for this request (a policy that ignores the match)
    available_predicted_tokens: int | None = None
    cached_host_tokens: int = 0  # of cached_tokens, loaded from the worker's host tier
    predicted_host_tokens: int = 0  # of predicted_tokens, believed on its host tier

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class BusyInterval:
    worker: str
    start_s: float
    duration_s: float


def summarize_latency(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50, "linear"),
        "p90": percentile(values, 90, "linear"),
        "p99": percentile(values, 99, "linear"),
        "mean": sum(values) / len(values) if values else math.nan,
    }


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def load_imbalance(
    intervals: Sequence[BusyInterval], workers: Sequence[str], window_s: float
) -> dict[str, float]:
    """Mean and max over windows of (max busy / mean busy) across ``workers``."""
    busy: dict[int, dict[str, float]] = {}
    for iv in intervals:
        start, end = iv.start_s, iv.start_s + iv.duration_s
        k = int(start // window_s)
        while start < end:
            edge = min(end, (k + 1) * window_s)
            per = busy.setdefault(k, {})
            per[iv.worker] = per.get(iv.worker, 0.0) + edge - start
            start, k = edge, k + 1
    ratios = []
    for per in busy.values():
        mean = sum(per.values()) / len(workers)
        if mean > 0:
            ratios.append(max(per.values()) / mean)
    return {
        "mean": sum(ratios) / len(ratios) if ratios else math.nan,
        "max": max(ratios, default=math.nan),
        "window_s": window_s,
    }


def index_fidelity(records: Sequence[RequestRecord]) -> dict[str, float]:
    predicted = sum(r.predicted_tokens for r in records)
    true = sum(r.true_match_tokens for r in records)
    agreed = sum(min(r.predicted_tokens, r.true_match_tokens) for r in records)
    regret = sum(r.best_match_tokens - r.true_match_tokens for r in records)
    total = sum(r.prompt_tokens for r in records)
    reported = sum(min(r.predicted_tokens, r.cached_tokens) for r in records
                   if r.first_token_s is not None)  # fmt: skip
    return {
        "precision": _ratio(agreed, predicted),
        "precision_reported": _ratio(reported, predicted),
        "recall": _ratio(agreed, true),
        "predicted_tokens": float(predicted),
        "true_match_tokens": float(true),
        "regret": _ratio(regret, total),
    }


def _capture(available: int, captured: int, delivered: int) -> dict[str, float]:
    return {
        "available_tokens": float(available),
        "captured_tokens": float(captured),
        "delivered_tokens": float(delivered),
        "captured_over_available": _ratio(captured, available),
        "delivered_over_available": _ratio(delivered, available),
    }


def routing_capture(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Available / captured / delivered cached tokens, summed over requests, two ways.

    ``actual``: available = the longest real match on any worker at dispatch, captured =
    the chosen worker's real match then, delivered = the cached tokens it reported (every
    request; the same yardstick for every policy). ``predicted``: available = the longest
    match the gateway's index (or exact mode) predicted on any candidate, captured = the
    prediction for the chosen worker, delivered as above, over the requests for which the
    gateway consulted an index (none for a policy that ignores the match: NaN ratios).
    """
    known = [r for r in records if r.available_predicted_tokens is not None]
    return {
        "actual": _capture(
            sum(r.best_match_tokens for r in records),
            sum(r.true_match_tokens for r in records),
            sum(r.cached_tokens for r in records),
        ),
        "predicted": {
            **_capture(
                sum(r.available_predicted_tokens or 0 for r in known),
                sum(r.predicted_tokens for r in known),
                sum(r.cached_tokens for r in known),
            ),
            "requests": float(len(known)),
        },
    }


def tiers(records: Sequence[RequestRecord], prompt_tokens: int) -> dict[str, float]:
    """The hit rate by cache tier, and the host tokens predicted against those reported."""
    host = sum(r.cached_host_tokens for r in records)
    device = sum(r.cached_tokens for r in records) - host
    return {
        "device_hit_rate": _ratio(device, prompt_tokens),
        "host_hit_rate": _ratio(host, prompt_tokens),
        "reported_host_tokens": float(host),
        "predicted_host_tokens": float(sum(r.predicted_host_tokens for r in records)),
    }


def summarize(
    records: Sequence[RequestRecord],
    intervals: Sequence[BusyInterval],
    workers: Sequence[str],
    bounds: Bounds | None,
    prefill_time: PrefillTime,
    window_s: float = 60.0,
) -> dict[str, Any]:
    """Every figure of the module docstring, as a JSON-ready dict."""
    done = [r for r in records if r.first_token_s is not None]
    prompt = sum(r.prompt_tokens for r in records)
    hit_rate = _ratio(sum(r.cached_tokens for r in records), prompt)
    unbounded = dict.fromkeys(("infinite", "opt", "lru_pooled"), math.nan)
    rates = bounds.token_rates() if bounds is not None else unbounded
    w_router = sum(prefill_time(r.prompt_tokens - r.cached_tokens, r.cached_tokens) for r in done)
    lbs: dict[int, float] = {}
    if bounds is not None:
        opt_hits = bounds.opt.hit_tokens
        lbs = {r.index: prefill_time(r.prompt_tokens - opt_hits[r.index], opt_hits[r.index])
               for r in done}  # fmt: skip
    w_min = sum(lbs.values()) if bounds is not None else math.nan
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    over_lb = [(r.ttft_s or 0.0) / lbs[r.index] for r in done if lbs.get(r.index, 0.0) > 0]
    share: dict[str, int] = dict.fromkeys(workers, 0)
    for r in records:
        share[r.worker] = share.get(r.worker, 0) + 1
    finished = [r.finish_s for r in records if r.finish_s is not None]
    span = max(finished, default=0.0) - min((r.arrival_s for r in records), default=0.0)
    busy = sum(iv.duration_s for iv in intervals)
    output = sum(r.output_tokens for r in records if r.finish_s is not None)
    return {
        "requests": len(records),
        "completed": len(finished),
        "prompt_tokens": prompt,
        "hit_rate": hit_rate,
        "bounds": rates,
        "bounds_block_level": bounds.block_rates() if bounds is not None else unbounded,
        "efficiency": {k: _ratio(hit_rate, v) for k, v in rates.items()},
        "prefill_work_efficiency": _ratio(w_min, w_router),
        "ttft_s": summarize_latency(ttfts),
        "ttft_over_lb": {
            "p50": percentile(over_lb, 50, "linear"),
            "p99": percentile(over_lb, 99, "linear"),
        },
        "load_imbalance": load_imbalance(intervals, workers, window_s),
        "index_fidelity": index_fidelity(records),
        "routing_capture": routing_capture(records),
        "tiers": tiers(records, prompt),
        "worker_share": {w: _ratio(n, len(records)) for w, n in sorted(share.items())},
        "makespan_s": max(finished, default=0.0),
        "utilisation": _ratio(busy, span * len(workers)),
        "output_tokens_per_s": _ratio(output, span),
    }
