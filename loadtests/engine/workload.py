"""The shared-prefix workload of the real-engine demo, sized against the fleet's slots.

``num_prefixes`` long system prompts (``prefix_tokens`` each), ``per_prefix`` requests
per prefix, each with its own user message (``message_tokens``); requests shuffled by a
seeded RNG. Text is made of the tiny model's consonant-vowel-consonant syllables, so one
syllable is exactly one token to the engine (the chat template adds ~10 per request).

With 4 workers x 2 slots and 8 prefixes the fleet can hold every prefix only if each
worker keeps its own two: routing that ignores the prefix (round robin) makes each
worker see all 8 and thrash its 2 slots.
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
    prefix_id: int
    body: dict[str, Any]


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


def capacity_hint_args(requests: Sequence[PrefixRequest], slots: int) -> list[str]:
    """Gateway flags telling it a worker keeps ``slots`` prompts (RAM prompt cache off).

    ``--max-tree-size`` bounds the indexed prompt characters per worker; ``slots`` times
    the longest prompt's characters is what a llama.cpp worker really holds. A stand-in
    until the gateway reads ``total_slots`` from ``/props`` itself.
    """
    longest = max(sum(len(m["content"]) for m in r.body["messages"]) for r in requests)
    return ["--max-tree-size", str(slots * longest)]
