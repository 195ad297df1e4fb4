"""Read a worker's own counters (``GET /metrics``): llama.cpp's or SGLang's.

Counter names of xllamacpp 2026.10.11549 (llama.cpp's server):
``llamacpp:prompt_tokens_total`` counts prompt tokens *computed* (cached ones excluded),
``llamacpp:prompt_tokens_cached_total`` prompt tokens reused from the KV cache; the
gauges ``llamacpp:requests_processing`` / ``llamacpp:requests_deferred`` are requests in
a slot / waiting for one. The engine-reported cached fraction of a run is therefore
``Δcached / (Δcached + Δcomputed)`` summed over the workers.

SGLang 0.5.23 (``--enable-metrics``; the simulator serves the same names):
``sglang:prompt_tokens_total`` counts *all* prompt tokens of finished requests (one sample
per ``is_streaming`` label, summed here), ``sglang:cached_tokens_total`` the cached ones
(per ``cache_source``: the ``total`` sample when there is one, else the sum of the
sources); computed = prompt - cached. Gauges ``sglang:num_running_reqs`` /
``sglang:num_queue_reqs``. :meth:`EngineCounters.from_metrics` reads whichever engine's
names are present.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

PROMPT_TOKENS = "llamacpp:prompt_tokens_total"
CACHED_TOKENS = "llamacpp:prompt_tokens_cached_total"
PROCESSING = "llamacpp:requests_processing"
DEFERRED = "llamacpp:requests_deferred"
PREDICTED_TOKENS = "llamacpp:tokens_predicted_total"
SGLANG_PROMPT = "sglang:prompt_tokens_total"
SGLANG_CACHED = "sglang:cached_tokens_total"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_QUEUED = "sglang:num_queue_reqs"
SGLANG_GENERATED = "sglang:generation_tokens_total"
SGLANG_TTFT = "sglang:time_to_first_token_seconds"  # histogram: _sum and _count read


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, keyed by name (with labels, if any)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            samples[name] = float(value)
        except ValueError:
            continue
    return samples


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One worker's cumulative prompt counters and its current load gauges."""

    computed_tokens: float
    cached_tokens: float
    processing: float
    deferred: float
    predicted_tokens: float
    ttft_sum_s: float = 0.0  # SGLang's TTFT histogram (sum, count); 0 for llama.cpp
    ttft_count: float = 0.0

    @classmethod
    def from_metrics(cls, samples: dict[str, float]) -> EngineCounters:
        """Build from parsed ``/metrics`` (llama.cpp's names, else SGLang's); raises
        ``KeyError`` naming a missing counter."""
        if PROMPT_TOKENS not in samples and any(k.startswith("sglang:") for k in samples):
            return cls.from_sglang(samples)
        return cls(
            computed_tokens=samples[PROMPT_TOKENS],
            cached_tokens=samples[CACHED_TOKENS],
            processing=samples[PROCESSING],
            deferred=samples[DEFERRED],
            predicted_tokens=samples[PREDICTED_TOKENS],
        )

    @classmethod
    def from_sglang(cls, samples: dict[str, float]) -> EngineCounters:
        """Build from an SGLang ``/metrics`` (see the module docstring). Counters that have
        no sample yet (no request finished) are 0."""
        prompt = family_sum(samples, SGLANG_PROMPT)
        cached_by_source = family(samples, SGLANG_CACHED)
        total = [v for k, v in cached_by_source.items() if 'cache_source="total"' in k]
        cached = total[0] if total else sum(cached_by_source.values())
        return cls(
            computed_tokens=prompt - cached,
            cached_tokens=cached,
            processing=family_sum(samples, SGLANG_RUNNING),
            deferred=family_sum(samples, SGLANG_QUEUED),
            predicted_tokens=family_sum(samples, SGLANG_GENERATED),
            ttft_sum_s=family_sum(samples, SGLANG_TTFT + "_sum"),
            ttft_count=family_sum(samples, SGLANG_TTFT + "_count"),
        )


def family(samples: dict[str, float], name: str) -> dict[str, float]:
    """The samples of metric ``name``: unlabelled or any labels (not ``_bucket`` etc.)."""
    return {k: v for k, v in samples.items() if k == name or k.startswith(name + "{")}


def family_sum(samples: dict[str, float], name: str) -> float:
    """Sum of every sample of ``name`` over its label sets; 0 when none."""
    return sum(family(samples, name).values())


async def read_counters(session: aiohttp.ClientSession, url: str) -> EngineCounters:
    """``GET {url}/metrics`` and parse it. Raises on a non-200 answer."""
    async with session.get(url + "/metrics", raise_for_status=True) as response:
        return EngineCounters.from_metrics(parse_prometheus(await response.text()))


async def read_fleet(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[EngineCounters]:
    """Counters of every worker, in ``urls`` order."""
    return list(await asyncio.gather(*(read_counters(session, u) for u in urls)))


@dataclass(frozen=True, slots=True)
class CacheTotals:
    """Prompt tokens the workers computed and reused between two readings."""

    computed_tokens: float
    cached_tokens: float
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0

    @property
    def engine_ttft_mean_s(self) -> float:
        """Mean TTFT the engines measured (SGLang's histogram); NaN when none counted."""
        return self.ttft_sum_s / self.ttft_count if self.ttft_count else float("nan")

    @property
    def cached_fraction(self) -> float:
        """Cached / all prompt tokens; 0 when there were none."""
        total = self.computed_tokens + self.cached_tokens
        return self.cached_tokens / total if total else 0.0


def cache_delta(before: Sequence[EngineCounters], after: Sequence[EngineCounters]) -> CacheTotals:
    """Fleet-wide prompt-token deltas between two ``read_fleet`` results (same order)."""
    if len(before) != len(after):
        raise ValueError("readings of different fleets")
    return CacheTotals(
        computed_tokens=sum(
            a.computed_tokens - b.computed_tokens for b, a in zip(before, after, strict=True)
        ),
        cached_tokens=sum(
            a.cached_tokens - b.cached_tokens for b, a in zip(before, after, strict=True)
        ),
        ttft_sum_s=sum(a.ttft_sum_s - b.ttft_sum_s for b, a in zip(before, after, strict=True)),
        ttft_count=sum(a.ttft_count - b.ttft_count for b, a in zip(before, after, strict=True)),
    )
