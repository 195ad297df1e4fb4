"""``generated-shared-prefix``: SGLang ``bench_serving``'s shared-prefix workload.

``num_groups`` groups of ``prompts_per_group`` prompts; every prompt of a group starts
with the group's system prompt (``system_prompt_len`` tokens) followed by its own
question (``question_len`` tokens); each asks for ``output_len`` tokens. Requests are
shuffled. Defaults are ``bench_serving``'s: 64 x 16, 2,048 / 128 / 256, all at once.
The ideal hit rate is ``(prompts_per_group - 1) / prompts_per_group`` of the system
prompt tokens (88.2% of all prompt tokens with the defaults).
"""

from __future__ import annotations

import random

from loadtests.workloads.arrivals import poisson_arrivals
from loadtests.workloads.base import ChatMessage, Workload, WorkloadRequest, finish
from loadtests.workloads.text import pseudo_text, stable_seed

NAME = "generated-shared-prefix"


def generated_shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    request_rate: float = float("inf"),
    shuffle: bool = True,
    seed: int = 0,
) -> Workload:
    """Build the workload; ``request_rate`` is Poisson per second (``inf``: all at t=0)."""
    rng = random.Random(stable_seed(NAME, seed))
    pairs = [(g, p) for g in range(num_groups) for p in range(prompts_per_group)]
    if shuffle:
        rng.shuffle(pairs)
    arrivals = poisson_arrivals(rng, len(pairs), request_rate)
    systems = [
        pseudo_text(stable_seed(NAME, seed, "system", g), system_prompt_len)
        for g in range(num_groups)
    ]
    requests = []
    for i, ((g, p), t) in enumerate(zip(pairs, arrivals, strict=True)):
        question = pseudo_text(stable_seed(NAME, seed, "question", g, p), question_len)
        messages = (ChatMessage("system", systems[g]), ChatMessage("user", question))
        requests.append(WorkloadRequest(i, t, output_len, messages, session_id=None, group=f"g{g}"))
    params = dict(
        num_groups=num_groups,
        prompts_per_group=prompts_per_group,
        system_prompt_len=system_prompt_len,
        question_len=question_len,
        output_len=output_len,
        request_rate=request_rate,
        shuffle=shuffle,
        seed=seed,
    )
    return finish(NAME, requests, params)
