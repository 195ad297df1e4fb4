"""Least load: power of two choices on in-flight requests plus the worker's own queue.

Algorithm: sample two distinct candidates at random; load = requests this gateway has in
flight there (counted at decision time) + the worker's reported waiting requests
(``engine_load.waiting_requests``, 0 when not polled yet); choose the lower, ties at
random. With ``sample_size`` at least the number of candidates it becomes plain least
load.

Cost: O(1) (O(n) only for the scores of the decision record).
Trade-offs: blind to prefixes; the two-choice sample avoids the herd that a global
minimum causes when many decisions see the same stale figures (the exponential
improvement in maximum load of "two choices" over one), at the price of sometimes
skipping the single least-loaded worker. The waiting count makes requests from other
gateways visible, with the staleness of the last poll; this gateway's own waiting
requests are counted twice (in flight and waiting), on purpose: a request still waiting
for its prefill costs the worker more than one that is only decoding.
"""

from __future__ import annotations

from typing import Any, ClassVar

from policies.base import (
    REASON_LOAD,
    REASON_ONLY_CANDIDATE,
    Decision,
    Policy,
    RouteContext,
    WorkerView,
)


def worker_load(worker: WorkerView) -> int:
    """In-flight requests plus the engine's waiting queue, when known."""
    waiting = worker.engine_load.waiting_requests if worker.engine_load is not None else 0
    return worker.in_flight + max(0, waiting)


class LeastLoadPolicy(Policy):
    name: ClassVar[str] = "least_load"

    def __init__(self, sample_size: int = 2) -> None:
        if sample_size < 1:
            raise ValueError("sample_size must be at least 1")
        self._sample_size = sample_size

    def select(self, ctx: RouteContext) -> Decision:
        candidates = ctx.candidates
        scores = {w.id: float(worker_load(w)) for w in candidates}
        if len(candidates) == 1:
            return Decision(candidates[0].id, REASON_ONLY_CANDIDATE, scores)
        k = min(self._sample_size, len(candidates))
        sample = ctx.rng.sample(list(candidates), k)
        best = min(scores[w.id] for w in sample)
        tied = [w for w in sample if scores[w.id] == best]
        chosen = tied[0] if len(tied) == 1 else ctx.rng.choice(tied)
        return Decision(chosen.id, REASON_LOAD, scores)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "sample_size": self._sample_size}
