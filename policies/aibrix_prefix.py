"""AIBrix's ``prefix-cache`` routing, as a policy (a peer's rule, for comparison).

Source (read, not copied): vllm-project/aibrix, commit
e3e10f9e4aebe9aac5e7d992fb87d2648e01628b: ``pkg/plugins/gateway/algorithms/
prefix_cache.go`` (``routeOriginal``, ``getTargetPodFromMatchedPods``,
``getTargetPodListOnLoadImbalance``), ``least_request.go``
(``selectTargetPodWithLeastRequestCount``), ``util.go`` (mean, sample standard
deviation), ``pkg/utils/prefixcacheindexer/hash.go`` (match percentage) and
``prefix_cache_readme.md``.

Rule, per request (load = running requests the gateway tracks per pod):
1. Imbalance: when ``max_load - min_load > imbalance_abs_count``, only the least-loaded
   workers are considered for a prefix match.
2. Among the (considered) workers holding part of the prompt, sorted by match percentage
   (``floor(100 * matched / prompt)``) descending, then load ascending (after a random
   shuffle, so exact ties fall at random), the first whose load is at most ``mean +
   std_factor * stddev`` of every candidate's load (sample standard deviation) is chosen.
3. Otherwise (no match, or every holder above that bound): the least-loaded worker of
   all candidates, ties at random.

Defaults: the code's, ``imbalance_abs_count`` 8 and ``std_factor`` 1
(``AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT``,
``AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR``); the README's table says 16 and 2.
(Named so that the gateway's sglang-router flags ``balance_abs_threshold`` /
``balance_rel_threshold`` never reach this policy.)

Where this project's views differ from the peer's inputs:
- load: ``WorkerView.in_flight`` (this gateway's requests there, counted at decision
  time), as AIBrix's realtime running-request count, which its gateway tracks itself.
- match: ``matched_tokens`` from the gateway's prefix index (64-character blocks, per
  worker LRU sized from its KV capacity, corrected by reported ``cached_tokens``);
  AIBrix hashes token (or character) blocks in one LRU of 200,000 blocks with a 20-minute
  idle eviction, and records the prompt under the chosen pod, as this gateway does.

Cost: O(n log n) in candidates. Reasons: ``prefix_hit`` (a holder of the longest match),
``load`` (a holder of a shorter match, or the least-loaded worker over a holder),
``imbalance`` (the imbalance rule and no holder among the least loaded), ``miss``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from policies.base import (
    REASON_IMBALANCE,
    REASON_LOAD,
    REASON_MISS,
    REASON_ONLY_CANDIDATE,
    Decision,
    Policy,
    RouteContext,
    WorkerView,
)
from policies.peer_support import check_count, check_non_negative, lowest, match_reason


def load_bound(loads: list[int], std_factor: float) -> float:
    """``mean + std_factor * stddev`` of ``loads`` (sample standard deviation, 0 for fewer
    than two values)."""
    mean = sum(loads) / len(loads)
    if len(loads) < 2:
        return mean
    variance = sum((x - mean) ** 2 for x in loads) / (len(loads) - 1)
    return mean + std_factor * math.sqrt(variance)


class AibrixPrefixPolicy(Policy):
    name: ClassVar[str] = "aibrix_prefix"
    uses_prefix_match: ClassVar[bool] = True

    def __init__(self, imbalance_abs_count: int = 8, std_factor: float = 1.0) -> None:
        check_count(imbalance_abs_count=imbalance_abs_count)
        check_non_negative(std_factor=std_factor)
        self._abs = imbalance_abs_count
        self._std_factor = float(std_factor)

    def select(self, ctx: RouteContext) -> Decision:
        candidates = ctx.candidates
        prompt = max(1, ctx.prompt_tokens)
        percent = {w.id: min(100, max(0, w.matched_tokens) * 100 // prompt) for w in candidates}
        if len(candidates) == 1:
            return Decision(candidates[0].id, REASON_ONLY_CANDIDATE, dict.fromkeys(percent, 0.0))
        scores = {k: float(v) for k, v in percent.items()}
        loads = [max(0, w.in_flight) for w in candidates]
        low = min(loads)
        imbalanced = max(loads) - low > self._abs
        pool = [w for w in candidates if w.in_flight <= low] if imbalanced else list(candidates)
        holders = [w for w in pool if w.matched_tokens > 0]
        if holders:
            ctx.rng.shuffle(holders)
            holders.sort(key=lambda w: (-percent[w.id], w.in_flight))
            bound = load_bound(loads, self._std_factor)
            for w in holders:
                if w.in_flight <= bound:
                    return Decision(w.id, match_reason(w, candidates), scores)
        chosen: WorkerView = lowest(candidates, lambda w: w.in_flight, ctx.rng)
        if holders:
            reason = REASON_LOAD  # every holder above the load bound
        elif imbalanced and any(w.matched_tokens > 0 for w in candidates):
            reason = REASON_IMBALANCE  # holders exist, none among the least loaded
        else:
            reason = REASON_MISS
        return Decision(chosen.id, reason, scores)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "imbalance_abs_count": self._abs,
            "std_factor": self._std_factor,
        }
