"""Several gateways in front of one fleet: with shared state on Redis, and without.

    python -m loadtests.bench.multi_gateway [--workers 8] [--speed 20] [--policy min_ttft]
        [--redis-url redis://127.0.0.1:6379/0] [--workloads shared_prefix multi_turn]
        [--time-scale 1] [--json PATH]

Everything runs in one process on 127.0.0.1: a :class:`~simulator.fleet.SimulatedFleet` of
``--workers`` simulated SGLang workers and, per setup, in-process gateways
(``loadtests.harness.inprocess.run_gateway``). The client sends each workload's requests at their
arrival times (compressed ``--time-scale``-fold), streaming with usage, spreading them
over the setup's gateways round robin. Setups:

- ``1 gateway``;
- ``3 gateways + Redis`` (same ``--redis-url``, a fresh random ``--redis-prefix``);
- ``3 gateways, no Redis`` (each with its own prefix index and load counts).

Per run: cached-token fraction (the workers' reported ``cached_tokens`` / prompt tokens),
TTFT p50/p99 (client side, send to first streamed chunk), the disagreement rate and, with
Redis, the replication lag p50/p99 (every gateway's applied stream entries).

Disagreement: the client keeps a union prefix index (the gateway's own ``PrefixIndex``
and request parser) of every routing decision, in the order responses began. A request
disagrees when some worker held a longer prefix of it in the union than the chosen one:
one gateway seeing every record would have known better. The single gateway's rate is the
policy's own (it trades prefix for load); the excess over it is the cost of split state.
The fleet is restarted between runs so every run starts with cold caches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway.peers.adapters import SHARED_STATE
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RequestSettings, parse_request
from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import GatewayHandle, run_gateway
from loadtests.harness.redis import delete_prefix, redis_answers
from loadtests.harness.stats import percentile
from loadtests.workloads import Workload, WorkloadRequest, create_workload
from simulator.fleet import SimConfig, SimulatedFleet

WORKLOAD_ARGS: dict[str, list[str]] = {
    "shared_prefix": [
        "num_groups=24", "prompts_per_group=12", "system_prompt_len=2048",
        "question_len=128", "output_len=32", "request_rate=30",
    ],
    "multi_turn": [
        "sessions=48", "turns=5", "system_prompt_len=512", "user_len=256",
        "answer_len=64", "think_time_s=4", "session_rate=4",
    ],
}  # fmt: skip
WORKLOAD_NAMES = {"shared_prefix": "generated-shared-prefix", "multi_turn": "multi-turn"}
SETUPS = ("1 gateway", "3 gateways + Redis", "3 gateways, no Redis")


@dataclass
class Outcome:
    status: int = 0
    worker: str = ""
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    disagrees: bool = False


@dataclass
class RunResult:
    workload: str
    setup: str
    requests: int
    failed: int
    cached_fraction: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    disagreement: float
    lag_p50_ms: float | None = None
    lag_p99_ms: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class UnionIndex:
    """Every routing decision of every gateway, in one prefix index (see the module)."""

    def __init__(self) -> None:
        self.settings = RequestSettings(chars_per_token=4.0, block_chars=64)
        self.index = PrefixIndex(block_tokens=16.0)

    def hashes(self, body: bytes) -> list[int]:
        return parse_request(ApiKind.CHAT, body, {}, self.settings).block_hashes

    def decide(self, hashes: Sequence[int], worker_url: str) -> bool:
        """Record the decision; True when another worker held a longer prefix."""
        chosen = worker_id_for(worker_url)
        matches = self.index.match(hashes)
        best = max(matches.values(), default=0)
        disagrees = best > 0 and matches.get(chosen, 0) < best
        self.index.record(hashes, chosen)
        return disagrees


async def _send(
    session: aiohttp.ClientSession, gw: GatewayHandle, req: WorkloadRequest, union: UnionIndex
) -> Outcome:
    body = orjson.dumps(req.body(stream=True))
    hashes = union.hashes(body)
    out = Outcome()
    sent = time.perf_counter()
    headers = {"content-type": "application/json"}
    async with session.post(gw.url + "/v1/chat/completions", data=body, headers=headers) as resp:
        out.status = resp.status
        out.worker = resp.headers.get("x-gateway-worker", "")
        if out.worker:
            out.disagrees = union.decide(hashes, out.worker)
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - sent
            usage = orjson.loads(line[6:]).get("usage")
            if usage:
                out.prompt_tokens = usage.get("prompt_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = details.get("cached_tokens") or 0
    return out


async def _drive(
    workload: Workload, gateways: Sequence[GatewayHandle], time_scale: float
) -> list[Outcome]:
    union = UnionIndex()
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = loop.time()

        async def one(i: int, req: WorkloadRequest) -> Outcome:
            await asyncio.sleep(max(0.0, start + req.arrival_s / time_scale - loop.time()))
            try:
                return await _send(session, gateways[i % len(gateways)], req, union)
            except aiohttp.ClientError:
                return Outcome(status=599)

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(workload.requests))))


@contextlib.asynccontextmanager
async def _gateways(
    setup: str, urls: Sequence[str], policy: str, redis_url: str
) -> AsyncIterator[list[GatewayHandle]]:
    count = 1 if setup == "1 gateway" else 3
    overrides: dict[str, Any] = {
        "policy__name": policy,
        "policy__seed": None,
        # production-like polling: the test defaults (0.2 s) cost CPU three gateways share
        "health__interval_s": 2.0,
        "load__poll_interval_s": 1.0,
    }
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    if "Redis" in setup and "no Redis" not in setup:
        overrides.update(redis__url=redis_url, redis__prefix=prefix)
    async with contextlib.AsyncExitStack() as stack:
        gws = [
            await stack.enter_async_context(run_gateway(urls, **overrides)) for _ in range(count)
        ]
        for gw in gws:
            shared = gw.app.get(SHARED_STATE)
            if shared is not None:
                await asyncio.wait_for(shared.synced.wait(), 5.0)
        try:
            yield gws
        finally:
            if "redis__url" in overrides:
                await delete_prefix(redis_url, prefix)


def _summarise(
    workload: str, setup: str, outcomes: list[Outcome], gws: Sequence[GatewayHandle]
) -> RunResult:
    ok = [o for o in outcomes if o.status == 200]
    prompt = sum(o.prompt_tokens for o in ok)
    ttfts = [o.ttft_s * 1000 for o in ok if o.ttft_s is not None]
    lags: list[float] = []
    for gw in gws:
        shared = gw.app.get(SHARED_STATE)
        if shared is not None:
            lags.extend(v * 1000 for v in shared.lag_samples)
    return RunResult(
        workload=workload,
        setup=setup,
        requests=len(outcomes),
        failed=len(outcomes) - len(ok),
        cached_fraction=sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        ttft_p50_ms=percentile(ttfts, 50, "upper"),
        ttft_p99_ms=percentile(ttfts, 99, "upper"),
        disagreement=sum(o.disagrees for o in ok) / len(ok) if ok else 0.0,
        lag_p50_ms=percentile(lags, 50, "upper") if lags else None,
        lag_p99_ms=percentile(lags, 99, "upper") if lags else None,
    )


async def run(args: argparse.Namespace) -> list[RunResult]:
    if not await redis_answers(args.redis_url):
        raise SystemExit(f"no Redis answers at {args.redis_url}")
    results: list[RunResult] = []
    for name in args.workloads:
        workload = create_workload(WORKLOAD_NAMES[name], WORKLOAD_ARGS[name])
        for setup in SETUPS:
            sim = SimConfig(speed=args.speed)
            async with (
                await SimulatedFleet.start(args.workers, sim) as fleet,
                _gateways(setup, fleet.urls, args.policy, args.redis_url) as gws,
            ):
                outcomes = await _drive(workload, gws, args.time_scale)
                result = _summarise(name, setup, outcomes, gws)
            results.append(result)
            print(_row(result), flush=True)
    return results


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _row(r: RunResult) -> str:
    return (
        f"| {r.workload} | {r.setup} | {r.requests} | {r.failed} | {r.cached_fraction:.3f} "
        f"| {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.disagreement:.3f} "
        f"| {_fmt(r.lag_p50_ms)} | {_fmt(r.lag_p99_ms)} |"
    )


HEADER = (
    "| workload | setup | requests | failed | cached fraction | TTFT p50 ms | TTFT p99 ms "
    "| disagreement | lag p50 ms | lag p99 ms |\n|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.multi_gateway")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--speed", type=float, default=20.0, help="simulator time scale")
    parser.add_argument("--policy", default="min_ttft")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrivals compressed")
    parser.add_argument(
        "--workloads", nargs="+", default=list(WORKLOAD_ARGS), choices=list(WORKLOAD_ARGS)
    )
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    print(HEADER, flush=True)
    results = asyncio.run(run(args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in results], fh, indent=2)
    excess = statistics.fmean(r.disagreement for r in results) if results else 0.0
    print(f"mean disagreement over runs: {excess:.3f}")


if __name__ == "__main__":
    main()
