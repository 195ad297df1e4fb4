"""Cost of shadow policies: the routing core's decision with 0, 1 and 3 shadows.

Run: ``python -m loadtests.micro.shadows [--decisions 20000]``. Prints a Markdown table
for BENCHMARKS.md ("Shadow policies"): CPU time per decision (``time.thread_time``) of
``RoutingCore.choose`` — views, the index match, the live policy's ``select`` and the
shadows' — over the same requests, in one run, side by side.

Scenario: 8 workers with engine load and calibrated costs, a prefix index holding 64
conversations' prompts (about 1,500 characters each, 16 of their requests per worker
recorded), the live policy ``min_ttft``; shadows ``cache_aware``, then ``cache_aware``,
``least_load`` and ``random``. The decision is the part shadows add to: sending and
relaying the request cost the same whatever the shadows.
"""

from __future__ import annotations

import argparse
import random
import time

import orjson

from gateway.app import ttft_estimate
from gateway.routing.cost_model import CostModel
from gateway.routing.decide import RoutingCore
from gateway.routing.policy_set import PolicySet
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RequestSettings, RouteRequest, parse_request
from gateway.workers.registry import Worker
from policies.base import EngineLoad
from policies.min_ttft import MinTtftPolicy
from policies.registry import create_policy

WORKERS = 8
CONVERSATIONS = 64
SHADOW_SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("cache_aware",),
    ("cache_aware", "least_load", "random"),
)


def _requests(n: int, rng: random.Random) -> list[RouteRequest]:
    systems = [f"system prompt {c}: " + "words to cache " * 100 for c in range(CONVERSATIONS)]
    out = []
    for i in range(n):
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": systems[rng.randrange(CONVERSATIONS)]},
                {"role": "user", "content": f"question {i}"},
            ],
        }
        out.append(parse_request(ApiKind.CHAT, orjson.dumps(body), {}, RequestSettings()))
    return out


def _fleet(rng: random.Random) -> list[Worker]:
    workers = []
    for w in range(WORKERS):
        worker = Worker(f"http://127.0.0.1:{19000 + w}", 0.0)
        worker.flags.clear()
        worker.metadata.capacity_tokens = 200_000
        worker.in_flight = rng.randrange(8)
        worker.engine_load = EngineLoad(rng.randrange(8), rng.randrange(4), None, 0.3)
        workers.append(worker)
    return workers


def measure(decisions: int, seed: int = 1) -> list[tuple[str, float, float]]:
    """(shadows, µs of CPU per decision, ratio to no shadow), one row per shadow set."""
    rng = random.Random(seed)
    requests = _requests(decisions, rng)
    rows: list[tuple[str, float, float]] = []
    base = 0.0
    for shadows in SHADOW_SETS:
        index, costs = PrefixIndex(), CostModel()
        workers = _fleet(random.Random(seed))
        for i, req in enumerate(requests[: CONVERSATIONS * 2]):
            index.record(req.block_hashes, workers[i % WORKERS].id, 0.0)
        for w in workers:
            for _ in range(20):
                costs.observe(w.id, 1000, 0, 0.05)
        policies = PolicySet(MinTtftPolicy(), tuple(create_policy(name) for name in shadows))
        core = RoutingCore(
            policies, index, costs, random.Random(seed), ttft_estimate=ttft_estimate()
        )
        start = time.thread_time()
        for req in requests:
            core.choose(req, workers, 1.0)
        per = (time.thread_time() - start) / len(requests) * 1e6
        base = base or per
        rows.append((", ".join(shadows) or "none", per, per / base))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=20_000)
    ns = parser.parse_args(argv)
    print("| shadows | CPU per decision (µs) | vs none |")
    print("|---|---|---|")
    for name, per, ratio in measure(ns.decisions):
        print(f"| {name} | {per:.1f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
