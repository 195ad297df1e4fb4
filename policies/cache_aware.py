"""Cache aware: sglang-router's ``cache_aware`` semantics and flags, minus its faults.

Algorithm, per request (load = requests this gateway has in flight on the worker, counted
at decision time; match = ``matched_tokens`` from the prefix index):
1. The fleet is *imbalanced* iff ``max_load - min_load > balance_abs_threshold`` AND
   ``max_load > min_load * balance_rel_threshold``; then → the least-loaded candidate,
   cache ignored (reason ``imbalance``). The router still records the prompt there.
2. Otherwise ``match_rate = best matched_tokens / prompt_tokens``; if it exceeds
   ``cache_threshold`` → the least-loaded candidate among those holding that longest match
   (reason ``prefix_hit``).
3. Otherwise → the least-loaded candidate (reason ``miss``).
Defaults are sglang-router's CLI defaults: 0.3 / 64 / 1.5.

Differences from sglang-router 0.3.2, on purpose:
- ties are broken at random (sglang-router gives them to the first worker, herding cold
  requests onto it);
- among holders of the longest match the least loaded wins (sglang-router takes the
  worker that created the deepest node);
- the match is over block hashes of a canonical prompt that includes roles, tools and a
  model/salt namespace (sglang-router matches characters of space-joined contents).
Like sglang-router, imbalance mode drops affinity entirely, and load is request counts.

Cost: O(n) in candidates. Trade-offs: high hit rate (close to pooled LRU) while the
fleet is balanced, but request counts ignore prompt lengths, and above the imbalance
threshold every request loses its affinity at once.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

from policies.base import (
    REASON_IMBALANCE,
    REASON_MISS,
    REASON_ONLY_CANDIDATE,
    REASON_PREFIX_HIT,
    Decision,
    Policy,
    RouteContext,
    least_loaded,
)

_IN_FLIGHT = operator.attrgetter("in_flight")
_MATCHED = operator.attrgetter("matched_tokens")


class CacheAwarePolicy(Policy):
    name: ClassVar[str] = "cache_aware"
    uses_prefix_match: ClassVar[bool] = True

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds must be >= 0 (abs) and >= 1 (rel)")
        self._cache_threshold = cache_threshold
        self._abs = balance_abs_threshold
        self._rel = balance_rel_threshold

    def select(self, ctx: RouteContext) -> Decision:
        candidates = ctx.candidates
        prompt = max(ctx.prompt_tokens, 1)
        # ``min(rate, 1.0)`` written out, and C-level passes (``map``) over the candidates:
        # this runs per candidate per decision (BENCHMARKS.md, "Scale"); same values
        scores = {
            w.id: 1.0 if (rate := w.matched_tokens / prompt) > 1.0 else rate for w in candidates
        }
        if len(candidates) == 1:
            return Decision(candidates[0].id, REASON_ONLY_CANDIDATE, scores)
        loads = list(map(_IN_FLIGHT, candidates))
        high, low = max(loads), min(loads)
        if high - low > self._abs and high > low * self._rel:
            return Decision(least_loaded(candidates, ctx.rng).id, REASON_IMBALANCE, scores)
        best = max(map(_MATCHED, candidates))
        if best > 0 and best / prompt > self._cache_threshold:
            holders = [w for w in candidates if w.matched_tokens == best]
            return Decision(least_loaded(holders, ctx.rng).id, REASON_PREFIX_HIT, scores)
        return Decision(least_loaded(candidates, ctx.rng).id, REASON_MISS, scores)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cache_threshold": self._cache_threshold,
            "balance_abs_threshold": self._abs,
            "balance_rel_threshold": self._rel,
        }
