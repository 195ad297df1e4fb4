"""The simulated workers' own view of a benchmark run: counters scraped before and after.

From each worker's ``/metrics`` (SGLang families, summed over label sets):
``sglang:prompt_tokens_total`` (every prompt token, cached ones included, as SGLang
counts them), ``sglang:cached_tokens_total`` and ``sglang:num_requests_total``; from
``/v1/loads`` the cumulative ``total_prefill_busy_us`` (modelled time spent in prefill).
``flush_cache`` empties every worker's radix cache, retrying while requests still run
(SGLang refuses to flush then).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from loadtests.engine.probe import parse_prometheus

PROMPT = "sglang:prompt_tokens_total"
CACHED = "sglang:cached_tokens_total"
REQUESTS = "sglang:num_requests_total"


def family_sum(samples: dict[str, float], family: str) -> float:
    """Sum of a family's samples over all label sets (0 when absent)."""
    return sum(v for k, v in samples.items() if k == family or k.startswith(family + "{"))


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    prompt_tokens: float
    cached_tokens: float
    requests: float
    prefill_busy_s: float


@dataclass(frozen=True, slots=True)
class WorkerDelta:
    """One worker's share of a run."""

    url: str
    prompt_tokens: float
    cached_tokens: float
    requests: float
    prefill_busy_s: float


async def read_worker(session: aiohttp.ClientSession, url: str) -> WorkerCounters:
    async with session.get(url + "/metrics", raise_for_status=True) as resp:
        samples = parse_prometheus(await resp.text())
    async with session.get(url + "/v1/loads", raise_for_status=True) as resp:
        loads = await resp.json()
    busy_us = sum(float(e.get("total_prefill_busy_us") or 0) for e in loads.get("loads", []))
    return WorkerCounters(
        prompt_tokens=family_sum(samples, PROMPT),
        cached_tokens=family_sum(samples, CACHED),
        requests=family_sum(samples, REQUESTS),
        prefill_busy_s=busy_us / 1e6,
    )


async def read_all(urls: Sequence[str]) -> list[WorkerCounters]:
    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(read_worker(session, u) for u in urls)))


def deltas(
    urls: Sequence[str], before: Sequence[WorkerCounters], after: Sequence[WorkerCounters]
) -> list[WorkerDelta]:
    return [
        WorkerDelta(
            url=u,
            prompt_tokens=a.prompt_tokens - b.prompt_tokens,
            cached_tokens=a.cached_tokens - b.cached_tokens,
            requests=a.requests - b.requests,
            prefill_busy_s=a.prefill_busy_s - b.prefill_busy_s,
        )
        for u, b, a in zip(urls, before, after, strict=True)
    ]


async def flush_all(urls: Sequence[str], timeout_s: float = 60.0) -> None:
    """``POST /flush_cache`` on every worker until each accepts (200)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        pending = list(urls)
        while pending:
            still = []
            for url in pending:
                async with session.post(url + "/flush_cache") as resp:
                    await resp.read()
                    if resp.status != 200:
                        still.append(url)
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers kept refusing /flush_cache: {pending}")
                await asyncio.sleep(0.25)


RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"


async def sample_busy(urls: Sequence[str], stop: asyncio.Event, interval_s: float) -> list[float]:
    """Per worker, the fraction of samples (every ``interval_s`` until ``stop``) in which
    its ``/metrics`` showed a running or queued request: its busy fraction over the run.

    The gauges are the simulator's lagged snapshot (refreshed at every prefill step, at
    idle and every few decode steps), so this is an estimate.
    """
    busy = [0] * len(urls)
    samples = 0

    async def one(session: aiohttp.ClientSession, url: str) -> bool:
        try:
            async with session.get(url + "/metrics") as resp:
                s = parse_prometheus(await resp.text())
        except (aiohttp.ClientError, OSError):
            return False
        return family_sum(s, RUNNING) + family_sum(s, QUEUED) > 0

    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            flags = await asyncio.gather(*(one(session, u) for u in urls))
            samples += 1
            for i, flag in enumerate(flags):
                busy[i] += flag
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    return [b / samples if samples else 0.0 for b in busy]
