"""The real-engine benches' workloads: shared prefixes, and agents with a growing history.

``num_prefixes`` long system prompts (``prefix_tokens`` each), ``per_prefix`` requests
per prefix, each with its own user message (``message_tokens``); requests shuffled by a
seeded RNG. Text is made of the tiny model's consonant-vowel-consonant syllables, so one
syllable is exactly one token to the engine (the chat template adds ~10 per request).

With 4 workers x 2 slots and 8 prefixes the fleet can hold every prefix only if each
worker keeps its own two: routing that ignores the prefix (round robin) makes each
worker see all 8 and thrash its 2 slots.

:func:`agentic_requests`: ``agents`` agents, each with its own long system prompt and
task, take ``steps`` steps; each step's prompt is the previous one plus a tool call (an
assistant message) and its result (a user message), so step ``k`` extends step ``k - 1``
and a server that still holds it recomputes only the new call and result. An agent's steps
are one ``chain``: sent in order, never two at once (a step needs the previous answer),
by whichever of the closed-loop clients is free; each round the agents' order is
shuffled by ``seed``. The history is
fixed text, not the model's replies, so every target sees the same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Consonant-vowel-consonant syllables, as in ``loadtests/workloads/text.py``'s
# pseudo-text; the tiny model has each `` bak`` as one token (``tiny_model.build_vocab``).
ONSETS = "bcdfghklmnprstvw"
VOWELS = "aeiou"
CODAS = "bdgklmnprstvxyzf"
SYLLABLES: tuple[str, ...] = tuple(f" {o}{v}{c}" for o in ONSETS for v in VOWELS for c in CODAS)


def syllable_text(rng: random.Random, n_tokens: int) -> str:
    """``n_tokens`` random syllables: exactly ``n_tokens`` tokens for the tiny model."""
    return "".join(rng.choices(SYLLABLES, k=n_tokens))


@dataclass(frozen=True, slots=True)
class PrefixRequest:
    """One request of the workload: which prefix it shares, and its chat body."""

    index: int
    prefix_id: int  # the shared prefix (shared-prefix) or the agent (agentic)
    body: dict[str, Any]
    chain: int | None = None  # requests of one chain are sent in order, one at a time


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """Workload size. Defaults: REAL_ENGINE.md's demo (8 x 6 requests, 1,800 + 200 tokens)."""

    num_prefixes: int = 8
    per_prefix: int = 6
    prefix_tokens: int = 1800
    message_tokens: int = 200
    max_tokens: int = 4
    seed: int = 0  # request order
    text_salt: int = 0  # another salt: the same order with text no worker has cached yet
    model: str = "tiny-llama"


def shared_prefix_requests(spec: SharedPrefixSpec) -> list[PrefixRequest]:
    """The requests, shuffled; deterministic in ``spec``. The order depends on ``seed``
    only, the text on ``seed`` and ``text_salt``."""
    order = [p for p in range(spec.num_prefixes) for _ in range(spec.per_prefix)]
    random.Random(spec.seed).shuffle(order)
    rng = random.Random(f"{spec.seed}:{spec.text_salt}")
    prefixes = [syllable_text(rng, spec.prefix_tokens) for _ in range(spec.num_prefixes)]
    requests = []
    for index, prefix_id in enumerate(order):
        messages = [
            {"role": "system", "content": prefixes[prefix_id]},
            {"role": "user", "content": syllable_text(rng, spec.message_tokens)},
        ]
        body = {
            "model": spec.model,
            "messages": messages,
            "max_tokens": spec.max_tokens,
            "temperature": 0,
        }
        requests.append(PrefixRequest(index, prefix_id, body))
    return requests


@dataclass(frozen=True, slots=True)
class AgenticSpec:
    """Agentic sessions: a long system prompt per agent and a tool-call history growing
    each step. Defaults: 6 agents x 4 steps (with 2 clients), as in issue 23's measurement;
    prompts from ~1,480 (step 0) to ~2,400 tokens (step 3), so a server of 8,192 KV
    tokens holds three agents' histories and not four."""

    agents: int = 6
    steps: int = 4
    system_tokens: int = 1400
    task_tokens: int = 60
    call_tokens: int = 40  # an assistant message: the tool call
    result_tokens: int = 250  # a user message: the tool's result
    max_tokens: int = 4
    seed: int = 0  # the agents' order in each round
    text_salt: int = 0
    model: str = "tiny-llama"


def agentic_requests(spec: AgenticSpec) -> list[PrefixRequest]:
    """The requests, round by round (step 0 of every agent, then step 1, ...), agents
    shuffled within a round; ``prefix_id`` and ``chain`` are the agent.
    Deterministic in ``spec``; the order depends on ``seed`` only."""
    rng = random.Random(f"agentic:{spec.seed}:{spec.text_salt}")
    heads = [
        [
            {"role": "system", "content": syllable_text(rng, spec.system_tokens)},
            {"role": "user", "content": syllable_text(rng, spec.task_tokens)},
        ]
        for _ in range(spec.agents)
    ]
    history = [
        [
            [
                {"role": "assistant", "content": syllable_text(rng, spec.call_tokens)},
                {"role": "user", "content": syllable_text(rng, spec.result_tokens)},
            ]
            for _ in range(spec.steps - 1)
        ]
        for _ in range(spec.agents)
    ]
    order = random.Random(spec.seed)
    requests: list[PrefixRequest] = []
    for step in range(spec.steps):
        agents = list(range(spec.agents))
        order.shuffle(agents)
        for agent in agents:
            messages = [*heads[agent]]
            for turn in history[agent][:step]:
                messages.extend(turn)
            body = {
                "model": spec.model,
                "messages": messages,
                "max_tokens": spec.max_tokens,
                "temperature": 0,
            }
            requests.append(PrefixRequest(len(requests), agent, body, chain=agent))
    return requests


def agentic_ideal_fraction(spec: AgenticSpec, template_tokens: int = 5) -> float:
    """Cached fraction if every step hit its agent's previous prompt in full: an estimate
    in syllables plus ``template_tokens`` per message (page rounding ignored)."""
    head = spec.system_tokens + spec.task_tokens + 2 * template_tokens
    turn = spec.call_tokens + spec.result_tokens + 2 * template_tokens
    prompts = [head + k * turn for k in range(spec.steps)]
    return sum(prompts[:-1]) / sum(prompts) if prompts else float("nan")


def capacity_hint_args(requests: Sequence[PrefixRequest], slots: int) -> list[str]:
    """Gateway flags telling it a worker keeps ``slots`` prompts (RAM prompt cache off).

    ``--max-tree-size`` bounds the indexed prompt characters per worker; ``slots`` times
    the longest prompt's characters is what a llama.cpp worker really holds. A stand-in
    until the gateway reads ``total_slots`` from ``/props`` itself.
    """
    longest = max(sum(len(m["content"]) for m in r.body["messages"]) for r in requests)
    return ["--max-tree-size", str(slots * longest)]
