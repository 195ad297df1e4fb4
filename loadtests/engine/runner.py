"""Send a workload to a fleet and judge it by the engines' own counters.

The engine-reported cached fraction of a run is ``Δprompt_tokens_cached_total /
Δ(cached + prompt_tokens_total)`` summed over all workers, read before and after;
TTFT is client-side (first streamed event); on SGLang workers also the engines' own mean
(``Δsum / Δcount`` of ``sglang:time_to_first_token_seconds``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadtests.engine.client import ChatResult, engine_session, run_chains, run_clients
from loadtests.engine.probe import CacheTotals, cache_delta, read_fleet
from loadtests.engine.workload import PrefixRequest
from loadtests.harness.stats import percentile

Route = Callable[[PrefixRequest], str]


@dataclass(frozen=True, slots=True)
class RunResult:
    """One target's run of the workload."""

    target: str
    requests: int
    failures: int
    cached_fraction: float  # engine counters, fleet-wide (usage when counters are off)
    ttft_p50_s: float
    ttft_p90_s: float
    wall_s: float
    reported_fraction: float = float("nan")  # Σ usage cached_tokens / Σ prompt_tokens
    error: str = ""
    engine_ttft_mean_s: float = float("nan")  # SGLang's TTFT histogram; NaN elsewhere
    router_cpu_s: float = float("nan")  # the router process's CPU during the run; NaN direct


def reported_fraction(results: Sequence[ChatResult]) -> float:
    """Cached share of prompt tokens as reported in each response's ``usage``."""
    prompt = sum(r.prompt_tokens for r in results if r.ok)
    return sum(r.cached_tokens for r in results if r.ok) / prompt if prompt else float("nan")


async def run_workload(
    urls: Sequence[str],
    route: Route,
    requests: Sequence[PrefixRequest],
    concurrency: int,
    engine_counters: bool = True,
) -> tuple[list[ChatResult], float, float]:
    """Send the requests; return results, cached fraction and wall time.

    The fraction comes from the workers' ``/metrics`` (llama.cpp's or SGLang's) read
    before and after; with ``engine_counters=False`` from the responses' ``usage``.
    """
    results, totals, wall = await run_workload_totals(
        urls, route, requests, concurrency, engine_counters
    )
    fraction = totals.cached_fraction if totals is not None else reported_fraction(results)
    return results, fraction, wall


async def run_workload_totals(
    urls: Sequence[str],
    route: Route,
    requests: Sequence[PrefixRequest],
    concurrency: int,
    engine_counters: bool = True,
    settle_s: float = 0.0,
) -> tuple[list[ChatResult], CacheTotals | None, float]:
    """As :func:`run_workload`, returning the engines' counter deltas (None without
    ``engine_counters``). ``settle_s``: wait this long after the last response before
    the second reading (SGLang updates some counters just after a stream ends).
    Requests of one ``chain`` go in order, never two at once (``client.run_chains``)."""
    async with engine_session() as session:
        before = await read_fleet(session, urls) if engine_counters else []
        start = time.perf_counter()
        jobs = [(route(r), r.body) for r in requests]
        if any(r.chain is not None for r in requests):
            chains = [-1 - r.index if r.chain is None else r.chain for r in requests]
            results = await run_chains(session, jobs, chains, concurrency)
        else:
            results = await run_clients(session, jobs, concurrency)
        wall = time.perf_counter() - start
        if not engine_counters:
            return results, None, wall
        await asyncio.sleep(settle_s)
        after = await read_fleet(session, urls)
    return results, cache_delta(before, after), wall


def summarize(
    target: str,
    results: Sequence[ChatResult],
    fraction: float,
    wall: float,
    engine_ttft_mean_s: float = math.nan,
) -> RunResult:
    """Aggregate one run; failures are requests without a 200 and a usage chunk."""
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    failed = [r for r in results if not r.ok]
    return RunResult(
        target=target,
        requests=len(results),
        failures=len(failed),
        cached_fraction=fraction,
        ttft_p50_s=percentile(ttfts, 50, "linear"),
        ttft_p90_s=percentile(ttfts, 90, "linear"),
        wall_s=wall,
        reported_fraction=reported_fraction(results),
        error=failed[0].error if failed else "",
        engine_ttft_mean_s=engine_ttft_mean_s,
    )
