"""``multi-turn``: chat sessions where each turn resends the whole conversation.

``sessions`` sessions start as a Poisson process of ``session_rate`` per second. Turn
``k`` of a session sends the (optional) shared system prompt, then every earlier user
message and assistant answer, then a new user message; the assistant answers are
deterministic pseudo-text of the requested output length, so the next turn's prompt is
exactly ``previous prompt + previous answer + new message``. Turns are
``think_time_s`` (exponential mean) apart, open loop: a slow server does not delay
the next turn. Message and answer lengths vary uniformly by ``±jitter``.
"""

from __future__ import annotations

import random

from loadtests.workloads.arrivals import poisson_arrivals
from loadtests.workloads.base import ChatMessage, Workload, WorkloadRequest, finish
from loadtests.workloads.text import pseudo_text, stable_seed

NAME = "multi-turn"


def _jittered(rng: random.Random, mean: int, jitter: float) -> int:
    return max(1, round(mean * (1 + rng.uniform(-jitter, jitter))))


def multi_turn(
    sessions: int = 64,
    turns: int = 6,
    system_prompt_len: int = 512,
    user_len: int = 256,
    answer_len: int = 256,
    jitter: float = 0.5,
    think_time_s: float = 20.0,
    session_rate: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Build the workload (see module docstring)."""
    rng = random.Random(stable_seed(NAME, seed))
    starts = poisson_arrivals(rng, sessions, session_rate)
    system = pseudo_text(stable_seed(NAME, seed, "system"), system_prompt_len)
    requests: list[WorkloadRequest] = []
    for s, start in enumerate(starts):
        history: list[ChatMessage] = [ChatMessage("system", system)] if system else []
        t = start
        for k in range(turns):
            user = pseudo_text(
                stable_seed(NAME, seed, s, k, "user"), _jittered(rng, user_len, jitter)
            )
            history.append(ChatMessage("user", user))
            out = _jittered(rng, answer_len, jitter)
            requests.append(
                WorkloadRequest(len(requests), t, out, tuple(history), session_id=f"s{s}")
            )
            history.append(
                ChatMessage("assistant", pseudo_text(stable_seed(NAME, seed, s, k, "answer"), out))
            )
            t += rng.expovariate(1 / think_time_s) if think_time_s > 0 else 0.0
    params = dict(
        sessions=sessions,
        turns=turns,
        system_prompt_len=system_prompt_len,
        user_len=user_len,
        answer_len=answer_len,
        jitter=jitter,
        think_time_s=think_time_s,
        session_rate=session_rate,
        seed=seed,
    )
    return finish(NAME, requests, params)
