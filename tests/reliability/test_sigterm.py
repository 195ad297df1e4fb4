"""Gateway SIGTERM with streams in flight, the gateway run as a real process: it stops
accepting connections at once, lets the in-flight streams finish (no error event, each
ends with [DONE]) within its grace period, then exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from loadtests.harness.ports import free_port
from simulator.fleet import SimConfig, SimulatedFleet

# At speed 1 the simulated worker decodes ~150 tokens/s: a stream of 2-3 s.
STREAM = {
    "model": "m",
    "messages": [{"role": "user", "content": "Tell me a story"}],
    "max_tokens": 300,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture
async def slow_fleet() -> AsyncIterator[SimulatedFleet]:
    async with await SimulatedFleet.start(2, SimConfig(speed=1.0)) as f:
        yield f


async def _start_gateway(urls: list[str], port: int, *extra: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--health-check-endpoint",
        "/ping",
        "--log-level",
        "warning",
        *extra,
        "--worker-urls",
        *urls,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    deadline = time.monotonic() + 20
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(f"http://127.0.0.1:{port}/readiness") as r:
                    if r.status == 200:
                        return proc
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline or proc.returncode is not None:
                proc.kill()
                raise AssertionError("the gateway did not become ready")
            await asyncio.sleep(0.1)


async def _stream(session: aiohttp.ClientSession, url: str, started: asyncio.Event) -> bytes:
    async with session.post(url, json=STREAM) as resp:
        assert resp.status == 200
        first = await resp.content.readany()
        started.set()
        return first + await resp.read()


async def test_sigterm_drains_streams_then_exits_zero(slow_fleet: SimulatedFleet) -> None:
    port = free_port()
    proc = await _start_gateway(slow_fleet.urls, port)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with aiohttp.ClientSession() as session:
            events = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(_stream(session, url, e)) for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 10)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with aiohttp.ClientSession() as fresh:  # a new connection is refused
                with pytest.raises(aiohttp.ClientConnectionError):
                    async with fresh.post(url, json=STREAM) as resp:
                        await resp.read()
            bodies = await asyncio.wait_for(asyncio.gather(*streams), 20)
        for body in bodies:
            assert body.endswith(b"data: [DONE]\n\n")
            assert b'"error"' not in body
        code = await asyncio.wait_for(proc.wait(), 20)
        assert code == 0, (await proc.stderr.read()).decode() if proc.stderr else ""
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()


async def test_sigterm_grace_period_bounds_the_exit(slow_fleet: SimulatedFleet) -> None:
    """A stream longer than the grace period is cut when it ends; the exit is still 0."""
    port = free_port()
    proc = await _start_gateway(slow_fleet.urls, port, "--shutdown-grace-secs", "1")
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with aiohttp.ClientSession() as session:
            started = asyncio.Event()
            long_stream = {**STREAM, "max_tokens": 5000}  # ~30 s at speed 1
            task = asyncio.create_task(_stream_any(session, url, long_stream, started))
            await asyncio.wait_for(started.wait(), 10)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 15)
            exit_s = time.monotonic() - signalled
            body = await asyncio.wait_for(task, 10)
        assert code == 0
        assert exit_s < 6.0, f"exit took {exit_s:.1f} s with a 1 s grace"
        assert not body.endswith(b"data: [DONE]\n\n")  # cut, not finished
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()


async def _stream_any(
    session: aiohttp.ClientSession, url: str, payload: dict[str, object], started: asyncio.Event
) -> bytes:
    got = b""
    try:
        async with session.post(url, json=payload) as resp:
            async for chunk in resp.content.iter_any():
                got += chunk
                started.set()
    except aiohttp.ClientError:
        pass
    return got
