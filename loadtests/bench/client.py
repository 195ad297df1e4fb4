"""The live benchmark's load generator: an open-loop asyncio replay of a workload.

Each request is sent at its arrival time (seconds after the start, already scaled to wall
time by the caller), whatever happened to earlier ones; nothing is sent after
``max_send_s``, and every request is bounded by ``timeout_s``. Requests are streamed
OpenAI chat completions with usage; TTFT is the time to the first ``data:`` event.
Bodies are serialised before the clock starts, so rendering long trace prompts never
delays a send.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from loadtests.locust.stats import parse_sse_usage

SHED_STATUSES = frozenset({429, 503})


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request of a replay."""

    index: int
    sent_s: float  # after the replay's start
    status: int  # 0: connection error or timeout
    ok: bool  # 200 and a usage chunk
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker: str | None = None  # x-gateway-worker, when the router sets it
    error: str = ""

    @property
    def shed(self) -> bool:
        """Refused by admission control (429/503) rather than failed."""
        return self.status in SHED_STATUSES


@dataclass(frozen=True, slots=True)
class ReplayItem:
    """What to send and when."""

    index: int
    at_s: float
    body: bytes


async def send_one(
    session: aiohttp.ClientSession, url: str, item: ReplayItem, t0: float, timeout_s: float
) -> Outcome:
    """POST one streamed chat request; never raises for HTTP or connection errors."""
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, object] | None = None
    status = 0
    worker: str | None = None
    error = ""
    try:
        async with session.post(
            url + "/v1/chat/completions",
            data=item.body,
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            status = resp.status
            worker = resp.headers.get("x-gateway-worker")
            if status != 200:
                error = (await resp.text())[:200]
            else:
                async for line in resp.content:
                    is_event, found = parse_sse_usage(line)
                    if is_event and ttft is None:
                        ttft = time.perf_counter() - start
                    if found is not None:
                        usage = found
                if usage is None:
                    error = "stream ended without a usage chunk"
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        status = 0 if status == 200 else status
    latency = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") if usage else None
    return Outcome(
        index=item.index,
        sent_s=start - t0,
        status=status,
        ok=status == 200 and usage is not None and not error,
        ttft_s=ttft,
        latency_s=latency,
        prompt_tokens=int(str(usage.get("prompt_tokens") or 0)) if usage else 0,
        cached_tokens=int(str(details.get("cached_tokens") or 0))
        if isinstance(details, dict)
        else 0,
        completion_tokens=int(str(usage.get("completion_tokens") or 0)) if usage else 0,
        worker=worker,
        error=error,
    )


async def replay(
    items: Sequence[ReplayItem],
    target: Callable[[int], str],
    max_send_s: float,
    timeout_s: float,
) -> tuple[list[Outcome], float]:
    """Send ``items`` open loop to ``target(i)`` (a base URL); return outcomes and the
    wall time from the start to the last completion."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[Outcome]] = []
        for n, item in enumerate(items):
            if item.at_s > max_send_s:
                break
            delay = t0 + item.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_one(session, target(n), item, t0, timeout_s)))
        outcomes = list(await asyncio.gather(*tasks))
        return outcomes, time.perf_counter() - t0
