"""llm-d's endpoint picker with its default scorers and weights, as a policy (a peer's rule,
for comparison).

Source (read, not copied): llm-d/llm-d-inference-scheduler (the llm-d router's endpoint
picker, EPP), commit 520af47896e5f06e43d09aca281a1149187b0ffd:
``config/charts/epplib/templates/_config.yaml`` (the default scheduling profile without
the latency predictor: ``queue-scorer`` weight 2, ``kv-cache-utilization-scorer`` weight
2, ``prefix-cache-scorer`` weight 3, ``max-score-picker``),
``pkg/epp/framework/plugins/scheduling/scorer/{queuedepth,kvcacheutilization,prefix}/``,
``pkg/epp/scheduling/scheduler_profile.go`` (weighted sum, each score clamped to [0, 1])
and ``pkg/epp/framework/plugins/scheduling/picker/maxscore/README.md`` (highest total
wins, ties at random).

Rule, per candidate ``w`` (higher wins)::

    queue_w  = (max_q - q_w) / (max_q - min_q)      1.0 for every worker when all q are equal
    kv_w     = 1 - kv_cache_usage_w
    prefix_w = matched_blocks_w / total_blocks
    score_w  = queue_weight * queue_w + kv_weight * kv_w + prefix_weight * prefix_w

Defaults (llm-d's chart): ``queue_weight`` 2, ``kv_weight`` 2, ``prefix_weight`` 3.
The latency-predictor profile (prefix affinity gates at 0.99 / 0.80, an XGBoost TTFT
model, weighted-random picking) and the no-hit LRU scorer are not part of the default
profile and are not modelled.

Where this project's views differ from the peer's inputs:
- ``q_w``, the engine's waiting queue (``WaitingQueueSize``, scraped every 50 ms by the
  EPP): the larger of the engine's last polled ``waiting_requests`` (polled every second
  here) and this gateway's own requests not yet at their first token (``in_flight -
  decoding_requests``), so a burst this gateway sends is seen before the next poll.
- ``kv_cache_usage_w`` (vLLM's KV usage of running requests): the engine's last polled
  ``token_usage`` (0 before the first poll).
- ``prefix_w``: ``matched_tokens / prompt_tokens`` from the gateway's prefix index, whose
  64-character blocks chained from a model/salt seed are the approximate producer's own
  scheme (llm-d hashes 16-token blocks approximated as 64 characters; the precise
  producer's KV events are this project's exact mode).

Cost: O(n) in candidates. Reasons: ``prefix_hit`` / ``load`` / ``miss`` as the chosen
worker's match compares with the longest there is.
"""

from __future__ import annotations

from typing import Any, ClassVar

from policies.base import REASON_ONLY_CANDIDATE, Decision, Policy, RouteContext
from policies.peer_support import (
    check_non_negative,
    kv_usage,
    lowest,
    match_reason,
    matched_fraction,
    waiting_requests,
)


class LlmdScorersPolicy(Policy):
    name: ClassVar[str] = "llmd_scorers"
    uses_prefix_match: ClassVar[bool] = True

    def __init__(
        self, queue_weight: float = 2.0, kv_weight: float = 2.0, prefix_weight: float = 3.0
    ) -> None:
        check_non_negative(
            queue_weight=queue_weight, kv_weight=kv_weight, prefix_weight=prefix_weight
        )
        self._queue_weight = float(queue_weight)
        self._kv_weight = float(kv_weight)
        self._prefix_weight = float(prefix_weight)

    def scores(self, ctx: RouteContext) -> dict[str, float]:
        """Every candidate's weighted score (higher is better)."""
        queues = {w.id: waiting_requests(w) for w in ctx.candidates}
        low, high = min(queues.values()), max(queues.values())
        out: dict[str, float] = {}
        for w in ctx.candidates:
            queue = 1.0 if high == low else (high - queues[w.id]) / (high - low)
            kv = 1.0 - kv_usage(w)
            prefix = matched_fraction(w, ctx.prompt_tokens)
            out[w.id] = (
                self._queue_weight * queue + self._kv_weight * kv + self._prefix_weight * prefix
            )
        return out

    def select(self, ctx: RouteContext) -> Decision:
        candidates = ctx.candidates
        scores = self.scores(ctx)
        if len(candidates) == 1:
            return Decision(candidates[0].id, REASON_ONLY_CANDIDATE, scores)
        chosen = lowest(candidates, lambda w: -scores[w.id], ctx.rng)
        return Decision(chosen.id, match_reason(chosen, candidates), scores)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "queue_weight": self._queue_weight,
            "kv_weight": self._kv_weight,
            "prefix_weight": self._prefix_weight,
        }
