"""Read a llama.cpp worker's own counters (``GET /metrics``, needs ``endpoint_metrics``).

Counter names of xllamacpp 2026.10.11549 (llama.cpp's server):
``llamacpp:prompt_tokens_total`` counts prompt tokens *computed* (cached ones excluded),
``llamacpp:prompt_tokens_cached_total`` prompt tokens reused from the KV cache; the
gauges ``llamacpp:requests_processing`` / ``llamacpp:requests_deferred`` are requests in
a slot / waiting for one. The engine-reported cached fraction of a run is therefore
``Δcached / (Δcached + Δcomputed)`` summed over the workers.
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

    @classmethod
    def from_metrics(cls, samples: dict[str, float]) -> EngineCounters:
        """Build from parsed ``/metrics``; raises ``KeyError`` naming a missing counter."""
        return cls(
            computed_tokens=samples[PROMPT_TOKENS],
            cached_tokens=samples[CACHED_TOKENS],
            processing=samples[PROCESSING],
            deferred=samples[DEFERRED],
            predicted_tokens=samples[PREDICTED_TOKENS],
        )


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
    )
