"""``multi-tenant``: the llm-d shared-context benchmark (inference-perf's shared prefix).

``tenants`` tenants each own a long shared context (``context_len`` tokens, the system
message); each tenant has ``users_per_tenant`` users with one long question each
(``question_len`` ± ``jitter``). Every request picks a (tenant, user) uniformly at random,
so both the context and the whole prompt repeat. Arrivals are Poisson with a rate ramping
linearly from ``rate_start`` to ``rate_end`` per second over ``ramp_s`` seconds.
Defaults are the llm-d scenario: 150 tenants x 5 users, 6,000-token contexts,
1,200 ± 360-token questions, 3 → 60 QPS; the contexts alone need ~0.9M tokens of KV.
"""

from __future__ import annotations

import random

from loadtests.workloads.arrivals import ramp_arrivals
from loadtests.workloads.base import ChatMessage, Workload, WorkloadRequest, finish
from loadtests.workloads.text import pseudo_text, stable_seed

NAME = "multi-tenant"


def multi_tenant(
    tenants: int = 150,
    users_per_tenant: int = 5,
    context_len: int = 6000,
    question_len: int = 1200,
    jitter: float = 0.3,
    output_len: int = 256,
    num_requests: int = 3000,
    rate_start: float = 3.0,
    rate_end: float = 60.0,
    ramp_s: float = 120.0,
    seed: int = 0,
) -> Workload:
    """Build the workload (see module docstring)."""
    rng = random.Random(stable_seed(NAME, seed))
    contexts = [
        pseudo_text(stable_seed(NAME, seed, "context", t), context_len) for t in range(tenants)
    ]
    questions: dict[tuple[int, int], str] = {}
    for t in range(tenants):
        for u in range(users_per_tenant):
            n = max(1, round(question_len * (1 + rng.uniform(-jitter, jitter))))
            questions[t, u] = pseudo_text(stable_seed(NAME, seed, "question", t, u), n)
    arrivals = ramp_arrivals(rng, num_requests, rate_start, rate_end, ramp_s)
    requests = []
    for i, at in enumerate(arrivals):
        t, u = rng.randrange(tenants), rng.randrange(users_per_tenant)
        messages = (ChatMessage("system", contexts[t]), ChatMessage("user", questions[t, u]))
        requests.append(
            WorkloadRequest(i, at, output_len, messages, session_id=f"t{t}-u{u}", group=f"t{t}")
        )
    params = dict(
        tenants=tenants,
        users_per_tenant=users_per_tenant,
        context_len=context_len,
        question_len=question_len,
        jitter=jitter,
        output_len=output_len,
        num_requests=num_requests,
        rate_start=rate_start,
        rate_end=rate_end,
        ramp_s=ramp_s,
        seed=seed,
    )
    return finish(NAME, requests, params)
