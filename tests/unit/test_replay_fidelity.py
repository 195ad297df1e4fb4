"""Fidelity: the same small workload replayed offline and run live (simulated HTTP workers
behind the real gateway) agrees on hit rate within 3 points and TTFT p50 within 15%.

Live: ``simulator.fleet.SimulatedFleet`` (speed-up ``SPEED``, times reported in modelled
seconds) behind ``loadtests.harness.inprocess.run_gateway`` with ``cache_aware``; an
open-loop asyncio client sends each request's body at ``arrival_s / SPEED`` and measures
the time to the first chunk (the worker sends it once the first token exists),
scaled back to modelled
seconds. Offline: the replay's Simulation with the same profile, capacity, policy, rng
seed and load-poll interval (in modelled seconds). Prompts are long (~0.5 s of modelled
prefill even when the shared part hits) so that HTTP overhead on a busy machine stays
well inside the tolerance.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from loadtests.harness.inprocess import run_gateway
from loadtests.harness.stats import percentile
from loadtests.replay.prompts import PromptBuilder
from loadtests.replay.sim import Simulation
from loadtests.replay.workers import make_workers
from loadtests.workloads import create_workload
from loadtests.workloads.base import WorkloadRequest
from policies.registry import create_policy
from simulator.fleet import SimConfig, SimulatedFleet

SPEED = 1.0
WORKERS = 2
CAPACITY = 40_000
PROFILE = "tiny-cpu"
POLL_S = 0.2  # the gateway's load poll in wall seconds (TEST_DEFAULTS)
POLICY = "cache_aware"  # decisions depend on the index and in-flight counts, not on timing
SEED = 7  # the policy rng seed of loadtests.harness.inprocess.TEST_DEFAULTS
MODEL = "sim-model"
WORKLOAD = ["num_groups=3", "prompts_per_group=4", "system_prompt_len=600",
            "question_len=1000", "output_len=4", "request_rate=2", "seed=5"]  # fmt: skip


async def _one(session: aiohttp.ClientSession, url: str, req: WorkloadRequest,
               t0: float) -> tuple[float, int, int]:  # fmt: skip
    """(TTFT in modelled seconds, cached tokens, prompt tokens) of one streamed request."""
    await asyncio.sleep(max(0.0, t0 + req.arrival_s / SPEED - time.perf_counter()))
    sent = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/chat/completions", data=orjson.dumps(req.body(MODEL)),
                            headers={"content-type": "application/json"}) as resp:  # fmt: skip
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[5:])
            if ttft is None and chunk["choices"]:  # the first chunk follows the first token
                ttft = (time.perf_counter() - sent) * SPEED
            usage = chunk.get("usage") or usage
    assert ttft is not None and usage
    details = usage.get("prompt_tokens_details") or {}
    return ttft, int(details.get("cached_tokens", 0)), int(usage["prompt_tokens"])


async def _live(requests: tuple[WorkloadRequest, ...]) -> tuple[float, float]:
    config = SimConfig(speed=SPEED, profile=PROFILE, capacity_tokens=CAPACITY)
    async with (
        await SimulatedFleet.start(WORKERS, config) as fleet,
        run_gateway(fleet.urls, policy__name=POLICY, load__poll_interval_s=POLL_S) as gw,
        aiohttp.ClientSession() as session,
    ):
        t0 = time.perf_counter() + 0.05
        results = await asyncio.gather(*(_one(session, gw.url, r, t0) for r in requests))
    hit = sum(c for _, c, _ in results) / sum(p for _, _, p in results)
    return hit, percentile([t for t, _, _ in results], 50, "linear")


def _offline(requests: tuple[WorkloadRequest, ...]) -> tuple[float, float]:
    sim = Simulation(create_policy(POLICY), make_workers(WORKERS, CAPACITY, PROFILE),
                     CAPACITY, PromptBuilder(model=MODEL).prepare, seed=SEED,
                     engine_load_interval_s=POLL_S * SPEED)  # fmt: skip
    outcome = sim.run(requests)
    hit = sum(r.cached_tokens for r in outcome.records) / sum(
        r.prompt_tokens for r in outcome.records
    )
    return hit, percentile(
        [r.ttft_s for r in outcome.records if r.ttft_s is not None], 50, "linear"
    )


@pytest.mark.slow
async def test_offline_replay_agrees_with_a_live_run() -> None:
    requests = create_workload("generated-shared-prefix", WORKLOAD).requests
    live_hit, live_p50 = await _live(requests)
    replay_hit, replay_p50 = _offline(requests)
    assert (
        live_hit > 0.2
    )  # the workload does reuse (at most 0.28 here): a vacuous agreement would prove nothing
    assert abs(live_hit - replay_hit) <= 0.03, (live_hit, replay_hit)
    assert abs(live_p50 / replay_p50 - 1.0) <= 0.15, (live_p50, replay_p50)
