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
2. ... unless, once ``50 x n`` decisions are made (Preble's warm-up), its load ``L``
   exceeds ``rebalance_factor`` x the lightest candidate's (Preble's post-assignment
   rebalancing: the busiest GPU hands prefixes to the lightest once it carries 1.5x its
   load; here the request is explored instead, so the hot prefix gets a copy wherever
   step 3 puts it). 0 turns this off.
3. Explore otherwise: the candidate with the lowest ``L + E + R``, ties at random.

Costs, in seconds (the worker's calibrated cost model, else min_ttft's defaults,
PERFORMANCE.md section 3):
- ``L`` (load): the prefill work of the requests among this policy's last ``window``
  decisions that went to the worker (each request's ``R`` there, as in Preble's
  histogram of recently assigned work), plus ``in_flight * decode_tokens * decode_step``
  (the decoding owed to the requests there, each assumed ``decode_tokens`` long, as
  Preble charges active requests);
- ``R`` (running cost): this request's prefill there,
  ``fixed + per_token * u + pair * u * (m_w + u / 2)`` with ``u`` its uncached tokens;
- ``E`` (eviction cost): 0.

Defaults: ``decode_tokens`` 45, ``rebalance_factor`` 1.5, ``window`` 512 decisions.

Where this project's views differ from the peer's inputs:
- Preble's histogram covers the work assigned over the last 3 minutes (prefill weighted
  by each prefix's miss rate and shared among the GPUs holding it); policies here have no
  clock, so the window is the last ``window`` decisions (3 minutes at about 3 requests
  per second) and each request's miss is its own uncached part.
- ``E`` needs to know what a GPU would evict to fit the request (Preble's global tree
  models each GPU's LRU); no view carries it (Preble's code also leaves it off by
  default, ``enable_eviction=False``).
- the longest match comes from the gateway's prefix index (``matched_tokens``), not
  Preble's global radix tree of token ids; holders of the longest match stand for the
  GPUs Preble has assigned that prefix to.
- rebalancing moves no prefix subtrees: it only decides, per request, whether to
  exploit. Preble also detects overloaded prefixes from their TTFTs; not modelled.
- As for any policy with memory, a shadow or A/B copy records decisions it did not make.

Cost: O(n) in candidates (the window's sums are kept per worker). Reasons:
``prefix_hit``, ``load`` (a longer match passed over), ``miss``.
"""

from __future__ import annotations

from collections import deque
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
from policies.peer_support import check_count, check_non_negative, lowest, match_reason

WARMUP_PER_WORKER = 50  # Preble rebalances once 50 requests per GPU were scheduled


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


class PrebleE2Policy(Policy):
    name: ClassVar[str] = "preble_e2"
    uses_prefix_match: ClassVar[bool] = True

    def __init__(
        self, decode_tokens: int = 45, rebalance_factor: float = 1.5, window: int = 512
    ) -> None:
        check_count(decode_tokens=decode_tokens, window=window)
        check_non_negative(rebalance_factor=rebalance_factor)
        if window < 1:
            raise ValueError("window must be at least 1")
        self._decode_tokens = decode_tokens
        self._rebalance = float(rebalance_factor)
        self._window: deque[tuple[str, float]] = deque()  # (worker, prefill s), oldest first
        self._window_size = window
        self._assigned: dict[str, float] = {}  # worker -> prefill s in the window
        self._entries: dict[str, int] = {}  # worker -> its decisions in the window
        self._decisions = 0

    def load_s(self, worker: WorkerView) -> float:
        """``L``: the prefill work recently assigned to the worker and the decoding owed
        to its requests."""
        step = _or(worker.cost.decode_step_s, DEFAULT_DECODE_STEP_S)
        decode = max(0, worker.in_flight) * self._decode_tokens * step
        return max(0.0, self._assigned.get(worker.id, 0.0)) + decode

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
            chosen, reason = candidates[0], REASON_ONLY_CANDIDATE
        else:
            chosen = self._exploit(ctx, loads, totals) or lowest(
                candidates, lambda w: totals[w.id], ctx.rng
            )
            reason = match_reason(chosen, candidates)
        self._remember(chosen.id, totals[chosen.id] - loads[chosen.id])
        return Decision(chosen.id, reason, totals)

    def _exploit(
        self, ctx: RouteContext, loads: dict[str, float], totals: dict[str, float]
    ) -> WorkerView | None:
        """The holder of the longest match if it exceeds the rest of the prompt and the
        holder is not to be rebalanced; else None (explore)."""
        prompt = ctx.prompt_tokens
        longest = max(max(0, min(w.matched_tokens, prompt)) for w in ctx.candidates)
        if longest <= 0 or longest <= prompt - longest:
            return None
        holders = [w for w in ctx.candidates if min(w.matched_tokens, prompt) >= longest]
        holder = lowest(holders, lambda w: totals[w.id], ctx.rng)
        warm = self._decisions >= WARMUP_PER_WORKER * len(ctx.candidates)
        if (
            warm
            and self._rebalance > 0
            and loads[holder.id] > self._rebalance * min(loads.values())
        ):
            return None
        return holder

    def _remember(self, worker: str, prefill_s: float) -> None:
        """Add the request's prefill to the window, dropping the oldest beyond it."""
        self._decisions += 1
        self._window.append((worker, prefill_s))
        self._assigned[worker] = self._assigned.get(worker, 0.0) + prefill_s
        self._entries[worker] = self._entries.get(worker, 0) + 1
        while len(self._window) > self._window_size:
            old, seconds = self._window.popleft()
            self._entries[old] -= 1
            if self._entries[old] == 0:  # gone from the window: no rounding left behind
                del self._entries[old], self._assigned[old]
            else:
                self._assigned[old] -= seconds

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "decode_tokens": self._decode_tokens,
            "rebalance_factor": self._rebalance,
            "window": self._window_size,
        }
