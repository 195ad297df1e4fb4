"""How long exact mode's tokenization holds the gateway's event loop (docs/KV_EVENTS.md).

Run: ``.venv/bin/python tests/hostile/exact_loop_probe.py [--mib 0.9] [--small 300]``.

Two simulated SGLang workers publish KV events from a subprocess (their own tokenization
must not share this process's GIL); an in-process gateway (``run_gateway``) follows them
with a real dense BPE tokenizer (``write_tokenizer``: ~1.2 bytes per token) and routes
by prefix. A ticker task sleeps 1 ms at a time and records its largest gap:

* while one chat request of ``--mib`` MiB of varied text is routed (and tokenized);
* per request for ``--small`` sequential small chat requests (~1 KiB), the mean latency.

It also times the gateway's tokenization of the small body alone (``request_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.exact.request import request_tokens  # noqa: E402
from gateway.exact.tokenizer import HFTokenizer  # noqa: E402
from loadtests.engine.sglang_model import write_tokenizer  # noqa: E402
from loadtests.harness.inprocess import run_gateway  # noqa: E402

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
)
WORDS = ("the", "of", "cache", "prefix", "worker", "token", "gateway", "route", "event", "page")


def varied_text(n_bytes: int, seed: int = 1) -> str:
    """Text of about ``n_bytes`` that BPE's word cache cannot shortcut: random words
    with random numbers and accents."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = f"{rng.choice(WORDS)}{rng.randrange(100000)}{rng.choice(('', 'é', ',', '.'))}"
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_bytes]


def chat_body(text: str) -> bytes:
    return orjson.dumps({
        "model": "sim", "max_tokens": 1,
        "messages": [{"role": "user", "content": text}],
    })  # fmt: skip


class Ticker:
    """A task sleeping ``period_s`` at a time; ``max_gap_s`` is its largest wake-up gap."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s, self.max_gap_s, self.ticks = period_s, 0.0, 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.ticks += 1
            self.max_gap_s = max(self.max_gap_s, time.perf_counter() - t)

    def reset(self) -> None:
        self.max_gap_s, self.ticks = 0.0, 0

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def fleet_process(workers: int = 2) -> AsyncIterator[list[str]]:
    """Simulated workers in a subprocess (fast, KV events on); their URLs."""
    args = ["--workers", str(workers), "--base-port", "0", "--speed", "50",
            "--page-size", "16", "--context-length", "4000000",
            "--kv-events-config", KV_CONFIG]  # fmt: skip
    with tempfile.TemporaryFile() as errors:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "simulator", *args,
            cwd=ROOT, stdout=subprocess.PIPE, stderr=errors,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            urls = [(await proc.stdout.readline()).decode().strip() for _ in range(workers)]
            if not all(urls):
                errors.seek(0)
                raise RuntimeError(f"the simulator did not start: {errors.read()[-2000:]!r}")
            yield urls
        finally:
            if proc.returncode is None:
                proc.terminate()
            await proc.wait()


async def _until(cond: Callable[[], Any], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError("workers never reached exact mode")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def exact_gateway(model_dir: Path) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """Two simulated workers (``fleet_process``) behind an in-process gateway that follows
    them in exact mode with the ``hf:`` tokenizer of ``model_dir``; yields its chat URL
    and a client session once both workers are ``exact``."""
    async with (
        fleet_process() as urls,
        run_gateway(
            urls,
            ready_within_s=10.0,
            policy__name="cache_aware",
            kv_events__tokenizer=f"hf:{model_dir}",
            kv_events__discovery_interval_s=0.1,
        ) as gw,
        aiohttp.ClientSession(headers={"content-type": "application/json"}) as s,
    ):

        async def all_exact() -> bool:
            async with s.get(f"{gw.url}/workers") as resp:
                workers = (await resp.json())["workers"]
            return len(workers) == len(urls) and all(
                w.get("index_mode") == "exact" for w in workers
            )

        await _until(all_exact)
        yield f"{gw.url}/v1/chat/completions", s


async def probe(model_dir: Path, mib: float, small: int) -> dict[str, float]:
    big = chat_body(varied_text(int(mib * (1 << 20))))
    little = chat_body(varied_text(1000, seed=2))
    async with exact_gateway(model_dir) as (url, s):
        out: dict[str, float] = {}
        async with Ticker() as ticker:
            for _ in range(20):  # warm up
                async with s.post(url, data=little) as resp:
                    await resp.read()
            ticker.reset()
            t = time.perf_counter()
            async with s.post(url, data=big) as resp:
                await resp.read()
                out["big_status"] = resp.status
            out["big_request_s"] = time.perf_counter() - t
            out["big_max_tick_ms"] = ticker.max_gap_s * 1e3
            ticker.reset()
            latencies = []
            for _ in range(small):
                t = time.perf_counter()
                async with s.post(url, data=little) as resp:
                    await resp.read()
                latencies.append(time.perf_counter() - t)
            out["small_mean_ms"] = statistics.fmean(latencies) * 1e3
            out["small_median_ms"] = statistics.median(latencies) * 1e3
            out["small_max_tick_ms"] = ticker.max_gap_s * 1e3
    tok = HFTokenizer(str(model_dir))
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        request_tokens("chat", little, tok)
    out["small_tokenize_us"] = (time.perf_counter() - t) / n * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=0.9, help="the large body, MiB")
    parser.add_argument("--small", type=int, default=300, help="small requests to time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp))
        result = asyncio.run(probe(Path(tmp), args.mib, args.small))
    for key, value in result.items():
        print(f"{key:20} {value:10.2f}")


if __name__ == "__main__":
    main()
