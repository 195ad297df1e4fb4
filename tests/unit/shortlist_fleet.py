"""What the shortlist tests share: a fleet of SGLang workers in a registry, a chat
request of given blocks, and a min_ttft routing core with given share memory
(``test_candidate_shortlist``, ``test_min_ttft_shortlist``, ``test_shortlist_red_team``)."""

from __future__ import annotations

import random

from gateway.routing.cost_model import CostModel
from gateway.routing.decide import CandidateGate, RoutingCore, Shortlist
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RouteRequest
from gateway.workers.registry import Worker, WorkerRegistry
from policies.min_ttft import MinTtftPolicy


def healthy_fleet(n: int, port: int) -> list[Worker]:
    """``n`` healthy workers on ports ``port``.., nothing in flight."""
    registry = WorkerRegistry(0.5, lambda: 10.0)
    for i in range(n):
        worker, _ = registry.add(f"http://127.0.0.1:{port + i}", "sglang")
        worker.flags.clear()
    return list(registry.candidates())


def chat_request(hashes: list[int], extra: int = 8) -> RouteRequest:
    """A chat request whose prompt is ``hashes``' blocks of 16 tokens + ``extra``."""
    tokens = 16 * len(hashes) + extra
    return RouteRequest(
        kind=ApiKind.CHAT, model=None, stream=False, include_usage=False,
        prompt_chars=4 * tokens, prompt_tokens=tokens, block_hashes=hashes, routing_key=None,
        rid=None, body=b"{}",
    )  # fmt: skip


def min_ttft_core(
    above: int, shares: dict[str, float], gate: CandidateGate | None = None
) -> tuple[RoutingCore, PrefixIndex, MinTtftPolicy]:
    """A routing core over ``min_ttft`` past its warm-up with ``shares`` as its share
    memory, shortlisting above ``above`` candidates (0: never), with slow start ``gate``."""
    policy = MinTtftPolicy()
    policy._shares = dict(shares)
    policy._touched = dict.fromkeys(shares, 1)
    policy._decisions = 1000  # past the warm-up
    index = PrefixIndex(block_tokens=16.0, max_blocks_per_worker=100_000)
    core = RoutingCore(policy, index, CostModel(), random.Random(0))
    core.shortlist = Shortlist(above=above)
    core.gate = gate
    return core, index, policy
