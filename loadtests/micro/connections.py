"""Many concurrent streaming clients through one gateway process (a benchmark, not a test).

Starts simulated workers (one process) and the gateway (another process) on loopback,
then opens ``--clients`` streaming chat requests at once from this process and holds
them: each stream lasts several seconds, so all are open together. Reports how many
streams were open at the same time (every one had its first event before any ended),
errors by kind, the gateway's CPU seconds (from /proc) per relayed chunk, and its RSS
and open descriptors at the peak. Everything is bounded: one round, a hard timeout.

    python -m loadtests.micro.connections --clients 2000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp

from loadtests.harness.ports import free_port, free_port_range
from loadtests.harness.procs import cpu_seconds, open_fds, rss_mib, running, wait_http


@dataclass
class Tally:
    first_events: int = 0
    finished: int = 0
    chunks: int = 0
    peak_open: int = 0
    open_now: int = 0
    errors: Counter[str] = field(default_factory=Counter)


async def wait_ready(url: str, timeout_s: float) -> None:
    """Wait until ``GET url`` answers 200; RuntimeError after ``timeout_s``."""
    if not await wait_http(url, timeout_s):
        raise RuntimeError(f"{url} not ready")


async def one_stream(
    session: aiohttp.ClientSession, url: str, tokens: int, tally: Tally, all_open: asyncio.Event
) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hold the line"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    counted = False
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                tally.errors[f"status {resp.status}"] += 1
                return
            async for chunk in resp.content.iter_any():
                if not counted:
                    counted = True
                    tally.first_events += 1
                    tally.open_now += 1
                    tally.peak_open = max(tally.peak_open, tally.open_now)
                tally.chunks += chunk.count(b"data: ")
            tally.finished += 1
            if b'"error"' in chunk:
                tally.errors["error event"] += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.errors[type(exc).__name__] += 1
    finally:
        if counted:
            tally.open_now -= 1


async def measure(args: argparse.Namespace, gw_pid: int, workers: list[str], gport: int) -> int:
    for url in workers:
        await wait_ready(url + "/health", 30)
    await wait_ready(f"http://127.0.0.1:{gport}/readiness", 30)
    tally = Tally()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    cpu0 = cpu_seconds(gw_pid)
    started = time.monotonic()
    peak_rss = peak_fds = 0.0
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        url = f"http://127.0.0.1:{gport}/v1/chat/completions"
        all_open = asyncio.Event()
        tasks = [
            asyncio.create_task(one_stream(session, url, args.tokens, tally, all_open))
            for _ in range(args.clients)
        ]
        while not all(t.done() for t in tasks):
            peak_rss = max(peak_rss, rss_mib(gw_pid))
            peak_fds = max(peak_fds, open_fds(gw_pid))
            await asyncio.sleep(0.25)
    elapsed = time.monotonic() - started
    cpu = cpu_seconds(gw_pid) - cpu0
    print(f"clients {args.clients}: peak open streams {tally.peak_open}, "
          f"finished {tally.finished}, errors {dict(tally.errors) or 0}")  # fmt: skip
    print(f"chunks relayed {tally.chunks} in {elapsed:.1f} s; gateway CPU {cpu:.2f} s = "
          f"{1e6 * cpu / max(1, tally.chunks):.1f} us per chunk")  # fmt: skip
    print(f"gateway peak RSS {peak_rss:.0f} MiB, peak open fds {peak_fds:.0f}")
    return 0 if not tally.errors and tally.finished == args.clients else 1


@contextlib.contextmanager
def fleet_and_gateway(
    workers: int, speed: float, gateway_args: Sequence[str]
) -> Iterator[tuple[int, list[str], int]]:
    """Simulated workers in one process and the gateway in another, on loopback; yields
    (gateway pid, worker URLs, gateway port) and stops both by PID."""
    wport, gport = free_port_range(workers), free_port()
    urls = [f"http://127.0.0.1:{wport + i}" for i in range(workers)]
    with (
        running(
            [sys.executable, "-m", "simulator", "--workers", str(workers), "--base-port",
             str(wport), "--speed", str(speed)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, grace_s=10.0,
        ),
        running(
            [sys.executable, "-m", "gateway", "--port", str(gport), "--log-level", "warning",
             *gateway_args, "--worker-urls", *urls],
            stdout=subprocess.DEVNULL, grace_s=10.0,
        ) as gw,
    ):  # fmt: skip
        yield gw.pid, urls, gport


def run(args: argparse.Namespace) -> int:
    with fleet_and_gateway(args.workers, args.speed, ["--policy", "least_load"]) as (
        pid,
        workers,
        gport,
    ):
        return asyncio.run(measure(args, pid, workers, gport))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=2000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=60, help="tokens per stream (default 60)")
    p.add_argument("--speed", type=float, default=0.5, help="simulator speed (default 0.5)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
