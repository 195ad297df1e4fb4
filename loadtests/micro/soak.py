"""Soak: steady mixed load through one gateway process, workers removed and added back
through the admin API, with the gateway's RSS, open descriptors, prefix index size and
errors sampled over time (a benchmark, not a CI test).

Simulated workers run in one process and the gateway in another, on loopback. ``--clients``
closed-loop clients send chat requests (half streaming) from a pool of shared-prefix
conversations with growing turns; every ``--churn-s`` one worker is deleted and re-added.
Every ``--sample-s`` a line is printed; the run stops by itself after ``--duration-s``.

    python -m loadtests.micro.soak --duration-s 180
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import quote

import aiohttp

from loadtests.harness.procs import open_fds, rss_mib
from loadtests.micro.connections import fleet_and_gateway, wait_ready


@dataclass
class Totals:
    done: int = 0
    errors: Counter[str] = field(default_factory=Counter)


async def client_loop(
    session: aiohttp.ClientSession, base: str, rng: random.Random, stop: float, totals: Totals
) -> None:
    while time.monotonic() < stop:
        system = f"You are assistant {rng.randrange(50)}. " * 20
        turns = [
            {"role": "user", "content": f"question {i} " * 10} for i in range(rng.randint(1, 6))
        ]
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": system}, *turns],
            "max_tokens": rng.randint(4, 40),
            "stream": rng.random() < 0.5,
        }
        try:
            async with session.post(base + "/v1/chat/completions", json=body) as resp:
                data = await resp.read()
                if resp.status != 200:
                    totals.errors[f"status {resp.status}"] += 1
                elif b'"error"' in data:
                    totals.errors["error event"] += 1
                else:
                    totals.done += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            totals.errors[type(exc).__name__] += 1


async def churn(
    session: aiohttp.ClientSession, base: str, workers: list[str], every_s: float, stop: float
) -> None:
    i = 0
    while time.monotonic() + every_s < stop:
        await asyncio.sleep(every_s)
        url = workers[i % len(workers)]
        async with session.delete(base + "/workers/" + quote(url, safe="")) as r:
            await r.read()
        await asyncio.sleep(every_s / 4)
        async with session.post(base + "/workers", json={"url": url}) as r:
            await r.read()
        i += 1


async def index_blocks(session: aiohttp.ClientSession, base: str) -> int:
    async with session.get(base + "/debug/index") as r:
        doc = await r.json()
    return sum(int(w.get("blocks", 0)) for w in doc.get("workers", []))


async def measure(args: argparse.Namespace, gw_pid: int, workers: list[str], base: str) -> int:
    for url in workers:
        await wait_ready(url + "/health", 30)
    await wait_ready(base + "/readiness", 30)
    totals = Totals()
    stop = time.monotonic() + args.duration_s
    rng = random.Random(1)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [
            asyncio.create_task(
                client_loop(session, base, random.Random(rng.random()), stop, totals)
            )
            for _ in range(args.clients)
        ]
        tasks.append(asyncio.create_task(churn(session, base, workers, args.churn_s, stop)))
        print("t_s   requests  errors  rss_mib  fds  index_blocks")
        t0 = time.monotonic()
        while time.monotonic() < stop:
            await asyncio.sleep(args.sample_s)
            blocks = await index_blocks(session, base)
            print(
                f"{time.monotonic() - t0:5.0f} {totals.done:9d} {sum(totals.errors.values()):7d}"
                f" {rss_mib(gw_pid):8.1f} {open_fds(gw_pid):4d} {blocks:13d}",
                flush=True,
            )
        await asyncio.gather(*tasks)
    print(f"total: {totals.done} requests, errors {dict(totals.errors) or 0}")
    return 0 if not totals.errors else 1


def run(args: argparse.Namespace) -> int:
    gateway_args = ["--policy", "min_ttft", "--health-check-endpoint", "/ping"]
    with fleet_and_gateway(args.workers, 20.0, gateway_args) as (pid, workers, gport):
        return asyncio.run(measure(args, pid, workers, f"http://127.0.0.1:{gport}"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--churn-s", type=float, default=20.0, help="remove/re-add a worker every")
    p.add_argument("--sample-s", type=float, default=10.0)
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
