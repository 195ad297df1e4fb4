"""Preble's E2 (exploit + explore) scheduling, as a policy (a peer's rule, for comparison).

Sources (read, not copied): Srivatsa et al., "Preble: Efficient Distributed Prompt
Scheduling for LLM Serving" (arXiv 2407.00023, ICLR 2025), section 3.2, and the authors'
blog post (WukLab/wuklab_sysml ``content/posts/preble.md``: costs L, E, R); the reference
code WukLab/preble, commit 8e7906a3b76693c9003d1c7115b8011296c867e1,
``preble/global_scheduler_with_time.py`` (``runtime_selector``,
``calculate_min_load_cost``, ``handle_important_node_stealing``: ``HIGH_LOAD_THRESHOLD``
1.5; a decode length of 45 tokens when a request names none); AIBrix's port of it
(vllm-project/aibrix ``pkg/plugins/gateway/algorithms/prefix_cache_preble.go``,
``AIBRIX_ROUTER_PREBLE_DECODING_LENGTH`` 45).

Rule, per request, with ``m`` the longest match on any candidate and ``p`` the prompt:
1. Exploit when the cached part is longer than the rest (``m > p - m``): among the workers
   holding that longest match, the one with the lowest ``L + R`` (ties at random) ...
2. ... unless its load ``L`` exceeds ``rebalance_factor`` x the lightest candidate's
   (Preble's post-assignment rebalancing: the busiest GPU hands prefixes to the
   lightest once it carries 1.5x its load; here the request is explored instead, so the
   hot prefix gets a copy wherever step 3 puts it). 0 turns this off.
3. Explore otherwise: the candidate with the lowest ``L + E + R``, ties at random.

Costs, in seconds (the worker's calibrated cost model, else min_ttft's defaults,
PERFORMANCE.md section 3):
- ``L`` (load): ``waiting * fixed + queued * per_token`` (the prefill waiting there: the
  larger of the gateway's ``queued_prefill_tokens`` and the engine's
  ``waiting_uncached_tokens``; the larger of the gateway's waiting count and the
  engine's) plus ``requests * decode_tokens * decode_step`` (the decoding still owed to
  the requests there, each assumed ``decode_tokens`` long);
- ``R`` (running cost): this request's prefill there,
  ``fixed + per_token * u + pair * u * (m_w + u / 2)`` with ``u`` its uncached tokens;
- ``E`` (eviction cost): 0.

Defaults: ``decode_tokens`` 45, ``rebalance_factor`` 1.5.

Where this project's views differ from the peer's inputs:
- Preble's load is a histogram of the prefill and decode work assigned to each GPU over
  the last 3 minutes (prefill weighted by each prefix's miss rate, decode by active
  requests x median output x per-token time); policies here have no clock, so ``L`` is
  the work still outstanding at the worker, from the gateway's counters and the
  engine's last poll.
- ``E`` needs to know what a GPU would evict to fit the request (Preble's global tree
  models each GPU's LRU); no view carries it (Preble's code also leaves it off by
  default, ``enable_eviction=False``).
- the longest match comes from the gateway's prefix index (``matched_tokens``), not
  Preble's global radix tree of token ids; holders of the longest match stand for the
  GPUs Preble has assigned that prefix to.
- rebalancing moves no prefix subtrees and has no warm-up (Preble's starts after 50
  requests per GPU): it only decides, per request, whether to exploit.

Cost: O(n) in candidates. Reasons: ``prefix_hit``, ``load`` (a longer match passed over),
``miss``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from policies.base import (
    REASON_ONLY_CANDIDATE,
    Decision,
    Policy,
    RouteContext,
    WorkerView,
)
from policies.min_ttft import (
    DEFAULT_DECODE_STEP_S,
    DEFAULT_FIXED_S,
    DEFAULT_PAIR_S,
    DEFAULT_PER_TOKEN_S,
)
from policies.peer_support import (
    check_count,
    check_non_negative,
    lowest,
    match_reason,
    waiting_requests,
)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


class PrebleE2Policy(Policy):
    name: ClassVar[str] = "preble_e2"
    uses_prefix_match: ClassVar[bool] = True

    def __init__(self, decode_tokens: int = 45, rebalance_factor: float = 1.5) -> None:
        check_count(decode_tokens=decode_tokens)
        check_non_negative(rebalance_factor=rebalance_factor)
        self._decode_tokens = decode_tokens
        self._rebalance = float(rebalance_factor)

    def load_s(self, worker: WorkerView) -> float:
        """``L``: the prefill waiting at the worker and the decoding owed to its requests."""
        cost, engine = worker.cost, worker.engine_load
        per_token = _or(cost.prefill_per_token_s, DEFAULT_PER_TOKEN_S)
        fixed = _or(cost.prefill_fixed_s, DEFAULT_FIXED_S)
        step = _or(cost.decode_step_s, DEFAULT_DECODE_STEP_S)
        queued = max(0, worker.queued_prefill_tokens)
        requests = max(0, worker.in_flight)
        if engine is not None:
            queued = max(queued, engine.waiting_uncached_tokens or 0)
            requests = max(requests, engine.running_requests + engine.waiting_requests)
        prefill = waiting_requests(worker) * fixed + queued * per_token
        return prefill + requests * self._decode_tokens * step

    @staticmethod
    def running_s(worker: WorkerView, prompt_tokens: int) -> float:
        """``R``: this request's prefill on the worker, given what it holds."""
        cost = worker.cost
        per_token = _or(cost.prefill_per_token_s, DEFAULT_PER_TOKEN_S)
        fixed = _or(cost.prefill_fixed_s, DEFAULT_FIXED_S)
        pair = _or(cost.prefill_pair_s, DEFAULT_PAIR_S)
        prompt = max(0, prompt_tokens)
        matched = max(0, min(worker.matched_tokens, prompt))
        uncached = max(1, prompt - matched)
        return fixed + per_token * uncached + pair * uncached * (matched + uncached / 2)

    def select(self, ctx: RouteContext) -> Decision:
        candidates = ctx.candidates
        loads = {w.id: self.load_s(w) for w in candidates}
        totals = {w.id: loads[w.id] + self.running_s(w, ctx.prompt_tokens) for w in candidates}
        if len(candidates) == 1:
            return Decision(candidates[0].id, REASON_ONLY_CANDIDATE, totals)
        longest = max(max(0, min(w.matched_tokens, ctx.prompt_tokens)) for w in candidates)
        if longest > 0 and longest > ctx.prompt_tokens - longest:
            holders = [w for w in candidates if min(w.matched_tokens, ctx.prompt_tokens) >= longest]
            holder = lowest(holders, lambda w: totals[w.id], ctx.rng)
            lightest = min(loads.values())
            if self._rebalance <= 0 or loads[holder.id] <= self._rebalance * lightest:
                return Decision(holder.id, match_reason(holder, candidates), totals)
        chosen = lowest(candidates, lambda w: totals[w.id], ctx.rng)
        return Decision(chosen.id, match_reason(chosen, candidates), totals)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "decode_tokens": self._decode_tokens,
            "rebalance_factor": self._rebalance,
        }
