"""What the peers' rules (``dynamo_kv``, ``llmd_scorers``, ``preble_e2``,
``aibrix_prefix``) share: parameter checks, the decision's reason, ties, and the view's
load figures read the way each of those modules documents.

Nothing here is a rule of its own; each rule's module says where it comes from.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from policies.base import REASON_LOAD, REASON_MISS, REASON_PREFIX_HIT, WorkerView


def check_finite(**params: float) -> None:
    """``ValueError`` naming the first parameter that is not a finite number."""
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, not {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, not {value!r}")


def check_non_negative(**params: float) -> None:
    """``ValueError`` naming the first parameter that is not a finite number >= 0."""
    check_finite(**params)
    for name, value in params.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, not {value!r}")


def check_count(**params: int) -> None:
    """``ValueError`` naming the first parameter that is not an integer >= 0."""
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, not {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, not {value!r}")


def match_reason(chosen: WorkerView, candidates: Sequence[WorkerView]) -> str:
    """``prefix_hit`` when the chosen worker holds the longest match there is, ``load``
    when a longer one was passed over, ``miss`` when nobody holds any of the prompt."""
    longest = max(w.matched_tokens for w in candidates)
    if longest <= 0:
        return REASON_MISS
    return REASON_PREFIX_HIT if chosen.matched_tokens >= longest else REASON_LOAD


def lowest(
    pool: Sequence[WorkerView], key: Callable[[WorkerView], float], rng: random.Random
) -> WorkerView:
    """The candidate of ``pool`` (non-empty) with the lowest ``key``; exact ties at random."""
    best = min(key(w) for w in pool)
    tied = [w for w in pool if key(w) == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def matched_fraction(worker: WorkerView, prompt_tokens: int) -> float:
    """The worker's matched tokens over the prompt, within [0, 1] (0 for an empty prompt)."""
    if prompt_tokens <= 0:
        return 0.0
    return min(1.0, max(0, worker.matched_tokens) / prompt_tokens)


def waiting_requests(worker: WorkerView) -> int:
    """Requests waiting for their first token there: the engine's last polled waiting
    queue or this gateway's own count (in flight, not yet decoding), whichever is larger."""
    own = max(0, worker.in_flight - worker.decoding_requests)
    engine = worker.engine_load.waiting_requests if worker.engine_load is not None else 0
    return max(own, engine)


def kv_usage(worker: WorkerView) -> float:
    """KV held by the worker's live requests over its capacity (0..1), as last polled
    (``token_usage``; 0 before the first poll)."""
    if worker.engine_load is None:
        return 0.0
    usage = worker.engine_load.token_usage
    return min(1.0, max(0.0, usage)) if math.isfinite(usage) else 0.0
