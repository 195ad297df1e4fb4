"""``rollouts``: reinforcement-learning rollouts, GRPO style: groups of ``n`` samples of
one prompt, sent together.

Training runs ``steps`` steps, ``step_interval_s`` apart (the trainer's update between
two rollout phases). At the start of each step the rollout client sends
``prompts_per_step`` new prompts, each ``n`` times (GRPO's group: ``n`` samples of the
same prompt, scored against each other), all at the same instant: ``prompts_per_step x
n`` requests arrive together. A prompt is an optional instruction every prompt shares
(a system message of ``instruction_len`` tokens: the task template) and its own problem
(a user message of ``prompt_len`` tokens, new for every group). Each sample asks for
``output_len`` tokens, varied uniformly by ``±jitter`` per sample (samples of one group
end at different times).

Order within a step: ``grouped`` sends a group's ``n`` requests one after another (as
rollout clients that repeat each prompt ``n`` times in place do), ``shuffled`` mixes
the step's requests. With ``group_key`` each request carries its group as ``user``
(a routing key); by default it carries none, as rollout clients send none. A group is
the request's ``group`` either way, for reporting.
"""

from __future__ import annotations

import random

from loadtests.workloads.base import ChatMessage, Workload, WorkloadRequest, finish
from loadtests.workloads.text import pseudo_text, stable_seed

NAME = "rollouts"
ORDERS = ("grouped", "shuffled")


def rollouts(
    steps: int = 8,
    prompts_per_step: int = 16,
    n: int = 8,
    instruction_len: int = 256,
    prompt_len: int = 1024,
    output_len: int = 1024,
    jitter: float = 0.5,
    step_interval_s: float = 30.0,
    order: str = "grouped",
    group_key: bool = False,
    seed: int = 0,
) -> Workload:
    """Build the workload (see module docstring)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    if steps < 1 or prompts_per_step < 1 or n < 1 or prompt_len < 1:
        raise ValueError("steps, prompts_per_step, n and prompt_len must be at least 1")
    rng = random.Random(stable_seed(NAME, seed))
    instruction = pseudo_text(stable_seed(NAME, seed, "instruction"), instruction_len)
    head = (ChatMessage("system", instruction),) if instruction else ()
    requests: list[WorkloadRequest] = []
    for s in range(steps):
        at = s * step_interval_s
        batch: list[WorkloadRequest] = []
        for p in range(prompts_per_step):
            g = s * prompts_per_step + p
            problem = pseudo_text(stable_seed(NAME, seed, "prompt", g), prompt_len)
            messages = (*head, ChatMessage("user", problem))
            for _ in range(n):
                out = max(1, round(output_len * (1 + rng.uniform(-jitter, jitter))))
                batch.append(
                    WorkloadRequest(
                        0,
                        at,
                        out,
                        messages,
                        group=f"g{g}",
                        session_id=f"g{g}" if group_key else None,
                    )
                )
        if order == "shuffled":
            rng.shuffle(batch)
        requests.extend(batch)
    params = dict(
        steps=steps,
        prompts_per_step=prompts_per_step,
        n=n,
        instruction_len=instruction_len,
        prompt_len=prompt_len,
        output_len=output_len,
        jitter=jitter,
        step_interval_s=step_interval_s,
        order=order,
        group_key=group_key,
        seed=seed,
    )
    return finish(NAME, requests, params)
