"""``multi-tenant`` and ``tenants``: the llm-d shared-context benchmark (inference-perf's
shared prefix).

``tenants`` tenants each own a long shared context (``context_len`` tokens, the system
message); each tenant has ``users_per_tenant`` users with one long question each
(``question_len`` ± ``jitter``), so both the context and the whole prompt repeat. Each
request asks for ``output_len`` tokens (``ignore_eos``).

Which (tenant, user) a request is: ``order="random"``, uniformly at random; ``"cycle"``,
inference-perf's ``shared_prefix`` data: every (tenant, user) prompt once, in an order
shuffled once, then the same order again (prompt ``i % (tenants x users)``).

Arrivals: Poisson, at a rate ramping linearly from ``rate_start`` to ``rate_end`` per
second over ``ramp_s`` seconds (``num_requests`` of them), or, with ``stages``
(``"RATE:SECONDS,..."``), at a piecewise-constant rate as inference-perf's ``load.stages``
(the count follows from the stages; ``num_requests`` > 0 caps it); ``stage_scale``
multiplies every stage's duration (0.25: the same rates, a quarter of the requests).

Sizing by capacity: with ``capacity_tokens`` (the whole fleet's KV, in tokens) the
workload's working set, ``tenants x (context_len + users_per_tenant x question_len)``
(every context and every user's question cached once; no template, no outputs, as llm-d
counts it), is made ``capacity_fraction`` of it by choosing ``tenants`` (give
``tenants=0``) or ``context_len`` (give ``context_len=0``).

``multi-tenant``'s defaults are the scenario at 150 tenants with a linear ramp and
uniform picks. ``tenants`` is llm-d's published setup ("KV-cache wins you can see",
llm-d.ai, 2025-09-24: Qwen-32B, 8 vLLM pods of 2 H100 holding 307,328 KV tokens each;
150 tenants x 5 users, 6,000-token contexts, 1,200-token questions, working set ~73 % of
the fleet's KV): its defaults size the tenants for ``8 x 307,328`` tokens at 0.73 (150),
ask 1,000 output tokens, cycle as inference-perf does, and send llm-d's ramp for this
workload (:data:`LLMD_STAGES`: the stages of the benchmark report in llm-d's
``guides/inference-scheduling``, same data, same model and fleet; the blog itself says
only "3 to 60 QPS"): a 50 s warm-up at 15 QPS, then 3 → 60 QPS over 452 s, ~17,000
requests.
"""

from __future__ import annotations

import random

from loadtests.workloads.arrivals import parse_stages, ramp_arrivals, staged_arrivals
from loadtests.workloads.base import ChatMessage, Workload, WorkloadRequest, finish
from loadtests.workloads.text import pseudo_text, stable_seed

NAME = "multi-tenant"
TENANTS_NAME = "tenants"
ORDERS = ("random", "cycle")

LLMD_POD_KV_TOKENS = 307_328  # one vLLM pod of llm-d's benchmark (Qwen-32B, 2 x H100)
LLMD_PODS = 8
LLMD_CAPACITY_FRACTION = 0.73
# (rate per s : seconds) of llm-d's guides/inference-scheduling benchmark report
LLMD_STAGES = (
    "15:50,3:20,10:20,15:20,20:38,22:34,25:30,30:25,35:21,40:38,43:36,46:33,49:30,52:29,"
    "55:27,57:26,60:25"
)


def working_set_tokens(
    tenants: int, context_len: int, users_per_tenant: int, question_len: int
) -> int:
    """KV the workload needs to hold every context and every user's question once."""
    return tenants * (context_len + users_per_tenant * question_len)


def size_for_capacity(
    capacity_tokens: int,
    fraction: float,
    tenants: int,
    context_len: int,
    users_per_tenant: int,
    question_len: int,
) -> tuple[int, int]:
    """``(tenants, context_len)`` with the one given as 0 chosen so that the working set
    is ``fraction`` of ``capacity_tokens`` (rounded to the nearest tenant / token)."""
    if capacity_tokens <= 0 or fraction <= 0:
        raise ValueError("capacity_tokens and capacity_fraction must be positive")
    target = fraction * capacity_tokens
    questions = users_per_tenant * question_len
    if tenants <= 0 and context_len > 0:
        return max(1, round(target / (context_len + questions))), context_len
    if context_len <= 0 and tenants > 0:
        context = round(target / tenants - questions)
        if context < 1:
            raise ValueError("the users' questions alone exceed that fraction of capacity")
        return tenants, context
    raise ValueError("with capacity_tokens, give tenants=0 or context_len=0 (the one sized)")


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
    stages: str = "",
    stage_scale: float = 1.0,
    order: str = "random",
    capacity_tokens: int = 0,
    capacity_fraction: float = LLMD_CAPACITY_FRACTION,
    seed: int = 0,
) -> Workload:
    """Build the workload (see module docstring)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    if capacity_tokens > 0:
        tenants, context_len = size_for_capacity(
            capacity_tokens, capacity_fraction, tenants, context_len, users_per_tenant,
            question_len,
        )  # fmt: skip
    if tenants <= 0 or context_len <= 0 or users_per_tenant <= 0:
        raise ValueError("tenants, context_len and users_per_tenant must be positive")
    rng = random.Random(stable_seed(NAME, seed))
    contexts = [
        pseudo_text(stable_seed(NAME, seed, "context", t), context_len) for t in range(tenants)
    ]
    questions: dict[tuple[int, int], str] = {}
    for t in range(tenants):
        for u in range(users_per_tenant):
            n = max(1, round(question_len * (1 + rng.uniform(-jitter, jitter))))
            questions[t, u] = pseudo_text(stable_seed(NAME, seed, "question", t, u), n)
    if stages:
        if stage_scale <= 0:
            raise ValueError("stage_scale must be positive")
        plan = [(rate, seconds * stage_scale) for rate, seconds in parse_stages(stages)]
        arrivals = staged_arrivals(rng, plan)
        if num_requests > 0:
            arrivals = arrivals[:num_requests]
    else:
        arrivals = ramp_arrivals(rng, num_requests, rate_start, rate_end, ramp_s)
    pairs = list(questions)
    if order == "cycle":
        rng.shuffle(pairs)
    requests = []
    for i, at in enumerate(arrivals):
        if order == "cycle":
            t, u = pairs[i % len(pairs)]
        else:
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
        stages=stages,
        stage_scale=stage_scale,
        order=order,
        capacity_tokens=capacity_tokens,
        capacity_fraction=capacity_fraction,
        working_set_tokens=working_set_tokens(tenants, context_len, users_per_tenant, question_len),
        seed=seed,
    )
    return finish(NAME, requests, params)


def llmd_tenants(
    tenants: int = 0,
    users_per_tenant: int = 5,
    context_len: int = 6000,
    question_len: int = 1200,
    output_len: int = 1000,
    stages: str = LLMD_STAGES,
    stage_scale: float = 1.0,
    order: str = "cycle",
    capacity_tokens: int = LLMD_PODS * LLMD_POD_KV_TOKENS,
    capacity_fraction: float = LLMD_CAPACITY_FRACTION,
    num_requests: int = 0,
    seed: int = 0,
) -> Workload:
    """``tenants``: :func:`multi_tenant` with llm-d's published setup as its defaults
    (module docstring); ``capacity_tokens=0`` with ``tenants=N`` turns the sizing off."""
    workload = multi_tenant(
        tenants=tenants,
        users_per_tenant=users_per_tenant,
        context_len=context_len,
        question_len=question_len,
        jitter=0.0,
        output_len=output_len,
        num_requests=num_requests,
        stages=stages,
        stage_scale=stage_scale,
        order=order,
        capacity_tokens=capacity_tokens,
        capacity_fraction=capacity_fraction,
        seed=seed,
    )
    return finish(TENANTS_NAME, workload.requests, workload.params)
