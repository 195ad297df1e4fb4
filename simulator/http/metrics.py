"""``/metrics`` of a simulated worker: SGLang's ``sglang:`` families, written by hand.

Exposition style of SGLang's ``prometheus_client`` multiprocess mode (SGLANG_API.md §3):
labels in alphabetical order, no ``_created`` samples, counter families named with their
``_total`` suffix, histograms as ``_sum``, ``_bucket`` (cumulative, ``le`` sorted among the
labels), ``_count``, gauges without a multiprocess mode carrying a ``pid`` label.

* Scheduler gauges (``{engine_type, model_name, moe_ep_rank, pp_rank, tp_rank}``) come from
  the model's lagged snapshot (refreshed per prefill batch, every 40 decode steps, idle);
  with DP ranks one series per rank, with a ``dp_rank`` label.
* Tokenizer metrics (``{engine_type, model_name[, is_streaming]}``) are observed per request
  in modelled seconds, recorded at finish except time to first token. Like prometheus
  children, a labelled series appears once it was first touched.
* With HiCache (:func:`render_hicache`): the scheduler's ``sglang:hicache_host_used_tokens``
  and ``_total_tokens`` gauges and ``sglang:prefill_effective_tokens_total{mode}``, and the
  radix cache collector's families (``{cache_type, dp_rank, pp_rank, tp_rank}``, dp_rank
  "0" on every rank as SGLang labels them without DP attention, so ranks sum): evicted,
  loaded-back, backed-up and dropped tokens, bytes, and the load and backup durations.
  ``cached_tokens_total`` then splits ``device`` and ``host``.

Written by hand because it is cheap: one scrape is a few dozen string joins.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from simulator.model.hiradix_cache import HiRadixCache
from simulator.model.radix_state import Counters, ModelStats

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
# SGLang's RadixCacheMetricsCollector buckets (0.5.23)
LOAD_BACK_BUCKETS = (
    0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.02, 0.03, 0.04,
    0.05, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip
BACKUP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def floatToGoString(value: float) -> str:
    """Sample values as prometheus_client prints them (Go's float formatting)."""
    d = float(value)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value
        self.count += n


@dataclass
class RequestMetrics:
    """Tokenizer-side metrics of one worker, keyed by ``is_streaming`` ("true"/"false")."""

    prompt_tokens: dict[str, int] = field(default_factory=dict)
    generation_tokens: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)  # by cache_source
    aborted: int | None = None
    ttft: dict[str, Histogram] = field(default_factory=dict)
    e2e: dict[str, Histogram] = field(default_factory=dict)
    itl: Histogram | None = None

    def observe_first_token(self, streaming: bool, ttft_s: float) -> None:
        key = "true" if streaming else "false"
        hist = self.ttft.get(key)
        if hist is None:
            hist = self.ttft[key] = Histogram(TTFT_BUCKETS)
        hist.observe(ttft_s)

    def observe_finished(
        self,
        streaming: bool,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        e2e_s: float,
        decode_s: float,
        cached_host: int = 0,
    ) -> None:
        key = "true" if streaming else "false"
        self.prompt_tokens[key] = self.prompt_tokens.get(key, 0) + prompt_tokens
        self.generation_tokens[key] = self.generation_tokens.get(key, 0) + completion_tokens
        self.requests[key] = self.requests.get(key, 0) + 1
        # by source, each only when positive (SGLang's report_cache_source)
        for source, value in (("device", cached_tokens - cached_host), ("host", cached_host)):
            if value > 0:
                self.cached_tokens[source] = self.cached_tokens.get(source, 0) + value
        hist = self.e2e.get(key)
        if hist is None:
            hist = self.e2e[key] = Histogram(E2E_BUCKETS)
        hist.observe(e2e_s)
        if completion_tokens > 1 and decode_s > 0:
            if self.itl is None:
                self.itl = Histogram(ITL_BUCKETS)
            self.itl.observe(decode_s / (completion_tokens - 1), completion_tokens - 1)

    def observe_aborted(self) -> None:
        self.aborted = (self.aborted or 0) + 1


@dataclass
class TransferMetrics:
    """HiCache's copy durations (modelled seconds), observed through each rank's
    :attr:`HiRadixCache.on_transfer`."""

    load: Histogram = field(default_factory=lambda: Histogram(LOAD_BACK_BUCKETS))
    backup: Histogram = field(default_factory=lambda: Histogram(BACKUP_BUCKETS))

    def observe(self, kind: str, tokens: int, seconds: float) -> None:
        (self.load if kind == "load" else self.backup).observe(seconds)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items())) + "}"


def _family(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")


def _histogram(lines: list[str], name: str, labels: dict[str, str], hist: Histogram) -> None:
    lines.append(f"{name}_sum{_labels(labels)} {floatToGoString(hist.sum)}")
    cumulative = 0
    for bound, n in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
        cumulative += n
        bucket_labels = {**labels, "le": floatToGoString(bound)}
        lines.append(f"{name}_bucket{_labels(bucket_labels)} {floatToGoString(cumulative)}")
    lines.append(f"{name}_count{_labels(labels)} {floatToGoString(hist.count)}")


_SCHEDULER_GAUGES: tuple[tuple[str, str], ...] = (
    ("num_running_reqs", "The number of running requests."),
    ("num_queue_reqs", "The number of requests in the waiting queue."),
    ("num_grammar_queue_reqs", "The number of requests in the grammar waiting queue."),
    ("gen_throughput", "The generation throughput (token/s)."),
    ("cache_hit_rate", "The prefix cache hit rate."),
    ("decode_sum_seq_lens", "The sum of all sequence lengths in decode."),
    ("token_usage", "The token usage."),
    ("full_token_usage", "The token usage for full attention layers."),
    ("num_used_tokens", "The number of used tokens."),
    ("kv_available_tokens", "Number of free token slots in the KV cache pool."),
    ("kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool."),
    ("kv_used_tokens", "Number of actively used token slots in the KV cache pool."),
    ("utilization", "The utilization."),
    ("new_token_ratio", "The new token ratio."),
    ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    ("page_size", "The page size of the KV cache."),
    ("num_pages", "The number of pages in the KV cache pool."),
    ("context_len", "The context length of the model."),
)
_PID_GAUGES: tuple[tuple[str, str], ...] = (
    ("num_retracted_reqs", "The number of retracted requests."),
    ("num_paused_reqs", "The number of paused requests by async weight sync."),
)


def scheduler_values(snap: ModelStats, page_size: int, context_length: int) -> dict[str, float]:
    return {
        "num_running_reqs": snap.num_running_reqs,
        "num_queue_reqs": snap.num_waiting_reqs,
        "num_grammar_queue_reqs": 0,
        "gen_throughput": snap.gen_throughput,
        "cache_hit_rate": snap.cache_hit_rate,
        "decode_sum_seq_lens": snap.decode_sum_seq_lens,
        "token_usage": round(snap.token_usage, 2),
        "full_token_usage": round(snap.token_usage, 2),
        "num_used_tokens": snap.num_used_tokens,
        "kv_available_tokens": snap.kv_available_tokens,
        "kv_evictable_tokens": snap.kv_evictable_tokens,
        "kv_used_tokens": snap.num_used_tokens,
        "utilization": snap.utilization,
        "new_token_ratio": snap.new_token_ratio,
        "max_total_num_tokens": snap.max_total_num_tokens,
        "page_size": page_size,
        "num_pages": snap.max_total_num_tokens // page_size,
        "context_len": context_length,
        "num_retracted_reqs": snap.num_retracted_reqs,
        "num_paused_reqs": 0,
    }


def render(
    model_name: str,
    snap: ModelStats | Sequence[ModelStats],
    requests: RequestMetrics,
    page_size: int,
    context_length: int,
    hicache: HiCacheView | None = None,
) -> bytes:
    """The whole exposition, ``text/plain; version=0.0.4``. ``snap``: the scheduler's
    snapshot, or one per DP rank (then each scheduler gauge has one series per rank,
    labelled ``dp_rank`` as SGLang labels them with ``--dp-size``). ``hicache``: the host
    tiers' families too."""
    base = {"engine_type": "unified", "model_name": model_name}
    sched = {**base, "moe_ep_rank": "0", "pp_rank": "0", "tp_rank": "0"}
    snaps = [snap] if isinstance(snap, ModelStats) else list(snap)
    values = [
        (
            {**sched, "dp_rank": str(r)} if len(snaps) > 1 else sched,
            scheduler_values(s, page_size, context_length),
        )
        for r, s in enumerate(snaps)
    ]
    lines: list[str] = []
    for key, help_text in _SCHEDULER_GAUGES:
        name = f"sglang:{key}"
        _family(lines, name, "gauge", help_text)
        for labels, v in values:
            lines.append(f"{name}{_labels(labels)} {floatToGoString(v[key])}")
    pid = str(os.getpid())
    for key, help_text in _PID_GAUGES:
        name = f"sglang:{key}"
        _family(lines, name, "gauge", help_text)
        for labels, v in values:
            lines.append(f"{name}{_labels({**labels, 'pid': pid})} {floatToGoString(v[key])}")

    counters: tuple[tuple[str, str, dict[str, int]], ...] = (
        ("prompt_tokens_total", "Number of prefill tokens processed.", requests.prompt_tokens),
        (
            "generation_tokens_total",
            "Number of generation tokens processed.",
            requests.generation_tokens,
        ),
        ("num_requests_total", "Number of requests processed.", requests.requests),
    )
    for key, help_text, by_stream in counters:
        name = f"sglang:{key}"
        _family(lines, name, "counter", help_text)
        for streaming, value in sorted(by_stream.items()):
            labels = {**base, "is_streaming": streaming}
            lines.append(f"{name}{_labels(labels)} {floatToGoString(value)}")
    name = "sglang:cached_tokens_total"
    help_text = "Number of cached prompt tokens by source (device/host/storage)."
    _family(lines, name, "counter", help_text)
    for source, value in sorted(requests.cached_tokens.items()):
        labels = {**base, "cache_source": source}
        lines.append(f"{name}{_labels(labels)} {floatToGoString(value)}")
    name = "sglang:num_aborted_requests_total"
    if requests.aborted is not None:  # the real server shows the family from the 1st abort
        _family(lines, name, "counter", "Number of requests aborted.")
        lines.append(f"{name}{_labels(base)} {floatToGoString(requests.aborted)}")

    name = "sglang:time_to_first_token_seconds"
    _family(lines, name, "histogram", "Histogram of time to first token in seconds.")
    for streaming, hist in sorted(requests.ttft.items()):
        _histogram(lines, name, {**base, "is_streaming": streaming}, hist)
    name = "sglang:e2e_request_latency_seconds"
    _family(lines, name, "histogram", "Histogram of End-to-end request latency in seconds")
    for streaming, hist in sorted(requests.e2e.items()):
        _histogram(lines, name, {**base, "is_streaming": streaming}, hist)
    name = "sglang:inter_token_latency_seconds"
    _family(lines, name, "histogram", "Histogram of inter-token latency in seconds.")
    if requests.itl is not None:
        _histogram(lines, name, base, requests.itl)
    if hicache is not None:
        render_hicache(lines, [labels for labels, _ in values], snaps, hicache)
    lines.append("")
    return "\n".join(lines).encode()


@dataclass(frozen=True, slots=True)
class HiCacheView:
    """What ``/metrics`` reads of the host tiers: each rank's cache and counters."""

    caches: Sequence[HiRadixCache]
    counters: Sequence[Counters]
    transfers: TransferMetrics


def render_hicache(
    lines: list[str],
    sched_labels: Sequence[dict[str, str]],
    snaps: Sequence[ModelStats],
    view: HiCacheView,
) -> None:
    """HiCache's families (see module docstring), appended to ``lines``."""
    for key, attr, help_text in (
        ("hicache_host_used_tokens", "host_used_tokens", "Tokens used in the host KV cache."),
        ("hicache_host_total_tokens", "host_total_tokens", "Host KV cache capacity in tokens."),
    ):
        name = f"sglang:{key}"
        _family(lines, name, "gauge", help_text)
        for labels, snap in zip(sched_labels, snaps, strict=True):
            lines.append(f"{name}{_labels(labels)} {floatToGoString(getattr(snap, attr))}")
    name = "sglang:prefill_effective_tokens_total"
    _family(lines, name, "counter", "Effective prefill tokens by mode (hits by tier, input).")
    for labels, c in zip(sched_labels, view.counters, strict=True):
        for mode, value in (
            ("device_hit", c.prefill_device_hit_tokens),
            ("host_hit", c.prefill_host_hit_tokens),
            ("input", c.prefill_uncached_tokens),
            ("storage_hit", 0),
        ):
            lines.append(f"{name}{_labels({**labels, 'mode': mode})} {floatToGoString(value)}")

    cache = {"cache_type": "UnifiedRadixCache", "dp_rank": "0", "pp_rank": "0", "tp_rank": "0"}
    kv = {**cache, "pool": "kv"}
    hc = [c.counters for c in view.caches]
    dropped: dict[str, int] = {}
    for counters in hc:
        for reason, value in counters.dropped_tokens.items():
            dropped[reason] = dropped.get(reason, 0) + value
    families: tuple[tuple[str, str, list[tuple[dict[str, str], int]]], ...] = (
        (
            "evicted_tokens_total",
            "Device KV token slots freed by eviction, backed up to host or destroyed.",
            [(cache, sum(c.evicted_total for c in view.caches))],
        ),
        (
            "load_back_tokens_total",
            "Tokens loaded back from host memory (L2) to the GPU.",
            [(kv, sum(c.load_tokens for c in hc))],
        ),
        (
            "load_back_bytes_total",
            "Bytes loaded back from host memory (L2) to the GPU.",
            [(cache, sum(c.load_bytes for c in hc))],
        ),
        (
            "hicache_backup_tokens_total",
            "Tokens backed up from the GPU to host memory (L2).",
            [(kv, sum(c.backup_tokens for c in hc))],
        ),
        (
            "hicache_backup_bytes_total",
            "Bytes backed up from the GPU to host memory (L2).",
            [(cache, sum(c.backup_bytes for c in hc))],
        ),
        (
            "hicache_dropped_tokens_total",
            "Device KV tokens destroyed without a host backup.",
            [({**kv, "reason": reason}, value) for reason, value in sorted(dropped.items())],
        ),
    )
    for key, help_text, samples in families:
        name = f"sglang:{key}"
        _family(lines, name, "counter", help_text)
        for labels, value in samples:
            lines.append(f"{name}{_labels(labels)} {floatToGoString(value)}")
    for key, help_text, hist in (
        (
            "load_back_duration_seconds",
            "Duration of a merged host-to-device load-back copy (modelled seconds).",
            view.transfers.load,
        ),
        (
            "hicache_backup_duration_seconds",
            "Duration of a device-to-host backup copy (modelled seconds).",
            view.transfers.backup,
        ),
    ):
        name = f"sglang:{key}"
        _family(lines, name, "histogram", help_text)
        if hist.count:
            _histogram(lines, name, cache, hist)
