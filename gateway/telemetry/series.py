"""The gateway's push-style metric families and their per-worker and per-model children.

:class:`Metrics` registers every family updated on the request path in one registry;
:class:`WorkerStats` caches one worker's children and keeps the plain figures the
dashboard reads (request count, recent TTFTs, token sums); :class:`ModelStats` does the
same for one ``model`` label value (``gateway_model_*``); :class:`Capture` sums routing
capture (available, captured, delivered) for the gateway and per model. Event loop
thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

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
        # per model (the request's base model when served, else "other"; bounded by the hub)
        self.model_requests = CounterVec(
            "gateway_model_requests", "Finished requests, per model.", ["model", "route", "status"]
        )
        self.model_ttft = HistogramVec(
            "gateway_model_time_to_first_token_seconds",
            "Upstream send to the worker's first byte, per model.",
            ["model"],
            TTFT_BUCKETS,
        )
        self.model_prompt = CounterVec(
            "gateway_model_prompt_tokens",
            "Estimated prompt tokens of finished requests, per model.",
            ["model"],
        )
        self.model_cached = CounterVec(
            "gateway_model_cached_tokens",
            "Cached tokens of finished requests, per model: predicted by the gateway's "
            "index, or reported by the worker.",
            ["model", "kind"],
        )
        self.model_reported_prompt = CounterVec(
            "gateway_model_reported_prompt_tokens",
            "Estimated prompt tokens of finished requests the worker reported cached tokens "
            "for, per model.",
            ["model"],
        )
        # routing capture (docs/TELEMETRY.md): the whole gateway, and per model
        self.capture_tokens = CounterVec(
            "gateway_prefix_tokens",
            "Routing capture of finished requests whose policy consulted an index: the "
            "longest match on any candidate (available), the match at the chosen worker "
            "(captured); over those the worker reported cached tokens for, what it reported "
            "(delivered) and their available tokens (reported_available).",
            ["kind"],
        )
        self.capture_requests = CounterVec(
            "gateway_prefix_capture_requests",
            "Finished requests by whether an index was consulted (available known or "
            "unknown) and whether the worker reported cached tokens.",
            ["available", "delivered"],
        )
        self.model_capture_tokens = CounterVec(
            "gateway_model_prefix_tokens",
            "gateway_prefix_tokens per model.",
            ["model", "kind"],
        )
        self.model_capture_requests = CounterVec(
            "gateway_model_prefix_capture_requests",
            "gateway_prefix_capture_requests per model.",
            ["model", "available", "delivered"],
        )
        families = (
            self.requests, self.duration, self.ttft, self.decisions, self.match_ratio,
            self.prompt_tokens, self.predicted, self.reported, self.reported_prompt, self.retries,
            self.upstream_errors, self.ejections, self.slot_waits, self.model_requests,
            self.model_ttft, self.model_prompt, self.model_cached, self.model_reported_prompt,
            self.capture_tokens, self.capture_requests, self.model_capture_tokens,
            self.model_capture_requests,
        )  # fmt: skip
        registry.register(PushCollector(families))
        self.per_worker = [f for f in families if "worker" in f.labelnames]
        self.worker_tally = TallyFamilies(
            self.requests,
            self.prompt_tokens.labels,
            self.predicted.labels,
            self.reported.labels,
            self.reported_prompt.labels,
        )
        cached = self.model_cached
        self.model_tally = TallyFamilies(
            self.model_requests,
            self.model_prompt.labels,
            lambda model: cached.labels(model, "predicted"),
            lambda model: cached.labels(model, "reported"),
            self.model_reported_prompt.labels,
        )


@dataclass(frozen=True, slots=True)
class TallyFamilies:
    """Where a :class:`Tally`'s children come from, given its label value."""

    requests: CounterVec  # labelled (value, route, status)
    prompt: Callable[[str], CounterChild]
    predicted: Callable[[str], CounterChild]
    reported: Callable[[str], CounterChild]
    reported_prompt: Callable[[str], CounterChild]


class Tally:
    """Finished requests and their token figures for one label value (a worker, a model):
    cached metric children plus the plain sums the dashboard reads. Token series appear
    on first use, so a value that only ever saw rejected requests carries none."""

    __slots__ = (
        "_f", "_label", "_predicted", "_prompt", "_reported", "_reported_prompt", "errors",
        "predicted_tokens", "prompt_tokens", "reported_prompt_tokens", "reported_tokens",
        "requests", "requests_by_key",
    )  # fmt: skip

    def __init__(self, label: str, families: TallyFamilies) -> None:
        self._label = label
        self._f = families
        self._prompt: CounterChild | None = None
        self._predicted: CounterChild | None = None
        self._reported: CounterChild | None = None
        self._reported_prompt: CounterChild | None = None
        self.requests_by_key: dict[tuple[str, int], CounterChild] = {}
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
            child = self._f.requests.labels(self._label, route, str(status))
            self.requests_by_key[(route, status)] = child
        child.inc()
        self.requests += 1
        if status >= 500:
            self.errors += 1

    def tokens(self, prompt: int, predicted: int, reported: int | None) -> None:
        """Index fidelity figures of one successful request."""
        if self._prompt is None or self._predicted is None:
            self._prompt = self._f.prompt(self._label)
            self._predicted = self._f.predicted(self._label)
        self.prompt_tokens += prompt
        self.predicted_tokens += predicted
        self._prompt.inc(prompt)
        self._predicted.inc(predicted)
        if reported is not None:
            if self._reported is None or self._reported_prompt is None:
                self._reported = self._f.reported(self._label)
                self._reported_prompt = self._f.reported_prompt(self._label)
            self.reported_prompt_tokens += prompt
            self.reported_tokens += reported
            self._reported.inc(reported)
            self._reported_prompt.inc(prompt)


class WorkerStats(Tally):
    """Per-worker cached metric children plus plain figures for the dashboard (request
    count, recent TTFTs, token sums).

    Series other than requests and duration appear on first use, so a worker label that
    only ever saw rejected requests (``none``) carries no empty TTFT or token series."""

    __slots__ = ("_m", "duration", "ttft", "ttft_recent", "worker")

    def __init__(self, worker: str, metrics: Metrics, window: int) -> None:
        super().__init__(worker, metrics.worker_tally)
        self.worker = worker
        self._m = metrics
        self.duration = metrics.duration.labels(worker)
        self.ttft: HistogramChild | None = None
        self.ttft_recent: deque[tuple[float, float]] = deque(maxlen=window)

    def observe_ttft(self, ttft_s: float) -> None:
        """One time to first token."""
        if self.ttft is None:
            self.ttft = self._m.ttft.labels(self.worker)
        self.ttft.observe(ttft_s)
        self.ttft_recent.append((time.monotonic(), ttft_s))


class ModelStats(Tally):
    """One ``model`` label value's children and figures (``gateway_model_*``)."""

    __slots__ = ("_m", "_ttft", "capture", "model")

    def __init__(self, model: str, metrics: Metrics) -> None:
        super().__init__(model, metrics.model_tally)
        self.model = model
        self._m = metrics
        self._ttft: HistogramChild | None = None
        self.capture = Capture(
            metrics.model_capture_tokens, metrics.model_capture_requests, (model,)
        )

    def observe_ttft(self, ttft_s: float) -> None:
        """One time to first token."""
        if self._ttft is None:
            self._ttft = self._m.model_ttft.labels(self.model)
        self._ttft.observe(ttft_s)


CAPTURE_TOKEN_KINDS = (
    "available", "captured", "delivered", "reported_available", "captured_host", "delivered_host",
)  # fmt: skip


class Capture:
    """Routing capture over finished requests, for one label value (the gateway's, or one
    model's): per request *available* (the longest match on any candidate), *captured*
    (the match at the chosen worker) and *delivered* (the cached tokens the worker
    reported), summed; the replay's ``routing_capture`` (``loadtests.replay.metrics``,
    its ``predicted`` way) live.

    Denominators stay honest: tokens are summed only over requests whose policy consulted
    an index (available known); delivered, and the available tokens it is compared with
    (``reported_available``), only over those the worker reported cached tokens for. The
    others are counted apart (``gateway_prefix_capture_requests``). Children appear on
    first use.

    Cache tiers (HiCache): ``captured_host``, of the captured tokens those believed on the
    chosen worker's host tier (over the same requests as captured); ``delivered_host``, of
    the delivered tokens those the worker reported loaded from its host tier
    (``cached_tokens_details``, over the requests that answered them). Both appear at
    their first host token."""

    __slots__ = (
        "_by_kind", "_delivered", "_host", "_known", "_labels", "_requests", "_tokens",
        "available_tokens", "captured_host_tokens", "captured_tokens", "delivered_host_tokens",
        "delivered_tokens", "reported_available_tokens", "reported_requests", "requests",
        "tier_reports", "unindexed_requests",
    )  # fmt: skip

    def __init__(
        self, tokens: CounterVec, requests: CounterVec, labels: tuple[str, ...] = ()
    ) -> None:
        self._tokens = tokens
        self._requests = requests
        self._labels = labels
        # cached children: requests by (known, reported) as 2 * known + reported; the
        # token kinds available and captured, then delivered and reported_available
        self._by_kind: list[CounterChild | None] = [None] * 4
        self._known: tuple[CounterChild, CounterChild] | None = None
        self._delivered: tuple[CounterChild, CounterChild] | None = None
        self._host: dict[str, CounterChild] = {}  # captured_host, delivered_host
        self.captured_host_tokens = 0
        self.delivered_host_tokens = 0
        self.tier_reports = 0  # requests whose worker answered cached_tokens_details
        self.available_tokens = 0
        self.captured_tokens = 0
        self.delivered_tokens = 0
        self.reported_available_tokens = 0
        self.requests = 0  # available known (an index was consulted)
        self.reported_requests = 0  # of those, the worker reported cached tokens
        self.unindexed_requests = 0  # no index consulted: available unknown

    def _count(self, known: bool, reported: bool) -> None:
        i = 2 * known + reported
        child = self._by_kind[i]
        if child is None:
            values = ("known" if known else "unknown", "reported" if reported else "unreported")
            child = self._by_kind[i] = self._requests.labels(*self._labels, *values)
        child.inc()

    def _pair(self, first: str, second: str) -> tuple[CounterChild, CounterChild]:
        tokens, labels = self._tokens, self._labels
        return tokens.labels(*labels, first), tokens.labels(*labels, second)

    def _host_tokens(self, kind: str, tokens: int) -> None:
        child = self._host.get(kind)
        if child is None:
            child = self._host[kind] = self._tokens.labels(*self._labels, kind)
        child.inc(tokens)

    def add(
        self,
        available: int | None,
        captured: int,
        delivered: int | None,
        captured_host: int = 0,
        delivered_host: int | None = None,
    ) -> None:
        """One successful request: ``available`` None when no index was consulted,
        ``delivered`` None when the worker reported no cached tokens; their host-tier
        parts (``delivered_host`` None: no ``cached_tokens_details``)."""
        self._count(available is not None, delivered is not None)
        if available is None:
            self.unindexed_requests += 1
            return
        if captured_host > 0:
            self.captured_host_tokens += captured_host
            self._host_tokens("captured_host", captured_host)
        if delivered is not None and delivered_host is not None:
            self.tier_reports += 1
            if delivered_host > 0:
                self.delivered_host_tokens += delivered_host
                self._host_tokens("delivered_host", delivered_host)
        self.requests += 1
        self.available_tokens += available
        self.captured_tokens += captured
        known = self._known
        if known is None:
            known = self._known = self._pair("available", "captured")
        known[0].inc(available)
        known[1].inc(captured)
        if delivered is not None:
            self.reported_requests += 1
            self.delivered_tokens += delivered
            self.reported_available_tokens += available
            pair = self._delivered
            if pair is None:
                pair = self._delivered = self._pair("delivered", "reported_available")
            pair[0].inc(delivered)
            pair[1].inc(available)

    def summary(self) -> dict[str, float | int | None]:
        """The sums, the two ratios (None without a denominator; delivered / available
        is not capped: it can exceed 1) and the requests behind them."""
        avail, rep_avail = self.available_tokens, self.reported_available_tokens
        return {
            "available_tokens": avail,
            "captured_tokens": self.captured_tokens,
            "delivered_tokens": self.delivered_tokens,
            "captured_host_tokens": self.captured_host_tokens,
            "delivered_host_tokens": self.delivered_host_tokens,
            "tier_reports": self.tier_reports,
            "reported_available_tokens": rep_avail,
            "captured_over_available": self.captured_tokens / avail if avail else None,
            "delivered_over_available": self.delivered_tokens / rep_avail if rep_avail else None,
            "requests": self.requests,
            "reported_requests": self.reported_requests,
            "unreported_requests": self.requests - self.reported_requests,
            "unindexed_requests": self.unindexed_requests,
        }
