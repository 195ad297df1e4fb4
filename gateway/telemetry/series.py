"""The gateway's push-style metric families and their per-worker children.

:class:`Metrics` registers every family updated on the request path in one registry;
:class:`WorkerStats` caches one worker's children and keeps the plain figures the
dashboard reads (request count, recent TTFTs, token sums). Event loop thread only.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry

from gateway.telemetry.metrics import (
    CounterChild,
    CounterVec,
    HistogramChild,
    HistogramVec,
    PushCollector,
)

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
MATCH_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    """The push-style metric families (lock-free; see ``telemetry_metrics``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        w = ["worker"]
        self.requests = CounterVec(
            "gateway_requests", "Finished requests.", ["worker", "route", "status"]
        )
        self.duration = HistogramVec(
            "gateway_request_duration_seconds",
            "Request duration, arrival to last byte.",
            w,
            DURATION_BUCKETS,
        )
        self.ttft = HistogramVec(
            "gateway_time_to_first_token_seconds",
            "Upstream send to the worker's first byte.",
            w,
            TTFT_BUCKETS,
        )
        self.decisions = CounterVec(
            "gateway_routing_decisions", "Routing decisions.", ["policy", "reason"]
        )
        self.match_ratio = HistogramVec(
            "gateway_prefix_match_ratio",
            "Predicted cached share of the prompt at decision.",
            ["policy"],
            MATCH_RATIO_BUCKETS,
        )
        self.prompt_tokens = CounterVec(
            "gateway_worker_prompt_tokens", "Estimated prompt tokens of finished requests.", w
        )
        self.predicted = CounterVec(
            "gateway_worker_predicted_cached_tokens",
            "Cached tokens the prefix index predicted for finished requests.",
            w,
        )
        self.reported = CounterVec(
            "gateway_worker_reported_cached_tokens",
            "Cached tokens the worker reported (cached_tokens) for finished requests.",
            w,
        )
        # The captured hit rate's denominator: streams without include_usage report nothing.
        self.reported_prompt = CounterVec(
            "gateway_worker_reported_prompt_tokens",
            "Estimated prompt tokens of finished requests the worker reported cached tokens for.",
            w,
        )
        self.retries = CounterVec(
            "gateway_retries", "Attempts retried on another worker.", ["route"]
        )
        self.upstream_errors = CounterVec(
            "gateway_upstream_errors", "Failed attempts at a worker.", ["worker", "kind"]
        )
        self.ejections = CounterVec("gateway_worker_ejections", "Outlier ejections.", w)
        self.slot_waits = HistogramVec(
            "gateway_slot_wait_seconds",
            "Time requests were held for a busy slot holding their prefix.",
            ["policy"],
            TTFT_BUCKETS,
        )
        families = (
            self.requests, self.duration, self.ttft, self.decisions, self.match_ratio,
            self.prompt_tokens, self.predicted, self.reported, self.reported_prompt, self.retries,
            self.upstream_errors, self.ejections, self.slot_waits,
        )  # fmt: skip
        registry.register(PushCollector(families))
        self.per_worker = [f for f in families if "worker" in f.labelnames]


class WorkerStats:
    """Per-worker cached metric children plus plain figures for the dashboard.

    Series other than requests and duration appear on first use, so a worker label that
    only ever saw rejected requests (``none``) carries no empty TTFT or token series."""

    __slots__ = (
        "_m",
        "_predicted",
        "_prompt",
        "_reported",
        "_reported_prompt",
        "duration",
        "errors",
        "predicted_tokens",
        "prompt_tokens",
        "reported_prompt_tokens",
        "reported_tokens",
        "requests",
        "requests_by_key",
        "ttft",
        "ttft_recent",
        "worker",
    )  # fmt: skip

    def __init__(self, worker: str, metrics: Metrics, window: int) -> None:
        self.worker = worker
        self._m = metrics
        self.duration = metrics.duration.labels(worker)
        self.ttft: HistogramChild | None = None
        self._prompt: CounterChild | None = None
        self._predicted: CounterChild | None = None
        self._reported: CounterChild | None = None
        self._reported_prompt: CounterChild | None = None
        self.requests_by_key: dict[tuple[str, int], CounterChild] = {}
        self.ttft_recent: deque[tuple[float, float]] = deque(maxlen=window)
        self.requests = 0
        self.errors = 0  # status >= 500
        self.prompt_tokens = 0
        self.predicted_tokens = 0
        self.reported_prompt_tokens = 0  # prompt tokens of requests the worker reported on
        self.reported_tokens = 0

    def count(self, route: str, status: int) -> None:
        """One finished request."""
        child = self.requests_by_key.get((route, status))
        if child is None:
            child = self._m.requests.labels(self.worker, route, str(status))
            self.requests_by_key[(route, status)] = child
        child.inc()
        self.requests += 1
        if status >= 500:
            self.errors += 1

    def observe_ttft(self, ttft_s: float) -> None:
        """One time to first token."""
        if self.ttft is None:
            self.ttft = self._m.ttft.labels(self.worker)
        self.ttft.observe(ttft_s)
        self.ttft_recent.append((time.monotonic(), ttft_s))

    def tokens(self, prompt: int, predicted: int, reported: int | None) -> None:
        """Index fidelity figures of one successful request."""
        if self._prompt is None or self._predicted is None:
            self._prompt = self._m.prompt_tokens.labels(self.worker)
            self._predicted = self._m.predicted.labels(self.worker)
        self.prompt_tokens += prompt
        self.predicted_tokens += predicted
        self._prompt.inc(prompt)
        self._predicted.inc(predicted)
        if reported is not None:
            if self._reported is None or self._reported_prompt is None:
                self._reported = self._m.reported.labels(self.worker)
                self._reported_prompt = self._m.reported_prompt.labels(self.worker)
            self.reported_prompt_tokens += prompt
            self.reported_tokens += reported
            self._reported.inc(reported)
            self._reported_prompt.inc(prompt)
