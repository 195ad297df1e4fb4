"""Benchmark of the simulated worker: HTTP requests/s of one process, radix cache cost.

    python -m loadtests.micro.simulator                     # both parts, defaults below
    python -m loadtests.micro.simulator --part radix
    python -m loadtests.micro.simulator --part http --workers 8 --speed 1 --duration 10

HTTP part: starts ``python -m simulator`` as a subprocess (one process, ``--workers``
workers), then drives it from this process with an aiohttp client (uvloop) at a fixed
concurrency, round-robin over the workers, with short non-streaming requests (a
one-sentence chat prompt, ``max_tokens`` 8 by default). With ``--speed 100`` the modelled
GPU time is negligible and the figure is the simulator's own capacity; with ``--speed 1``
the modelled batches bound it as they would on a real worker.

Radix part: match + insert of a 32,000-token prompt into a 420k-token cache that is full
(so inserts evict), prompts sharing a 24k-token prefix with an 8k unique suffix; the key
conversion from a token list is timed separately.

Targets (issue 2): ≥ 1,000 requests/s from one process, ≤ 1 ms per 32k match + insert.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp

from loadtests.harness.ports import free_port_range
from loadtests.harness.procs import cpu_seconds, running
from loadtests.harness.stats import percentile
from simulator.model.radix_cache import RadixCache, encode_tokens


# ---------------------------------------------------------------------- radix cache
@dataclass
class RadixResult:
    median_us: float
    p99_us: float
    encode_median_us: float
    evicted_tokens: int


def bench_radix(iterations: int = 300, seed: int = 0) -> RadixResult:
    rng = random.Random(seed)
    cache = RadixCache(420_000)
    shared = [rng.randrange(150_000) for _ in range(24_000)]
    for _ in range(14):  # fill past capacity with unrelated 32k prompts
        cache.insert(encode_tokens([rng.randrange(150_000) for _ in range(32_000)]))
    lists = [shared + [rng.randrange(150_000) for _ in range(8_000)] for _ in range(iterations)]
    keys = [encode_tokens(tokens) for tokens in lists]
    times = []
    for key in keys:
        start = time.perf_counter()
        cache.match_prefix(key)
        cache.insert(key)
        times.append(time.perf_counter() - start)
    encode_times = []
    for tokens in lists[:100]:
        start = time.perf_counter()
        encode_tokens(tokens)
        encode_times.append(time.perf_counter() - start)
    cache.check_invariants()
    times.sort()
    return RadixResult(
        median_us=statistics.median(times) * 1e6,
        p99_us=percentile(times, 99, "lower") * 1e6,
        encode_median_us=statistics.median(encode_times) * 1e6,
        evicted_tokens=cache.evicted_total,
    )


# ---------------------------------------------------------------------- HTTP
@dataclass
class HttpResult:
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    server_cpu_s: float | None = None  # CPU time of the simulator process in the window
    client_cpu_s: float | None = None  # CPU time of this (client) process in the window

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def rps_per_cpu_second(self) -> float | None:
        """Requests per CPU-second of the simulator: its capacity on one free core."""
        if not self.server_cpu_s:
            return None
        return self.requests / self.server_cpu_s


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (Linux /proc; None elsewhere)."""
    try:
        return cpu_seconds(pid)
    except OSError:
        return None


@contextlib.contextmanager
def simulator_process(workers: int, speed: float) -> Iterator[tuple[list[str], int]]:
    base = free_port_range(workers)
    cmd = [
        sys.executable, "-m", "simulator", "--workers", str(workers), "--base-port", str(base),
        "--speed", str(speed), "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip
    with running(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, grace_s=10.0) as proc:
        assert proc.stdout is not None
        urls = [proc.stdout.readline().decode().strip() for _ in range(workers)]
        yield urls, proc.pid


async def drive(
    urls: list[str],
    endpoint: str,
    concurrency: int,
    duration: float,
    warmup: float,
    tokens: int,
    server_pid: int | None = None,
) -> HttpResult:
    body = request_body(endpoint, tokens)
    paths = {
        "chat": "/v1/chat/completions",
        "completions": "/v1/completions",
        "generate": "/generate",
    }
    targets = [url + paths[endpoint] for url in urls]
    latencies: list[float] = []
    errors = 0
    counting = False
    stop_at = 0.0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(i: int) -> None:
            nonlocal errors
            n = i
            while True:
                now = time.perf_counter()
                if counting and now >= stop_at:
                    return
                target = targets[n % len(targets)]
                n += concurrency
                start = time.perf_counter()
                async with session.post(target, json=body) as resp:
                    await resp.read()
                    ok = resp.status == 200
                if counting:
                    if ok:
                        latencies.append(time.perf_counter() - start)
                    else:
                        errors += 1

        tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        await asyncio.sleep(warmup)
        counting = True
        cpu_before = process_cpu_seconds(server_pid) if server_pid else None
        client_cpu_before = time.process_time()
        begin = time.perf_counter()
        stop_at = begin + duration
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - begin
        cpu_after = process_cpu_seconds(server_pid) if server_pid else None
        client_cpu = time.process_time() - client_cpu_before
    latencies.sort()
    return HttpResult(
        requests=len(latencies),
        errors=errors,
        seconds=seconds,
        p50_ms=percentile(latencies, 50, "upper") * 1e3 if latencies else 0.0,
        p99_ms=percentile(latencies, 99, "lower") * 1e3 if latencies else 0.0,
        server_cpu_s=(
            cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
        ),
        client_cpu_s=client_cpu,
    )


def request_body(endpoint: str, tokens: int) -> dict[str, object]:
    prompt = "Write one sentence about the sea."
    if endpoint == "chat":
        return {
            "model": "m",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
        }
    if endpoint == "completions":
        return {"model": "m", "prompt": prompt, "max_tokens": tokens}
    return {"text": prompt, "sampling_params": {"max_new_tokens": tokens}}


def run_http(args: argparse.Namespace) -> list[HttpResult]:
    """``args.rounds`` measured windows against one simulator process."""

    async def rounds(urls: list[str], pid: int) -> list[HttpResult]:
        results = []
        for i in range(args.rounds):
            warmup = args.warmup if i == 0 else 0.5
            results.append(
                await drive(
                    urls, args.endpoint, args.concurrency, args.duration, warmup, args.tokens, pid
                )
            )
        return results

    with simulator_process(args.workers, args.speed) as (urls, pid):
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            return asyncio.run(rounds(urls, pid))
        return uvloop.run(rounds(urls, pid))


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "n/a"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.micro.simulator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--part", choices=["all", "radix", "http"], default="all")
    parser.add_argument("--workers", type=int, default=1, help="workers in the one process")
    parser.add_argument("--speed", type=float, default=100.0, help="simulator --speed")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per round")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (median)")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens per request")
    parser.add_argument("--endpoint", choices=["chat", "completions", "generate"], default="chat")
    args = parser.parse_args(argv)
    if args.part in ("all", "radix"):
        r = bench_radix()
        print(
            f"radix: match+insert of a 32,000-token prompt (24k shared, 8k new, full 420k "
            f"cache, evicting): median {r.median_us:.0f} us, p99 {r.p99_us:.0f} us; "
            f"list->key conversion median {r.encode_median_us:.0f} us; "
            f"{r.evicted_tokens} tokens evicted"
        )
    if args.part in ("all", "http"):
        results = run_http(args)
        for i, h in enumerate(results):
            per_cpu = h.rps_per_cpu_second
            per_cpu_text = f"{per_cpu:.0f}" if per_cpu is not None else "n/a"
            print(
                f"http round {i + 1}: {h.rps:.0f} requests/s ({h.requests} in {h.seconds:.1f} s, "
                f"{h.errors} errors), p50 {h.p50_ms:.1f} ms, p99 {h.p99_ms:.1f} ms; "
                f"simulator {per_cpu_text} requests per CPU-second, client "
                f"{h.client_cpu_s or 0:.2f} CPU-s"
            )
        rps = statistics.median(h.rps for h in results)
        per_cpu_values = [h.rps_per_cpu_second for h in results if h.rps_per_cpu_second]
        per_cpu_median = statistics.median(per_cpu_values) if per_cpu_values else float("nan")
        print(
            f"http median of {len(results)} rounds: {rps:.0f} requests/s wall, "
            f"{per_cpu_median:.0f} requests per simulator CPU-second "
            f"({1e6 / per_cpu_median:.0f} us CPU per request); {args.endpoint}, max_tokens "
            f"{args.tokens}, concurrency {args.concurrency}, {args.workers} worker(s) in one "
            f"process, speed x{args.speed:g}; cpus={os.cpu_count()}, load average "
            f"{load_average()}"
        )


if __name__ == "__main__":
    main()
