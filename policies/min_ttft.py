"""Minimum estimated time to first token, with affinity for private prefixes (the default).

Algorithm, per request. For each candidate ``w`` (cost from ``w.cost``, defaults when a
field is ``None``: PERFORMANCE.md section 3, Llama-3-8B on an H100):

    queue_s   = R * fixed + Q * per_token     Q = queued uncached prefill tokens there
                                              (max of the gateway's count and the
                                              engine's ``waiting_uncached_tokens``),
                                              R = requests waiting for their first token
    decode_s  = decode_step + B * decode_request_s   if B > 0 (B = decoding requests):
                                              the step a new prefill waits behind
    prefill_s = fixed + per_token * u + pair * u * (m + u / 2)
                                              u = prompt_tokens - m uncached, m matched
    load_s    = host_fixed + host_per_token * h   h = matched_host_tokens, the part of the
                                              match on the worker's host tier (HiCache),
                                              loaded back instead of computed; then
                                              prefill_s = max(prefill_s, load_s) (SGLang
                                              overlaps the load with the compute layer by
                                              layer; the simulator's step takes the longer)
    estimate  = queue_s + decode_s + setup_s + prefill_s
                                              (the decision record's score, seconds;
                                              setup_s: a LoRA adapter load, if one is
                                              needed there: ``WorkerView.setup_s``)
    score     = estimate + work_weight * prefill_s

``work_weight`` charges a miss for the prefill work it adds to the fleet (which delays
later requests), not only for its own TTFT: pure min-TTFT sends a sibling to an idle
worker as soon as the holder has a short queue, re-computing the shared prefix there and
scattering groups, which is why it trails cache-aware routing on hit rate
(PERFORMANCE.md section 2).

Then:
1. Bounded load, against collapse: a candidate is skipped when it is *hot* (its share of
   this policy's recent decisions, an EWMA over about ``share_window`` decisions, exceeds
   the fair share 1/n by more than ``hot_margin``) and crowded (``in_flight + 1 >
   max(ceil(load_factor * (total in flight + 1) / n), load_cap_floor)``). A prefix every
   request shares (a common system prompt, the Mooncake conversation trace's block 0)
   thus cannot collapse the fleet onto one worker even while that worker's estimate stays
   the lowest; but a worker that merely drew a few more groups than the others (shares
   of 1.2-1.6x fair are common: 0.19 against 0.125 on 8 workers) keeps its groups, since
   re-computing their prefixes elsewhere would buy nothing. With 4 workers a hot worker
   is held near 0.25 + 0.15 = 0.4 of the decisions: no collapse onto one worker. The
   share memory makes ``select`` depend on the policy's past decisions, as round robin's
   counter does. Four refinements:
   - the one worker holding a *private* prefix of this request (as in step 2: its
     conversation, its agent's history) is hot for it only above 1/n +
     ``private_hot_margin`` (0.3): moving a conversation throws its history away. When
     only a few workers hold a system prompt every new session shares, they are each
     hot at ~2x fair, and the plain margin moved the continuing sessions off them
     (multi-turn chat: 142 of 1,536 requests moved, hit .835 against .866 for
     ``cache_aware``); new sessions, whose match is the shared prompt, still move;
   - a worker holding all but ``sibling_tokens`` (32) of the prompt is not skipped for
     being hot: the request adds no prefill there (a GRPO sample whose group's first
     sample was just sent there, an identical retry). The guard split such groups at
     the start of a burst, where the total in flight is still small (rollouts: 62 of
     128 groups split);
   - a crowded worker whose engine last reported requests waiting while its KV was at
     least ``full_usage`` (0.9) full is skipped whatever its share and whatever it
     holds: its queue waits for running requests to end, which the estimate does not
     see (llm-d's tenant workload: a worker holding 22 tenants against 16 elsewhere
     filled its KV and its requests waited 3-10 s while the estimate said 0.1-1.5 s);
   - a worker starves when its share is below ``starve_share`` (0.5) x fair while it
     has no prefill queued and its in flight is below an even load
     (``max(ceil((total in flight + 1) / n), load_cap_floor)``). While one does, any
     worker above the fair share 1/n is hot, whatever its load, unless it holds this
     request's private prefix or the whole prompt; for a prompt nobody holds, only
     above an even load (at light load a cold prompt goes to the lowest score: a
     slower worker is not made to take it), and so for the one worker holding the
     longest match (a conversation moved once keeps an old copy elsewhere, which cuts
     its holder's lead short of private: skipped at light load, it went to the idle
     worker, its whole history computed again). The plain line
     1/n + ``hot_margin`` only stops a collapse onto one worker: k workers holding a
     system prompt every new session shares each take 1/k of the decisions, under the
     line for k >= 4 of 8, and the near-tie band gives them every new session (the
     prompt is not private, so step 2 does not apply) while the rest never get a
     request (the multi-turn drain replay, BENCHMARKS.md "min_ttft: no idle worker": 4
     of 8 workers served all requests for the first 300 s, one none in 40 minutes).
     Then new sessions go to the starving worker, which then holds the system prompt
     and competes as the others; conversations stay home. A worker computing a long
     prompt is not starving (without that test, new conversations of the Mooncake
     trace piled onto such a worker: p99 10.1 -> 13.6 s). The rule used to spare
     workers not above an even load (at least ``load_cap_floor``), which never bound at
     light load: on small caches the holders of a shared system prompt then took every
     new session and evicted each other's histories while the rest idled (live
     multi-turn on 32,768-token workers, BENCHMARKS.md "Live: every workload x every
     rule": 3 of 8 workers served all 384 requests, cached .662-.670 against
     ``cache_aware``'s .730; with the load left out for prompts some worker holds
     part of, .766). The price: at light load a starving worker that is slower than
     the holders still takes requests sharing their prefix, until its share is back at
     ``starve_share`` x fair. 0 turns the rule off.
2. Exploit (after Preble's E2 rule, with load in time units): let ``private`` be the
   part of the longest match that no other remaining candidate holds (longest match
   minus the best match on any other candidate: 0 when two or more hold the longest).
   When ``private >= exploit_ratio * prompt_tokens``, its one holder is chosen unless
   its estimate exceeds the best remaining estimate by more than ``affinity_max_s``
   seconds or exceeds ``affinity_factor`` x it + ``affinity_s``. Defaults: 0.1, 5 s,
   100 x, 0 s, so in practice a private prefix stays on its worker unless that worker
   is hot and crowded (step 1) or 5 s behind the best.
   Why: a conversation's history is private to its worker; moving it throws that copy
   away and re-computes it elsewhere, and under overload (every queue long) that extra
   work delays everybody. The near-tie band (step 3) moved it as soon as the holder
   was about 20 % slower, which on the Mooncake traces cost hit rate *and* latency.
   Tighter guards measured worse (BENCHMARKS.md, "Policy tuning": a factor of 4 or a
   2 s bound lose hits on the synthetic trace without a steady gain in p99).
   A prefix that other workers hold too (a system prompt) is not private, so cold
   prompts and new conversations still go to the lowest score: this step does not
   herd them onto the workers that happen to hold a shared prefix. (It did while
   "private" was the lead over the workers not holding the longest match: a prefix
   three workers held was private to the three, and every new GRPO group went to the
   holders of the 256-token instruction all prompts share, 4 workers of 8 in step 0.)
   ``exploit_ratio`` > 1 disables the step (the policy as it was before).
3. Near ties: every remaining candidate whose score is within ``tolerance_s +
   tolerance_rel * best`` of the best score is "as good"; among those, the ones holding
   the longest match win, and among them the lowest score; exact ties at random.
   This keeps siblings and conversation turns on their worker until its queue makes a
   second copy clearly cheaper, and only then spreads the hot prefix.
Cold requests (no match anywhere) go to the lowest score, i.e. the least-loaded worker
(when every candidate reports ``free_sequences``, as llama.cpp workers bounded by their
slots do, only among those with the most free sequences, whatever their queue);
their siblings then follow them because the gateway records the prompt at dispatch.
Among the candidates whose score is within ``tolerance_s`` of that lowest one, the one
with the fewest requests in flight wins, then the one with the lowest share of recent
decisions (step 1's memory), then the lowest score, then at random: scores that close
differ by less than the cost model's own error, since each worker's prefill cost is
fitted from noisy TTFTs, and where a cold prompt lands its group, tenant or session
follows, for good. Taking the lowest score there herded groups onto whichever worker's
fit came out fastest: on llm-d's tenant workload (BENCHMARKS.md, "Tenant workload
(llm-d)"), 8 identical workers fitted at 18-21 us per token, two of them drew most new
tenants (11 to 41 tenants per worker against 16 to 21 with this rule) and their KV
filled first: p90 TTFT 0.47 s against 0.059 s. The share breaks the ties of a lightly
loaded fleet, where every worker has 0 or 1 request in flight and the count says
nothing (the tenant workload at 0.3x, seed 0: tenants per worker 16, 16, 17, 17, 20, 21,
21, 22 with the count alone, 17, 17, 18, 18, 18, 20, 20, 22 with the share; hit .873 ->
.894). Widening the ties to the whole near-tie band (``tolerance_rel``)
spread tenants as well but sent large cold prompts to 20 % slower workers: synthetic
trace x3, p99 3.82 -> 4.49 s.

Reasons: ``prefix_hit`` (the chosen worker holds the longest match there is), ``load``
(a longer match existed but load won), ``miss`` (nobody holds any of the prompt),
``only_candidate``.

Cost: O(n) in candidates, a few float operations each.

Large fleets (issue 22). Above ``policy.shortlist_above`` candidates (64) the routing
core shows the policy a shortlist (``gateway.routing.decide.Shortlist``: the best
matchers, the least loaded, the least queued, the most loaded, and what
:meth:`MinTtftPolicy.shortlist_hints` asks for: the private holder over the whole fleet
and up to ``shortlist_least_loaded`` starving workers, the fewest in flight first; among
equally loaded workers the least loaded are taken lowest share first; among more
holders of one match than the shortlist takes, the least queue time first, 5 ms per
request in flight + 22 us per queued token, as their scores differ, then as the least
loaded: else with a starving worker the holders shown could all be above the fair share
while one left out was kept) with every
candidate's figures as columns (``RouteContext.fleet``). Every figure a rule reads
across candidates is then the fleet's, not the shortlist's: the load lines (the total in
flight over n), the fair share 1/n, the starving test (rule 1), the longest match and
the private holder (step 2); and the share memory decays for every candidate, lazily: while
the same fleet is offered decision after decision its shares decay by one common factor
kept apart (O(1) a decision: the chosen one's entry gains alpha over the factor), applied
to the entries when the fleet changes, before a decision over every candidate, or once
the factor falls below 1e-150. Estimates, scores, rule 1's per-worker test and steps 2
and 3 run over the shortlist only. The decision is the one over every candidate when the
pick is in the shortlist; where it can differ: a worker left out whose score is below
every shown one rule 1 keeps (a fitted cost or engine figures cheaper than every least
loaded and least queued worker's; a holder of a match at or below the fair share while a
worker starves, with more queued than the holders shown, all above it), the private
holder among the workers rule 1 keeps once the fleet's holder is skipped (looked for among
the shortlist's, which holds the best matchers),
``free_sequences`` (the shortlist's), and random ties (among the shown). Without the
fleet's figures, over the shortlist alone, the tail had tripled (BENCHMARKS.md, "Scale":
256 workers, multi-turn, p99 TTFT 3.6 -> 12.0 s): its mean load (the least loaded) made
busy holders "crowded", its fair share 1/40 hid hot workers, and shares of the workers left
out never decayed.
Trade-offs: the estimate is only as good as the cost model and the load figures (the
gateway's own counts are exact for its traffic; the engine's are stale by one poll);
the tolerance trades a little TTFT for hit rate (0 = pure min-TTFT); the load cap trades
a few prefix re-computations for robustness against collapse. There is no deterministic
"home" worker (rendezvous hash) for cold prompts: the gateway records a prompt at
dispatch, so a cold prompt's siblings already find it, and a home would only skew load.

Measured in the offline replay (BENCHMARKS.md, "Policy tuning": 8 simulated workers of
430k tokens, arrivals x3, against the replay's re-implementation of sglang-router's rule
and this policy without the exploit step): Mooncake synthetic trace, hit rate 0.304
(sglang-router 0.295, without the step 0.266), p99 TTFT 3.96 s (10.66 s, 4.09 s), mean
0.67 s (1.44 s, 0.69 s); Mooncake conversation trace, hit 0.128 (0.149, 0.116), p99
10.7 s (15.3 s, 9.4 s), mean 1.19 s (2.15 s, 1.21 s). On the conversation trace the hit
rate of every policy using the gateway's prefix index stays below sglang-router's
reference (whose tree never forgets); with the index's per-worker capacity raised 3x
the same policies gain 1-2 points. Shared-prefix workloads: 0.880 (the bound), as the
others; light multi-turn chat: 0.765, p99 0.029 s (the references 0.771, 0.038 s; 0.739,
0.066 s before step 1 spared private holders). Against every peer's rule on six
workloads (BENCHMARKS.md, "Every workload x every rule", seeds 0-2): within .002 of the
best hit rate and 0.002 s of the best p99 on shared prefix, multi-turn, GRPO rollouts and
llm-d's tenants; agentic sessions, the best hit rate with p99 4-20 ms above Dynamo's
(whose token load spreads new agents over every worker); the Mooncake conversation trace
x3 (3,000 requests), hit .003-.009 below sglang-router's rule at 0.55-0.75x its p99 and
p99 0.8-2.2 s above Dynamo's at .035 more hit.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from policies.base import (
    REASON_LOAD,
    REASON_MISS,
    REASON_ONLY_CANDIDATE,
    REASON_PREFIX_HIT,
    Decision,
    EngineLoad,
    FleetFigures,
    Policy,
    RouteContext,
    ShortlistHints,
    WorkerCost,
    WorkerView,
)

# PERFORMANCE.md section 3 (Llama-3-8B BF16, one H100); used for fields not calibrated.
DEFAULT_PER_TOKEN_S = 22e-6
DEFAULT_FIXED_S = 5e-3
DEFAULT_PAIR_S = 1.3e-9
DEFAULT_DECODE_STEP_S = 6.5e-3
# A host-tier hit (HiCache) loaded back over the GPU's PCIe link: Llama-3-8B's KV is
# 131,072 bytes per token (32 layers x 2 x 8 KV heads x 128 x 2 bytes, its config.json)
# over PCIe 5.0 x16's 63 GB/s each way at 85 % (pinned host-to-device copies: NVIDIA's
# nvbandwidth reports ~55.6 GB/s on a Gen5 host): 2.45 us per token, 9x cheaper than its
# prefill (22 us); 0.2 ms per load is assumed (kernel launches, per-layer completion).
# The simulator's default --hicache-link (simulator/model/transfer.py) uses the same
# figures. Gen4 x16 (A100): twice the per-token time; a GH200's NVLink-C2C: ~0.36 us.
DEFAULT_HOST_LOAD_PER_TOKEN_S = 2.45e-6
DEFAULT_HOST_LOAD_FIXED_S = 0.2e-3


@dataclass(frozen=True, slots=True)
class _Costs:
    per_token: float
    fixed: float
    pair: float
    decode_step: float

    @staticmethod
    def of(cost: WorkerCost) -> _Costs:
        return _Costs(
            per_token=_or(cost.prefill_per_token_s, DEFAULT_PER_TOKEN_S),
            fixed=_or(cost.prefill_fixed_s, DEFAULT_FIXED_S),
            pair=_or(cost.prefill_pair_s, DEFAULT_PAIR_S),
            decode_step=_or(cost.decode_step_s, DEFAULT_DECODE_STEP_S),
        )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _most_room(pool: list[WorkerView]) -> list[WorkerView]:
    """For a prompt nobody holds: the workers with the most free sequences, when every
    one reports a sequence bound (llama.cpp slots); else ``pool`` as is. Placing it on a
    full worker would evict a prompt the worker holds, whose next request then misses:
    a slot still free is worth a wait behind a prefill (the load cap still applies)."""
    rooms = [w.free_sequences for w in pool]
    if not pool or any(r is None for r in rooms):
        return pool
    most = max(r for r in rooms if r is not None)
    return [w for w in pool if w.free_sequences == most]


_FORGET_AFTER = 64  # share windows without being offered: a worker's share is forgotten
_ID = operator.attrgetter("id")
_MATCHED = operator.attrgetter("matched_tokens")
_IN_FLIGHT = operator.attrgetter("in_flight")


@dataclass(frozen=True, slots=True)
class _FleetRules:
    """Rule 1's and step 2's figures over a whole fleet (``MinTtftPolicy._fleet_rules``);
    worker indices into its :class:`~policies.base.FleetFigures`."""

    cap: int  # the load cap: max(ceil(load_factor x (total in flight + 1) / n), floor)
    even: int  # an even load: max(ceil((total in flight + 1) / n), floor)
    fair: float  # 1 / n, the fair share
    starving: bool  # a worker starves (rule 1)
    starving_workers: list[int]
    longest: int  # the longest match on any worker
    private: int | None  # the private holder over the fleet (step 2)
    sole: str | None  # the id of the one worker holding the longest match, if one does
    stored: list[float]  # each worker's share of recent decisions as stored (x scale)
    scale: float  # the lazy decay of the fleet's stored shares (``_lazy_ids``; 1.0: none)


def _private_index(matched: Sequence[int], longest: int, lead: float) -> int | None:
    """``MinTtftPolicy._private_holder`` on a column of matches (``longest``: its
    maximum): the index of the one worker holding the longest match (> 0) if it leads
    every other by at least ``lead`` tokens. C-level passes (a builtin each)."""
    if longest <= 0 or longest < lead or matched.count(longest) > 1:
        return None  # no match, a lead it cannot have, or two hold it
    second = max(filter(longest.__gt__, matched), default=0)
    if longest - (second if second > 0 else 0) < lead:
        return None
    return matched.index(longest)


def _reason(chosen: WorkerView, longest: int) -> str:
    """The decision's reason; ``longest``: the longest match on any candidate."""
    if longest <= 0:
        return REASON_MISS
    return REASON_PREFIX_HIT if chosen.matched_tokens >= longest else REASON_LOAD


class MinTtftPolicy(Policy):
    name: ClassVar[str] = "min_ttft"
    uses_prefix_match: ClassVar[bool] = True
    weighs_setup: ClassVar[bool] = True  # a LoRA load is time before the first token

    def __init__(
        self,
        work_weight: float = 1.0,
        tolerance_s: float = 0.02,
        tolerance_rel: float = 0.2,
        load_factor: float = 1.5,
        load_cap_floor: int = 3,
        decode_request_s: float = 1e-4,
        hot_margin: float = 0.15,
        share_window: int = 64,
        exploit_ratio: float = 0.1,
        affinity_factor: float = 100.0,
        affinity_s: float = 0.0,
        affinity_max_s: float = 5.0,
        private_hot_margin: float = 0.3,
        sibling_tokens: int = 32,
        full_usage: float = 0.9,
        starve_share: float = 0.5,
        host_load_per_token_s: float = DEFAULT_HOST_LOAD_PER_TOKEN_S,
        host_load_fixed_s: float = DEFAULT_HOST_LOAD_FIXED_S,
    ) -> None:
        host = (host_load_per_token_s, host_load_fixed_s)
        if not all(math.isfinite(x) and x >= 0 for x in host):
            raise ValueError("host_load_per_token_s and host_load_fixed_s must be >= 0")
        # 0 and 0: tier-blind (a host hit costs what a GPU hit costs)
        self._host_per_token, self._host_fixed = host
        numbers = (work_weight, tolerance_s, tolerance_rel, load_factor, decode_request_s,
                   hot_margin, exploit_ratio, affinity_factor, affinity_s,
                   affinity_max_s, private_hot_margin, full_usage, starve_share)  # fmt: skip
        if not all(math.isfinite(x) for x in numbers):
            raise ValueError("every parameter must be a finite number")
        if not all(isinstance(x, int) for x in (load_cap_floor, share_window, sibling_tokens)):
            raise ValueError("load_cap_floor, share_window and sibling_tokens must be integers")
        if work_weight < 0 or tolerance_s < 0 or tolerance_rel < 0 or decode_request_s < 0:
            raise ValueError("weights and tolerances must be >= 0")
        if load_factor < 1.0 or load_cap_floor < 1:
            raise ValueError("load_factor must be >= 1 and load_cap_floor >= 1")
        if hot_margin < 0 or private_hot_margin < 0 or share_window < 1:
            raise ValueError("hot margins must be >= 0 and share_window >= 1")
        if sibling_tokens < 0 or full_usage <= 0:
            raise ValueError("sibling_tokens must be >= 0 and full_usage > 0")
        if not 0 <= starve_share < 1:
            raise ValueError("starve_share must be in [0, 1)")
        self._starve_share = starve_share  # 0: off
        self._work_weight = work_weight
        self._tolerance_s = tolerance_s
        self._tolerance_rel = tolerance_rel
        self._load_factor = load_factor
        self._load_cap_floor = load_cap_floor
        self._decode_request_s = decode_request_s
        self._hot_margin = hot_margin
        self._private_hot_margin = private_hot_margin
        self._sibling_tokens = sibling_tokens
        self._full_usage = full_usage
        self._share_window = share_window
        if exploit_ratio < 0 or affinity_factor < 1.0 or affinity_s < 0 or affinity_max_s < 0:
            raise ValueError(
                "exploit_ratio, affinity_s, affinity_max_s must be >= 0, affinity_factor >= 1"
            )
        self._affinity_max_s = affinity_max_s
        self._exploit_ratio = exploit_ratio
        self._affinity_factor = affinity_factor
        self._affinity_s = affinity_s
        self._shares: dict[str, float] = {}  # worker id -> EWMA share of decisions
        self._touched: dict[str, int] = {}  # worker id -> the decision it was last offered
        self._decisions = 0  # decisions remembered so far, for the EWMA's warm-up
        # the fleet's rules found for the core's shortlist, for the same decision's select
        self._memo: tuple[FleetFigures, int, _FleetRules] | None = None
        # Lazy decay (:meth:`_remember_fleet`): while one fleet is offered decision after
        # decision, the true share of each of ``_lazy_ids`` is its ``_shares`` entry x
        # ``_scale`` (the product of the decays since); None: every entry is true
        self._lazy_ids: Sequence[str] | None = None
        self._scale = 1.0

    def estimate(self, worker: WorkerView, prompt_tokens: int) -> tuple[float, float]:
        """(estimated TTFT, this request's own prefill time) on ``worker``, in seconds."""
        # ``_Costs.of`` inlined: this runs for every candidate of every decision, and a
        # frozen dataclass per candidate cost more than the arithmetic (BENCHMARKS.md,
        # "Scale")
        cost = worker.cost
        per_token = cost.prefill_per_token_s
        per_token = DEFAULT_PER_TOKEN_S if per_token is None else per_token
        fixed = DEFAULT_FIXED_S if cost.prefill_fixed_s is None else cost.prefill_fixed_s
        pair = DEFAULT_PAIR_S if cost.prefill_pair_s is None else cost.prefill_pair_s
        step = DEFAULT_DECODE_STEP_S if cost.decode_step_s is None else cost.decode_step_s
        # ``b if b > a else a`` is ``max(a, b)`` (and ``b if b < a else a`` ``min(a, b)``),
        # written out: a builtin call per figure per candidate was a third of this
        engine = worker.engine_load
        queued_tokens = worker.queued_prefill_tokens
        waiting = worker.in_flight - worker.decoding_requests
        waiting = waiting if waiting > 0 else 0
        decoding = worker.decoding_requests
        if engine is not None:
            reported = engine.waiting_uncached_tokens or 0
            queued_tokens = reported if reported > queued_tokens else queued_tokens
            reported = engine.waiting_requests
            waiting = reported if reported > waiting else waiting
            reported = engine.running_requests
            decoding = reported if reported > decoding else decoding
        queue_s = waiting * fixed + (queued_tokens if queued_tokens > 0 else 0) * per_token
        decode_s = step + decoding * self._decode_request_s if decoding > 0 else 0.0
        matched = worker.matched_tokens
        matched = prompt_tokens if prompt_tokens < matched else matched
        matched = matched if matched > 0 else 0
        uncached = prompt_tokens - matched
        uncached = uncached if uncached > 1 else 1  # the engine always computes >= 1 token
        prefill_s = fixed + per_token * uncached + pair * uncached * (matched + uncached / 2)
        host = min(worker.matched_host_tokens, matched)
        if host > 0:  # loaded back from the host tier, overlapped with the compute
            prefill_s = max(prefill_s, self._host_fixed + self._host_per_token * host)
        return queue_s + decode_s + worker.setup_s + prefill_s, prefill_s

    def select(self, ctx: RouteContext) -> Decision:
        # Per-candidate passes are ``map`` over attribute getters where they can be (C
        # loops, BENCHMARKS.md "Scale": 256 candidates per decision); same values in the
        # same order as the generator expressions they replace, so the same decisions.
        candidates = ctx.candidates
        estimates: dict[str, float] = {}
        scores: dict[str, float] = {}
        prompt_tokens, work_weight = ctx.prompt_tokens, self._work_weight
        for w in candidates:
            estimate, own = self.estimate(w, prompt_tokens)
            estimates[w.id] = estimate
            scores[w.id] = estimate + work_weight * own
        if ctx.fleet is not None:
            return self._select_shortlisted(ctx, ctx.fleet, estimates, scores)
        self._settle()  # the shares as they are, for the rules over these candidates
        if len(candidates) == 1:
            return Decision(candidates[0].id, REASON_ONLY_CANDIDATE, estimates)
        private = self._private_holder(candidates, prompt_tokens)
        longest_anywhere = max(map(_MATCHED, candidates))
        eligible = self._within_load_cap(candidates, prompt_tokens, private, longest_anywhere)
        # eligible is a subsequence of candidates: all of them, the same private holder
        if len(eligible) != len(candidates):
            private = self._private_holder(eligible, prompt_tokens)
        fair = 1.0 / len(candidates)
        chosen, reason = self._pick(
            ctx, eligible, private, estimates, scores, longest_anywhere, fair, 1.0
        )
        self._remember(chosen, list(map(_ID, candidates)))
        return Decision(chosen, reason, estimates)

    def _select_shortlisted(
        self,
        ctx: RouteContext,
        fleet: FleetFigures,
        estimates: dict[str, float],
        scores: dict[str, float],
    ) -> Decision:
        """:meth:`select` over the core's shortlist of a large fleet: every figure read
        across candidates (mean in flight, fair share, the starving test, the private
        holder, the load cap's exclusions, the share memory) is the fleet's
        (:class:`_FleetRules`); estimates, scores and the pick are over the shortlist."""
        memo, self._memo = self._memo, None
        if memo is not None and memo[0] is fleet and memo[1] == ctx.prompt_tokens:
            rules = memo[2]
        else:
            rules = self._fleet_rules(fleet, ctx.prompt_tokens)
        candidates = ctx.candidates
        ids = fleet.ids
        private: WorkerView | None = None
        if rules.private is not None:  # in the shortlist (shortlist_hints)
            holder_id = ids[rules.private]
            private = next((w for w in candidates if w.id == holder_id), None)
        eligible = self._within_load_cap(
            candidates, ctx.prompt_tokens, private, rules.longest, rules
        )
        if len(eligible) != len(candidates) and (private is None or private not in eligible):
            # the private holder among the workers kept: over the shortlist's (it holds
            # the best matchers), as over every candidate's when the holder is kept
            private = self._private_holder(eligible, ctx.prompt_tokens)
        chosen, reason = self._pick(
            ctx, eligible, private, estimates, scores, rules.longest, rules.fair, rules.scale
        )
        self._remember_fleet(chosen, ids)
        return Decision(chosen, reason, estimates)

    def _pick(
        self,
        ctx: RouteContext,
        eligible: list[WorkerView],
        private: WorkerView | None,
        estimates: dict[str, float],
        scores: dict[str, float],
        longest_anywhere: int,
        fair: float,
        scale: float,
    ) -> tuple[str, str]:
        """Steps 2 and 3 over the candidates the load cap kept (``eligible``), with
        ``private`` the holder of a private prefix among them: the chosen worker's id and
        the reason. ``fair``: 1 / the number of candidates (every one, shortlisted or
        not); ``scale``: the lazy decay of their shares (1.0: none, ``_lazy_ids``)."""
        sticky = self._exploit(private, eligible, estimates)
        if sticky is not None:
            return sticky.id, _reason(sticky, longest_anywhere)
        if max(map(_MATCHED, eligible)) <= 0:
            eligible = _most_room(eligible)  # nobody holds it: a free slot beats a queue
        best = min(map(scores.__getitem__, map(_ID, eligible)))
        band = best + self._tolerance_s + self._tolerance_rel * best
        near = [w for w in eligible if scores[w.id] <= band]
        longest = max(w.matched_tokens for w in near)
        pool = [w for w in near if w.matched_tokens == longest]
        low = min(scores[w.id] for w in pool)
        if longest <= 0:  # a prompt nobody holds: the least loaded, then least used, near tie
            pool = [w for w in pool if scores[w.id] <= low + self._tolerance_s]
            fewest = min(w.in_flight for w in pool)
            pool = [w for w in pool if w.in_flight == fewest]
            stored, default = self._shares.get, fair / scale  # x 1.0, / 1.0: exact
            least = min(stored(w.id, default) * scale for w in pool)
            pool = [w for w in pool if stored(w.id, default) * scale <= least + 1e-9]
            low = min(scores[w.id] for w in pool)
        tied = [w for w in pool if scores[w.id] == low]
        chosen = tied[0] if len(tied) == 1 else ctx.rng.choice(tied)
        return chosen.id, _reason(chosen, longest_anywhere)

    def shortlist_hints(
        self, fleet: FleetFigures, prompt_tokens: int, limit: int
    ) -> ShortlistHints:
        """The workers a rule could pick that the core's shortlist (the best matchers,
        the least loaded) might leave out: the private holder over the whole fleet, and
        the ``limit`` starving workers with the fewest in flight (then the lowest share);
        equally loaded workers are taken lowest share first, as a cold prompt's tie goes.
        The fleet's rules are kept for :meth:`select` of the same decision."""
        rules = self._fleet_rules(fleet, prompt_tokens)
        self._memo = (fleet, prompt_tokens, rules)
        must = [] if rules.private is None else [rules.private]
        starving = rules.starving_workers
        if len(starving) > limit:
            starving = sorted(starving, key=rules.stored.__getitem__)
            starving.sort(key=fleet.in_flight.__getitem__)
            del starving[limit:]
        must.extend(starving)
        # in flight + half the share (< 1): equal counts lowest share first
        half = map((0.5 * rules.scale).__mul__, rules.stored)
        load_key = list(map(operator.add, fleet.in_flight, half))
        # holders of the same match: the least queue time first, as their scores go
        return ShortlistHints(must, load_key, (DEFAULT_FIXED_S, DEFAULT_PER_TOKEN_S))

    def _fleet_rules(self, fleet: FleetFigures, prompt_tokens: int) -> _FleetRules:
        """Rule 1's and step 2's figures over every candidate of ``fleet``: the load
        lines, the fair share, the starving test and its starving workers, the longest
        match and the private holder. C-level passes over the columns; one by one only
        the workers with no prefill queued (the starving test)."""
        ids, in_flight, matched = fleet.ids, fleet.in_flight, fleet.matched_tokens
        n = len(ids)
        total = sum(in_flight) + 1
        cap = max(math.ceil(self._load_factor * total / n), self._load_cap_floor)
        even = max(math.ceil(total / n), self._load_cap_floor)
        fair = 1.0 / n
        if self._lazy_ids is not None and ids != self._lazy_ids:
            self._settle()  # another fleet than the one the lazy decay follows
        scale = self._scale if self._lazy_ids is not None else 1.0
        # the shares as stored: x scale is the true share (an order they keep)
        stored = list(map(self._shares.get, ids, itertools.repeat(fair / scale)))
        floor = self._starve_share * fair / scale
        # nothing queued first (a C-level pass: few in a busy fleet), then below an even
        # load and below the floor one by one
        idle = itertools.compress(range(n), map((0).__ge__, fleet.queued_prefill_tokens))
        starving = [i for i in idle if in_flight[i] < even and stored[i] < floor]
        longest = max(matched)
        private = _private_index(matched, longest, self._exploit_ratio * max(1, prompt_tokens))
        sole = ids[matched.index(longest)] if longest > 0 and matched.count(longest) == 1 else None
        return _FleetRules(
            cap, even, fair, bool(starving), starving, longest, private, sole, stored, scale
        )

    def _exploit(
        self,
        holder: WorkerView | None,
        eligible: Sequence[WorkerView],
        estimates: dict[str, float],
    ) -> WorkerView | None:
        """``holder``, the worker of ``eligible`` holding a private prefix of the prompt
        (:meth:`_private_holder`), if its estimate is within ``affinity_factor`` x the
        best + ``affinity_s`` and ``affinity_max_s`` of it."""
        if holder is None:
            return None
        low = estimates[holder.id]
        best = min(map(estimates.__getitem__, map(_ID, eligible)))
        if low > self._affinity_factor * best + self._affinity_s:
            return None
        if low - best > self._affinity_max_s:
            return None
        return holder

    def _private_holder(self, pool: Sequence[WorkerView], prompt_tokens: int) -> WorkerView | None:
        """The one worker of ``pool`` holding the longest match, if its lead over every
        other worker's match is at least ``exploit_ratio`` of the prompt; else None (no
        match, or two workers hold it: a shared prefix, not a private one)."""
        holder: WorkerView | None = None
        longest = second = 0
        for w in pool:
            m = w.matched_tokens
            if m > longest:
                holder, longest, second = w, m, longest
            elif m == longest:
                holder, second = None, m
            elif m > second:
                second = m
        if holder is None or longest - second < self._exploit_ratio * max(1, prompt_tokens):
            return None
        return holder

    def _within_load_cap(
        self,
        candidates: Sequence[WorkerView],
        prompt_tokens: int,
        private: WorkerView | None,
        longest: int,
        fleet: _FleetRules | None = None,
    ) -> list[WorkerView]:
        """The candidates the bounded-load step keeps (all of them if it would keep none);
        ``private``: :meth:`_private_holder` of ``candidates``; ``longest``: the longest
        match on any candidate. With ``fleet`` (the core's shortlist of a large fleet),
        the load lines, fair share and starving test are the fleet's, not the
        candidates'."""
        scale = 1.0
        starving: bool | None = None  # found when first needed: most decisions need not
        sole: str | None = None  # the one holder of the longest match, if one
        look = fleet is None and longest > 0  # over the candidates: found when first needed
        if fleet is None:
            n = len(candidates)
            total = sum(map(_IN_FLIGHT, candidates)) + 1
            cap = max(math.ceil(self._load_factor * total / n), self._load_cap_floor)
            fair = 1.0 / n
            # the starving-worker rule's line: an even share of the requests in flight
            even = max(math.ceil(total / n), self._load_cap_floor)
        else:
            cap, even, fair, starving, scale, sole = (
                fleet.cap, fleet.even, fleet.fair, fleet.starving, fleet.scale, fleet.sole
            )  # fmt: skip
        hot = fair + self._hot_margin
        siblings = self._sibling_tokens
        # the true share: the stored one x the lazy decay (x 1.0 and / 1.0 are exact)
        stored, default = self._shares.get, fair / scale
        eligible = []
        for w in candidates:
            load = w.in_flight + 1
            crowded = load > cap
            if not crowded and load <= even and (longest <= 0 or w.matched_tokens == longest):
                if look:
                    look = False
                    matched = list(map(_MATCHED, candidates))
                    if matched.count(longest) == 1:
                        sole = candidates[matched.index(longest)].id
                if longest <= 0 or w.id == sole:
                    # a prompt nobody holds, or its one longest holder: at most an even load
                    eligible.append(w)
                    continue
            if crowded and self._memory_bound(w):
                continue  # crowded and queueing for KV: skipped whatever it holds
            elif w.matched_tokens > 0 and prompt_tokens - w.matched_tokens <= siblings:
                eligible.append(w)  # holds the whole prompt: a sibling adds no prefill there
            elif w is private:
                share = stored(w.id, default) * scale
                if not crowded or share <= fair + self._private_hot_margin:
                    eligible.append(w)
            else:
                share = stored(w.id, default) * scale
                if fair < share <= hot or (not crowded and share > fair):
                    if starving is None:
                        starving = self._starving(candidates, even, fair)
                    if starving:
                        continue  # above the fair share while a worker starves
                if not crowded or share <= hot:
                    eligible.append(w)
        return eligible or list(candidates)

    def _starving(self, candidates: Sequence[WorkerView], even: int, fair: float) -> bool:
        """Is a candidate with no prefill queued, below an even load (``even``), left
        below ``starve_share`` x the even share ``fair`` of the recent decisions? (Rule 1's
        starving worker; one still computing a long prompt is not starving.)"""
        floor = self._starve_share * fair
        shares = self._shares
        return any(
            w.in_flight < even and w.queued_prefill_tokens <= 0 and shares.get(w.id, fair) < floor
            for w in candidates
        )

    def _memory_bound(self, worker: WorkerView) -> bool:
        """The engine's last poll showed requests waiting while its KV was ``full_usage``
        full: they wait for running requests to finish, which the estimate does not see."""
        return self._kv_bound(worker.engine_load)

    def _kv_bound(self, engine: EngineLoad | None) -> bool:
        """:meth:`_memory_bound` of the engine's figures."""
        return (
            engine is not None
            and engine.waiting_requests > 0
            and engine.token_usage >= self._full_usage
        )

    def _remember(self, chosen: str, ids: Sequence[str]) -> None:
        """Record a choice among the candidates ``ids`` (every one, shortlisted or not)."""
        # Warm-up: until share_window decisions are seen, the shares are running means
        # over the decisions so far plus a fair prior worth one decision per candidate.
        # A plain EWMA starting at the fair share takes ~share_window/4 decisions to call
        # a worker hot, so a fresh gateway would send its first dozen requests of a shared
        # prefix all to one worker.
        self._decisions += 1
        alpha = max(1.0 / self._share_window, 1.0 / (self._decisions + len(ids) - 1))
        shares, fair, keep = self._shares, 1.0 / len(ids), 1.0 - alpha
        # every candidate's share * keep, in C-level passes (a few microseconds at 256)
        decayed = map(keep.__rmul__, map(shares.get, ids, itertools.repeat(fair)))
        shares.update(zip(ids, decayed, strict=False))  # as long as ids by construction
        shares[chosen] += alpha  # the chosen is a candidate: (share * keep) + alpha, as before
        touched = self._touched
        touched.update(dict.fromkeys(ids, self._decisions))
        # Only the candidates' shares move, so each model's workers (a request is offered
        # only those of its model) keep shares of their own model's decisions. Memory is
        # bounded by forgetting workers no decision offered for a long while (gone for
        # good), never those of another model that is merely quiet for a moment.
        if len(shares) > 4 * len(ids):
            stale = self._decisions - _FORGET_AFTER * self._share_window
            for wid in [k for k, seen in touched.items() if seen < stale]:
                del shares[wid], touched[wid]

    def _remember_fleet(self, chosen: str, ids: Sequence[str]) -> None:
        """:meth:`_remember` over a whole fleet (``ids``) in O(1) while the fleet stays
        the same: the shares of every worker decay by one common factor, so the decay is
        kept apart (``_scale``) and the chosen one's entry gains ``alpha / _scale``; the
        true share is entry x ``_scale``. Same shares as :meth:`_remember` up to float
        rounding. Another fleet, a decision over every candidate (:meth:`select`) or a
        factor below 1e-150 first applies the factor to the entries (:meth:`_settle`)."""
        alpha = max(1.0 / self._share_window, 1.0 / (self._decisions + len(ids)))
        scale = self._scale * (1.0 - alpha)
        if self._lazy_ids is None or ids != self._lazy_ids or scale < 1e-150:
            self._settle()  # (a factor this small: renormalised; 0: share_window 1)
            self._remember(chosen, ids)  # enters every id at its true share
            self._lazy_ids = ids
            return
        self._decisions += 1
        self._scale = scale
        self._shares[chosen] += alpha / scale

    def _settle(self) -> None:
        """Apply the lazy decay (:meth:`_remember_fleet`) to the entries: every share
        true again. The lazy fleet was offered every decision since: touched now."""
        ids = self._lazy_ids
        if ids is None:
            return
        scale, shares = self._scale, self._shares
        shares.update(zip(ids, map(scale.__rmul__, map(shares.__getitem__, ids)), strict=False))
        self._touched.update(dict.fromkeys(ids, self._decisions))
        self._lazy_ids = None
        self._scale = 1.0

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "work_weight": self._work_weight,
            "tolerance_s": self._tolerance_s,
            "tolerance_rel": self._tolerance_rel,
            "load_factor": self._load_factor,
            "load_cap_floor": self._load_cap_floor,
            "decode_request_s": self._decode_request_s,
            "hot_margin": self._hot_margin,
            "share_window": self._share_window,
            "exploit_ratio": self._exploit_ratio,
            "affinity_factor": self._affinity_factor,
            "affinity_s": self._affinity_s,
            "affinity_max_s": self._affinity_max_s,
            "private_hot_margin": self._private_hot_margin,
            "sibling_tokens": self._sibling_tokens,
            "full_usage": self._full_usage,
            "starve_share": self._starve_share,
            "host_load_per_token_s": self._host_per_token,
            "host_load_fixed_s": self._host_fixed,
        }
