"""A minimal streaming OpenAI chat client that records what an engine reports.

TTFT is the time to the first ``data:`` event of the stream: llama.cpp sends its first
chunk (the assistant role, with the first token) only after prefill, and the random
model may emit end-of-sequence first, so a first *content* token may never come.

Connection reuse: llama.cpp's server answers ``Keep-Alive`` but closes the connection
right after a *streamed* response; a request sent at once on that pooled connection
fails with ``ClientOSError: Can not write request body``. Talk to llama.cpp workers
through :func:`engine_session`, which opens a connection per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


def engine_session(limit: int = 100) -> aiohttp.ClientSession:
    """A client session without keep-alive (see the module docstring for why)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=limit))


@dataclass(frozen=True, slots=True)
class ChatResult:
    """The outcome of one streamed chat completion."""

    ok: bool
    status: int
    ttft_s: float | None  # first data event; None if none came
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    cache_n: int | None = None  # timings.cache_n, llama.cpp only
    error: str = ""


@dataclass(slots=True)
class _StreamState:
    ttft_s: float | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None


def _absorb(state: _StreamState, event: dict[str, Any], elapsed_s: float) -> None:
    if state.ttft_s is None:
        state.ttft_s = elapsed_s
    if event.get("usage"):
        state.usage = event["usage"]
    if event.get("timings"):
        state.timings = event["timings"]


def _result(state: _StreamState, status: int, latency_s: float) -> ChatResult:
    usage = state.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    timings = state.timings or {}
    return ChatResult(
        ok=state.usage is not None,
        status=status,
        ttft_s=state.ttft_s,
        latency_s=latency_s,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens", 0)),
        cache_n=int(timings["cache_n"]) if "cache_n" in timings else None,
        error="" if state.usage is not None else "stream ended without a usage chunk",
    )


async def stream_chat(
    session: aiohttp.ClientSession, base_url: str, body: dict[str, Any], timeout_s: float = 120.0
) -> ChatResult:
    """POST ``body`` to ``{base_url}/v1/chat/completions`` streamed, with usage requested.

    Never raises for HTTP or connection errors: they come back as ``ok=False``.
    """
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    state = _StreamState()
    start = time.perf_counter()
    try:
        async with session.post(
            base_url + "/v1/chat/completions",
            data=orjson.dumps(payload),
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            if response.status != 200:
                text = (await response.text())[:200]
                elapsed = time.perf_counter() - start
                return ChatResult(False, response.status, None, elapsed, error=text)
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                _absorb(state, orjson.loads(data), time.perf_counter() - start)
            return _result(state, response.status, time.perf_counter() - start)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        elapsed = time.perf_counter() - start
        return ChatResult(False, 0, state.ttft_s, elapsed, error=f"{type(exc).__name__}: {exc}")


async def run_clients(
    session: aiohttp.ClientSession,
    jobs: Sequence[tuple[str, dict[str, Any]]],
    concurrency: int,
    timeout_s: float = 120.0,
) -> list[ChatResult]:
    """Send each ``(base_url, body)`` job, in order, from ``concurrency`` closed-loop clients.

    Results come back in job order.
    """
    results: list[ChatResult | None] = [None] * len(jobs)
    queue = iter(range(len(jobs)))

    async def client() -> None:
        for i in queue:  # shared iterator: each index is taken by exactly one client
            url, body = jobs[i]
            results[i] = await stream_chat(session, url, body, timeout_s)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return [r for r in results if r is not None]


async def run_chains(
    session: aiohttp.ClientSession,
    jobs: Sequence[tuple[str, dict[str, Any]]],
    chains: Sequence[int],
    concurrency: int,
    timeout_s: float = 120.0,
) -> list[ChatResult]:
    """As :func:`run_clients`, but jobs of one chain (``chains[i]``) go in order and never
    two at once: a free client takes the first pending job whose chain has none in
    flight, else waits for one to end. Results come back in job order."""
    results: list[ChatResult | None] = [None] * len(jobs)
    pending = list(range(len(jobs)))
    busy: set[int] = set()
    changed = asyncio.Condition()

    async def client() -> None:
        while True:
            async with changed:
                while True:
                    if not pending:
                        return
                    pick = next((i for i in pending if chains[i] not in busy), None)
                    if pick is not None:
                        break
                    await changed.wait()
                pending.remove(pick)
                busy.add(chains[pick])
            url, body = jobs[pick]
            results[pick] = await stream_chat(session, url, body, timeout_s)
            async with changed:
                busy.discard(chains[pick])
                changed.notify_all()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return [r for r in results if r is not None]
