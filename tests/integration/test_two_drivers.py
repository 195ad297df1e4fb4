"""One routing core, two drivers: the live router and the offline replay make the same
decisions on the same inputs.

The same requests go (a) one at a time through the real gateway in front of simulated
HTTP workers, and (b) through the replay's Simulation on the same worker model, with
arrivals far enough apart that each request completes before the next arrives (so
neither driver's timing can matter). Both call ``gateway.routing.decide.RoutingCore``;
if either drifted from it (views built differently, the match or the recording at
dispatch skipped, another selection path), the chosen workers, the reasons or the
predicted matched tokens would differ. (On this workload the workers' reported cached
tokens agree with the index's predictions, so the feedback phase runs in both drivers
but changes no later decision.)
"""

from __future__ import annotations

import dataclasses

import aiohttp
import orjson
import pytest

from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import run_gateway
from loadtests.replay.prompts import PromptBuilder
from loadtests.replay.sim import Simulation
from loadtests.replay.workers import make_workers
from loadtests.workloads import create_workload
from loadtests.workloads.base import WorkloadRequest
from policies.registry import create_policy
from simulator.fleet import SimConfig, SimulatedFleet

WORKERS = 3
CAPACITY = 12_000
PROFILE = "tiny-cpu"
SEED = 7  # the policy rng seed of loadtests.harness.inprocess.TEST_DEFAULTS
MODEL = "sim-model"
GAP_S = 100.0  # modelled seconds between arrivals: every request done before the next
WORKLOAD = ["num_groups=4", "prompts_per_group=3", "system_prompt_len=2000",
            "question_len=200", "output_len=4", "request_rate=2", "seed=3"]  # fmt: skip

Trace = list[tuple[int, str, int]]  # per request: worker index, reason, matched tokens


def _requests() -> list[WorkloadRequest]:
    reqs = create_workload("generated-shared-prefix", WORKLOAD).requests  # groups shuffled
    return [dataclasses.replace(r, arrival_s=i * GAP_S) for i, r in enumerate(reqs)]


async def _live(policy: str, requests: list[WorkloadRequest]) -> Trace:
    config = SimConfig(profile=PROFILE, capacity_tokens=CAPACITY)
    trace: Trace = []
    async with (
        await SimulatedFleet.start(WORKERS, config) as fleet,
        run_gateway(fleet.urls, policy__name=policy, load__poll_interval_s=0) as gw,
        aiohttp.ClientSession() as session,
    ):
        for req in requests:
            body = orjson.dumps(req.body(MODEL))
            async with session.post(gw.url + "/v1/chat/completions", data=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            record = gw.router.decisions.latest(1)[0]
            worker = [worker_id_for(u) for u in fleet.urls].index(record.worker)
            trace.append((worker, record.reason, record.matched_tokens))
    return trace


def _offline(policy: str, requests: list[WorkloadRequest]) -> Trace:
    sim = Simulation(create_policy(policy), make_workers(WORKERS, CAPACITY, PROFILE),
                     CAPACITY, PromptBuilder(model=MODEL).prepare, seed=SEED,
                     engine_load_interval_s=0)  # fmt: skip
    outcome = sim.run(requests)
    ids = outcome.worker_ids
    return [
        (ids.index(r.worker), reason, r.predicted_tokens)
        for r, reason in zip(outcome.records, sim.reasons, strict=True)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft"])
async def test_live_router_and_replay_decide_alike(policy: str) -> None:
    requests = _requests()
    live = await _live(policy, requests)
    offline = _offline(policy, requests)
    assert live == offline
    # not vacuous: the index found prefixes, and more than one worker was chosen
    assert sum(1 for _, _, matched in live if matched > 0) >= len(requests) // 2
    assert len({w for w, _, _ in live}) > 1
