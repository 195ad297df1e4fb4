"""``lora-tenants``: many tenants, each with its own LoRA adapter and its own shared
context, Zipf popularity over tenants (issue 19's adapter-heavy workload).

Tenant ``t`` (0-based) owns the adapter ``tenant{t:02d}`` (:func:`adapter_name`; the
path a worker loads it from is :func:`adapter_path`), a system prompt of
``context_len`` tokens and ``questions_per_tenant`` questions of ``question_len`` ±
``jitter`` tokens. Each request picks its tenant with probability proportional to
``1 / (t + 1) ** zipf_s`` (tenant 0 the most popular) and one of that tenant's questions
uniformly, so both the tenant's context and whole prompts repeat; it names the adapter
SGLang's OpenAI way, ``model: "base:tenantNN"`` (:attr:`WorkloadRequest.adapter`), and
asks for ``output_len`` tokens (``ignore_eos``). Arrivals: Poisson at ``request_rate`` per
second, ``num_requests`` of them. Everything is a function of ``seed``.

Working set (every context and question cached once, no template):
``tenants x (context_len + questions_per_tenant x question_len)`` tokens, in ``params``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from loadtests.workloads.arrivals import poisson_arrivals
from loadtests.workloads.base import ChatMessage, Workload, WorkloadRequest, finish
from loadtests.workloads.text import pseudo_text, stable_seed

NAME = "lora-tenants"
ADAPTER_ROOT = "/adapters"


def adapter_name(tenant: int) -> str:
    """The LoRA adapter of tenant ``tenant``."""
    return f"tenant{tenant:02d}"


def adapter_path(name: str) -> str:
    """Where a worker loads adapter ``name`` from (the simulator reads no weights)."""
    return f"{ADAPTER_ROOT}/{name}"


def warmup_orders(adapters: Sequence[str], workers: int, slots: int) -> list[list[str]]:
    """Per worker, every adapter once, worker ``k``'s last ``slots`` being adapters
    ``k, k + workers, k + 2 x workers, ...`` (``adapters`` by popularity, so the popular
    ones are striped over the workers; wrapping round): what it holds after the warm-up
    (the live bench's, ``loadtests.micro.lora``, and the offline replay's)."""
    n = len(adapters)
    orders = []
    for k in range(workers):
        tail = list(dict.fromkeys(adapters[(k + j * workers) % n] for j in range(min(slots, n))))
        orders.append([a for a in adapters if a not in tail] + tail)
    return orders


def zipf_weights(n: int, s: float) -> list[float]:
    """Zipf popularity of ranks ``0..n-1``: ``1 / (rank + 1) ** s``, normalised."""
    if n <= 0 or s < 0:
        raise ValueError("need n > 0 and s >= 0")
    raw = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def lora_tenants(
    tenants: int = 32,
    questions_per_tenant: int = 8,
    context_len: int = 1500,
    question_len: int = 100,
    jitter: float = 0.3,
    output_len: int = 16,
    zipf_s: float = 1.0,
    request_rate: float = 12.0,
    num_requests: int = 900,
    seed: int = 0,
) -> Workload:
    """Build the workload (see module docstring)."""
    if tenants <= 0 or questions_per_tenant <= 0 or context_len <= 0 or question_len <= 0:
        raise ValueError("tenants, questions_per_tenant, context_len, question_len must be > 0")
    if not 0 <= jitter < 1 or output_len <= 0 or num_requests <= 0:
        raise ValueError("need 0 <= jitter < 1, output_len > 0 and num_requests > 0")
    rng = random.Random(stable_seed(NAME, seed))
    weights = zipf_weights(tenants, zipf_s)
    contexts = [
        pseudo_text(stable_seed(NAME, seed, "context", t), context_len) for t in range(tenants)
    ]
    questions = [
        [
            pseudo_text(
                stable_seed(NAME, seed, "question", t, q),
                max(1, round(question_len * (1 + rng.uniform(-jitter, jitter)))),
            )
            for q in range(questions_per_tenant)
        ]
        for t in range(tenants)
    ]
    arrivals = poisson_arrivals(rng, num_requests, request_rate)
    picks = rng.choices(range(tenants), weights, k=num_requests)
    requests = []
    for i, (at, t) in enumerate(zip(arrivals, picks, strict=True)):
        q = rng.randrange(questions_per_tenant)
        messages = (ChatMessage("system", contexts[t]), ChatMessage("user", questions[t][q]))
        requests.append(
            WorkloadRequest(
                i, at, output_len, messages, session_id=f"t{t}-q{q}", group=f"t{t}",
                adapter=adapter_name(t),
            )
        )  # fmt: skip
    params = dict(
        tenants=tenants,
        questions_per_tenant=questions_per_tenant,
        context_len=context_len,
        question_len=question_len,
        jitter=jitter,
        output_len=output_len,
        zipf_s=zipf_s,
        request_rate=request_rate,
        num_requests=num_requests,
        working_set_tokens=tenants * (context_len + questions_per_tenant * question_len),
        seed=seed,
    )
    return finish(NAME, requests, params)
