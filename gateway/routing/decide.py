"""The synchronous phases of one routing decision, written once: views with the prefix
match → ``policy.select`` → record → lease → feedback.

Contract:
- No I/O, no clock of its own, no asyncio: every phase that needs the time takes ``now``.
  The live router (``gateway.routing.router``) calls these phases around what needs I/O
  (the slot gate's wait, sending, relaying, retries, aborts); the offline replay
  (``loadtests.replay.sim``) calls the very same phases on a virtual clock. A routing
  rule changed here changes both; a test holds the two drivers to the same decisions.
- Policy sets: the top-level one (swapped live by :meth:`RoutingCore.configure`) and, per
  ``models:`` entry with a policy of its own, that model's (static); the caller names
  the entry a request falls under (``gateway.routing.models``), the replay none.
- :meth:`RoutingCore.choose`: candidates (health-filtered by the caller) become
  :class:`~policies.base.WorkerView` s with this request's matched tokens — from the
  exact index for workers in exact mode, else from the approximate prefix index, matched
  only when the policy says it uses the match (``Policy.uses_prefix_match``) — and the
  policy selects among them. Embeddings hold no reusable cache: they go to the least
  loaded worker. One candidate and a policy that ignores the match: no policy call.
  The choice keeps the longest match on any candidate (``Choice.available_tokens``, the
  *available* of routing capture: ``docs/TELEMETRY.md``), None when no index was matched.
  Cache tiers (HiCache, issue 20): each view's ``matched_host_tokens`` is the part of
  its match believed on the worker's host tier: exact mode's from the ``CPU_PINNED``
  events (``ExactRequest.host_tokens``), the approximate index's from its host tier
  (``tiers``, set by the owner: ``PrefixIndex.device_blocks``); the policy prices it
  (``min_ttft``: a load back, between a GPU hit and a miss). Feedback hands the worker's
  ``cached_tokens_details`` (``CachedTiers``) to the index's tier estimate
  (``observe_tiers``).
  With a ``gate`` (slow start, ``gateway.workers.slow_start``) the policy sees the
  candidates it admits; available is still over every candidate.
- :meth:`RoutingCore.dispatch`: the prompt is recorded in the index under the chosen
  worker at dispatch, before the worker answers (so a burst sharing a prefix
  co-locates), and a :class:`~gateway.routing.lease.Lease` counts the request there;
  with ``chains`` (``gateway.routing.rehome.ChainLog``) the chain is logged there too,
  for a drain to re-home.
- :meth:`RoutingCore.feedback`: once the response is complete, the worker's reported
  cached tokens correct the index (or release the recording when it reported none),
  calibrate exact mode's fidelity, and the TTFT of a successful response calibrates the
  cost model. Health feedback (outlier detection) stays with the live router: it is
  about transport outcomes the replay does not model.

Candidate shortlist (large fleets, issue 22; :class:`Shortlist`): above
``Shortlist.above`` candidates (``policy.shortlist_above``, 64; 0 = never), for a policy
whose cross-candidate reads were checked (``cache_aware`` and ``min_ttft``:
``SHORTLISTED``; never one that pins by routing key, whose pin only the policy knows, nor
with a shadow or arm outside that set), views are built and the policy called for a
shortlist only. The core first reads every candidate's figures into columns
(:class:`~policies.base.FleetFigures`: ids, in flight, queued prefill, match, engine
load; C-level passes over counters, no view), asks the policy for hints
(``Policy.shortlist_hints``: candidates it must see, and the order of equally loaded
ones), and keeps: every candidate whose match is at least ``match_fraction`` of the
longest on any candidate (the index's and exact mode's figures, before any view; at most
``max_matchers`` of them, the longest matches first, then the least loaded, or the
least queue time by the policy's ``matcher_cost``; equal ones by its load key), the
``least_loaded`` candidates with the fewest requests in flight (the views' ``in_flight``:
this gateway's and its peers'; or by the policy's load key, which orders equal counts;
else equal counts from a point that moves by one each decision, so equal workers take
turns) and as many with the least
queued prefill (the larger of the gateway's count and the engine's
``waiting_uncached_tokens``; ties from the moving point), the one with the most in
flight, and the policy's must-sees. In fleet order. The policy gets the columns too
(``RouteContext.fleet``). Which one it picks: the same as over every candidate when its
pick is in the shortlist and the figures it reads across candidates are those of the
fleet. ``cache_aware``'s (the longest match and its holders up to ``max_matchers``, the
lowest and highest load) are by construction; ``min_ttft`` reads its load lines, fair
share, starving test, longest match and private holder from the columns, and its share
memory decays over every candidate (``policies/min_ttft.py``, "Large fleets", for what
can still differ: a left-out worker with a lower score than every shown one). During a
slow-start ramp (``gate``, while ``active``) the gate admits over every candidate first,
with the same draws as without a shortlist, and the shortlist and the columns are of the
admitted (after it, the columns counted the ramping workers it then dropped: a joiner
below half the fair share made the starving rule bind for a worker no request could
reach, and its share decayed each decision; routing capture's available stays over
every candidate).
Random ties among more equally loaded workers than the shortlist holds fall among those
it holds. ``Choice.left_out`` counts the candidates left out (the decision record's
candidates are the shortlist's); routing capture's *available* is unchanged (the
longest match is always in the shortlist). At or below the threshold nothing changes.

Cost: one index match (O(w log n)) and one policy call per decision; nothing allocated
per candidate beyond its view, and nothing per candidate outlives the decision: the
views are dropped at dispatch (``Choice.views``), once the decision record (made
between ``choose`` and ``dispatch``, live and in the benches) has copied what it keeps.
"""

from __future__ import annotations

import itertools
import logging
import operator
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gateway.forward.relay import CachedTiers
from gateway.routing.lease import Lease
from gateway.routing.policy_set import PolicySet, ShadowPick
from gateway.routing.request import ApiKind, RouteRequest
from gateway.routing.tokens import TokenAccounting
from gateway.workers.registry import Worker, fleet_columns, views_of
from policies.base import (
    Decision,
    FleetFigures,
    Policy,
    RouteContext,
    WorkerCost,
    WorkerView,
    least_loaded,
)

log = logging.getLogger(__name__)
_MATCHED = operator.attrgetter("matched_tokens")
_ID = operator.attrgetter("id")
_IN_FLIGHT = operator.attrgetter("in_flight")
_PEER_IN_FLIGHT = operator.attrgetter("peer_in_flight")
_QUEUED = operator.attrgetter("queued_prefill_tokens")
_PEER_QUEUED = operator.attrgetter("peer_queued_prefill_tokens")
_ENGINE = operator.attrgetter("engine_load")
_UNCACHED = itertools.repeat("waiting_uncached_tokens")
_ZERO = itertools.repeat(0)
_NO_COST = WorkerCost()

# Policies whose reads across the candidates were checked for the shortlist (module
# contract, "Candidate shortlist"); any other sees every candidate. ``min_ttft`` reads
# its cross-candidate figures from ``RouteContext.fleet`` (over the shortlist alone its
# tail was 3x the full fleet's: BENCHMARKS.md, "Scale").
SHORTLISTED: frozenset[str] = frozenset({"cache_aware", "min_ttft"})


@dataclass(frozen=True, slots=True)
class Shortlist:
    """Which candidates a policy sees in a large fleet (module contract)."""

    above: int = 64  # shortlist only above this many candidates; 0 = never
    least_loaded: int = 16  # the fewest in flight, and as many with the least queued
    match_fraction: float = 0.5  # of the longest match: a match kept from this length
    max_matchers: int = 32  # at most this many matching candidates (0: every one)

    def __post_init__(self) -> None:
        if self.above < 0 or self.least_loaded < 1 or self.max_matchers < 0:
            raise ValueError("shortlist: above and max_matchers >= 0, least_loaded >= 1")
        if not 0.0 < self.match_fraction <= 1.0:
            raise ValueError("shortlist: match_fraction must be within (0, 1]")


class PrefixMatcher(Protocol):
    """What the core needs of the prefix index (``gateway.routing.prefix_index``)."""

    def match(self, block_hashes: Sequence[int]) -> Mapping[str, int]: ...
    def record(
        self,
        block_hashes: Sequence[int],
        worker_id: str,
        now: float | None = None,
        *,
        held: int | None = None,
    ) -> None: ...
    def correct(
        self,
        worker_id: str,
        block_hashes: Sequence[int],
        predicted_blocks: int,
        reported_tokens: int,
        now: float | None = None,
    ) -> Any: ...
    def release(
        self, worker_id: str, block_hashes: Sequence[int], now: float | None = None
    ) -> None: ...
    def free_sequences(self, worker_id: str) -> int | None: ...


class TierIndex(Protocol):
    """What the core needs of the approximate index's host tier (``PrefixIndex``)."""

    def tiered(self) -> Collection[str]: ...  # the workers with a host tier
    def device_blocks(self, worker_id: str, block_hashes: Sequence[int], matched: int) -> int: ...
    def observe_tiers(
        self,
        worker_id: str,
        predicted_device_blocks: int,
        predicted_host_blocks: int,
        reported_device_tokens: int,
        reported_host_tokens: int,
    ) -> None: ...


class ExactRequest(Protocol):
    """Exact mode's view of one request (``gateway.exact.request.ExactRequest``)."""

    def match(self, worker_ids: Sequence[str]) -> Mapping[str, int]: ...
    def host_tokens(self) -> Mapping[str, int]: ...  # of the last match, on the host tier
    def dispatched(self, worker_id: str) -> None: ...
    def mode(self, worker_id: str) -> str: ...
    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None: ...


class ChainRecorder(Protocol):
    """The chains dispatched per worker, for drains that re-home them
    (``gateway.routing.rehome.ChainLog``)."""

    def dispatched(self, worker_id: str, req: RouteRequest, now: float, matched: int) -> None: ...


class CandidateGate(Protocol):
    """Which candidates a policy sees in one decision (``gateway.workers.slow_start``)."""

    @property
    def active(self) -> bool: ...  # a worker ramps (else ``admit`` keeps every view)
    def admit(
        self, views: Sequence[WorkerView], now: float, rng: random.Random
    ) -> Sequence[WorkerView]: ...


class CostSource(Protocol):
    """What the core needs of the cost model (``gateway.routing.cost_model.CostModel``)."""

    def observe(
        self, worker_id: str, uncached_tokens: int, queued_tokens_ahead: int, ttft_s: float
    ) -> Any: ...
    def cost(self, worker_id: str) -> WorkerCost: ...


@dataclass(slots=True)
class Choice:
    """One decision: the worker, the policy's decision and what it was chosen from."""

    worker: Worker
    decision: Decision
    # the candidates as the policy saw them; emptied by ``RoutingCore.dispatch``: the
    # decision record (made before, ``DecisionRecord.from_decision``) copies what it
    # keeps, and views held by every in-flight request until its end were the cyclic
    # garbage collector's main load at 256 workers (BENCHMARKS.md, "Scale")
    views: list[WorkerView]
    predicted_blocks: int  # the approximate index's matched blocks on ``worker``
    matched_tokens: int  # this request's prefix believed cached on ``worker``
    indexed: bool  # matched and recorded in the prefix index (decided once, at choice)
    policy: Policy  # the policy that routed it (the live one, or arm B's)
    arm: str | None = None  # A/B arm; None without a split
    shadows: tuple[ShadowPick, ...] = ()
    estimated_ttft_s: float | None = None  # of ``worker``, when shadows are compared
    index_mode: str | None = None  # exact mode's mode for ``worker``, set at dispatch
    # the longest match on any candidate (routing capture's *available*); None when no
    # index was consulted (a policy set that ignores the match, or nothing to hash)
    available_tokens: int | None = None
    # of ``matched_tokens``, the part believed on ``worker``'s host tier (HiCache)
    matched_host_tokens: int = 0
    # the approximate index's host part of ``predicted_blocks`` (None: the match on
    # ``worker`` came from exact mode's events, or the core reads no tiers)
    predicted_host_blocks: int | None = None
    # candidates left out of ``views`` by the shortlist (module contract; 0: none)
    left_out: int = 0


TtftEstimate = Callable[[WorkerView, int], float]  # (view, prompt tokens) -> seconds


class RoutingCore:
    """The decision phases over a policy set, a prefix index and a cost model."""

    def __init__(
        self,
        policy: Policy | PolicySet,
        index: PrefixMatcher,
        costs: CostSource,
        rng: random.Random,
        tokens: TokenAccounting | None = None,
        ttft_estimate: TtftEstimate | None = None,
        model_policies: Mapping[str, PolicySet] | None = None,
    ) -> None:
        self.policies = policy if isinstance(policy, PolicySet) else PolicySet(policy)
        # per ``models:`` entry name, its own set (static: ``configure`` swaps the top one)
        self.model_policies: Mapping[str, PolicySet] = dict(model_policies or {})
        self.index = index
        self.costs = costs
        self.rng = rng
        self.tokens = tokens
        self._ttft = ttft_estimate  # the common yardstick of shadow comparisons
        # the approximate index's host tier, set by the owner (None: every match is
        # believed on the GPU; exact mode's host parts are read all the same)
        self.tiers: TierIndex | None = None
        # set by the owner when drains re-home chains / joining workers ramp (None: off)
        self.chains: ChainRecorder | None = None
        self.gate: CandidateGate | None = None
        # large fleets: the candidates a policy sees (set by the owner from the config)
        self.shortlist = Shortlist()
        self._turn = 0  # where the shortlist's ties start, moved by one per shortlist
        self.shadow_failures: dict[str, int] = {}  # shadow policy -> selects that raised

    def configure(self, policies: PolicySet) -> None:
        """Swap the top-level policy set; requests already decided finish under their own.
        The per-model sets stay."""
        self.policies = policies

    def policies_for(self, model: str | None) -> PolicySet:
        """The set that routes requests under the ``models:`` entry ``model``
        (``gateway.routing.models``): its own, else (None, or no policy of its own) the
        top-level one."""
        if model is None or not self.model_policies:
            return self.policies
        return self.model_policies.get(model, self.policies)

    def estimate(self, req: RouteRequest) -> None:
        """Size the prompt in its model's tokens, as learnt from the workers' answers."""
        if self.tokens is not None:
            self.tokens.estimate(req)

    def choose(
        self,
        req: RouteRequest,
        workers: Sequence[Worker],
        now: float,
        exact: ExactRequest | None = None,
        model: str | None = None,
        setup_s: Mapping[str, float] | None = None,
    ) -> Choice:
        """Views of ``workers`` (non-empty) with this request's matches, and the policy's
        pick among them; ``model``: the ``models:`` entry it falls under (its policy set);
        ``setup_s``: per worker id, time before the request could start there (a LoRA
        adapter to load first)."""
        setup = setup_s or {}
        policies = self.policies_for(model)
        indexed = bool(req.block_hashes) and policies.uses_prefix_match
        matches: Mapping[str, int] = {}
        if indexed:
            matches = self.index.match(req.block_hashes)
        exact_tokens = exact.match([w.id for w in workers]) if exact is not None else {}
        arm, policy = policies.arm(req)
        tokens = self._tokens(req, matches, exact_tokens)
        left_out = 0
        fleet: FleetFigures | None = None
        above = self.shortlist.above
        gate, gated = self.gate, False
        available: int | None = None  # over every candidate, when the gate ran first
        if above and len(workers) > above and self._shortlists(policies, policy):
            if gate is not None and gate.active:  # slow start over every candidate first
                available = max(map(tokens.get, map(_ID, workers), _ZERO))
                workers, gated = self._admitted(gate, workers, tokens, now), True
            if len(workers) > above:
                fleet, queued = self._fleet(workers, tokens)
                shortlisted = self._shortlist(workers, fleet, queued, policy, req.prompt_tokens)
                left_out = len(workers) - len(shortlisted)
                workers = shortlisted
        views = views_of(workers, now, tokens, self.costs.cost, self.index.free_sequences, setup)
        host_blocks: dict[str, int] = {}
        if exact_tokens or (matches and self.tiers is not None and self.tiers.tiered()):
            if left_out:  # the host parts of the shortlist's matches only
                kept = set(map(_ID, workers))
                matches = {k: v for k, v in matches.items() if k in kept}
            views = self._tiers(req, views, matches, exact, exact_tokens, host_blocks)
        # routing capture's available is over every candidate (the shortlist holds the
        # longest match)
        every = views
        if gate is not None and not gated:  # slow start: the candidates the policy sees
            views = list(gate.admit(views, now, self.rng))
        decision = self._select(req, views, policy, self.rng, fleet)
        worker = next((w for w in workers if w.id == decision.worker_id), workers[0])
        view = next((v for v in views if v.id == worker.id), None)
        matched = 0 if view is None else view.matched_tokens
        choice = Choice(
            worker, decision, views, matches.get(worker.id, 0), matched, indexed, policy, arm
        )
        choice.left_out = left_out
        if (exact_tokens or host_blocks) and view is not None:
            choice.matched_host_tokens = view.matched_host_tokens
        if indexed and self.tiers is not None and worker.id not in exact_tokens:
            choice.predicted_host_blocks = host_blocks.get(worker.id, 0)
        if indexed or exact is not None:
            choice.available_tokens = max(map(_MATCHED, every)) if available is None else available
        if policies.shadows and req.kind is not ApiKind.EMBEDDINGS:
            self._shadows(req, choice, policies, fleet)
        return choice

    def _tokens(
        self,
        req: RouteRequest,
        matches: Mapping[str, int],
        exact_tokens: Mapping[str, int],
    ) -> dict[str, int]:
        """Matched tokens per worker id (candidates or not): exact mode's where it has
        them, else the approximate index's blocks in tokens; the tokens of a block count
        are computed once per distinct count (most holders match the same shared prefix)."""
        tokens: dict[str, int] = {}
        if matches:
            per_count: dict[int, int] = {}
            for wid, blocks in matches.items():
                t = per_count.get(blocks)
                if t is None:
                    t = per_count[blocks] = req.matched_tokens(blocks)
                tokens[wid] = t
        if exact_tokens:
            tokens.update(exact_tokens)  # exact mode's wins where it has a figure
        return tokens

    def _admitted(
        self, gate: CandidateGate, workers: Sequence[Worker], tokens: Mapping[str, int], now: float
    ) -> Sequence[Worker]:
        """The workers the slow-start gate admits, asked over every candidate in fleet
        order as without a shortlist (the same draws): views of ids and matches only."""
        match, cost = tokens.get, _NO_COST  # positional, one cost: built per candidate
        light = [WorkerView(w.id, 0, 0, 0, None, None, match(w.id, 0), 0, cost) for w in workers]
        kept = {v.id for v in gate.admit(light, now, self.rng)}
        return workers if len(kept) == len(workers) else [w for w in workers if w.id in kept]

    def _shortlists(self, policies: PolicySet, policy: Policy) -> bool:
        """Whether the policy (and every shadow that sees the same views) may be given
        a shortlist (module contract)."""
        return all(
            p.name in SHORTLISTED and not p.uses_routing_key for p in (policy, *policies.shadows)
        )

    @staticmethod
    def _fleet(
        workers: Sequence[Worker], tokens: Mapping[str, int]
    ) -> tuple[FleetFigures, list[int]]:
        """Every candidate's figures as columns (``policies.base.FleetFigures``): the
        views' in flight, queued prefill and match, the engine's last poll; and the
        queued prefill the shortlist orders by (the engine's where it reports more).
        Copies of the registry's columns when the candidates are its workers
        (``registry.FleetColumns``), else C-level passes over counters; no view."""
        columns = fleet_columns(workers)
        if columns is not None:
            ids = columns.ids
            figures = FleetFigures(
                ids,
                columns.in_flight[:],
                columns.queued[:],
                list(map(tokens.get, ids, itertools.repeat(0))),
                columns.engine[:],
            )
            return figures, columns.seen[:]
        ids = list(map(_ID, workers))
        figures = FleetFigures(
            ids,
            list(map(operator.add, map(_IN_FLIGHT, workers), map(_PEER_IN_FLIGHT, workers))),
            list(map(operator.add, map(_QUEUED, workers), map(_PEER_QUEUED, workers))),
            list(map(tokens.get, ids, itertools.repeat(0))),
            list(map(_ENGINE, workers)),
        )
        # the engine's queued prefill where it reports more than the gateway counts
        # (getattr's default for a worker not polled; a None figure: the slow way)
        reported = list(map(getattr, figures.engine_load, _UNCACHED, _ZERO))
        if None in reported:
            reported = [t or 0 for t in reported]
        return figures, list(map(max, figures.queued_prefill_tokens, reported))

    def _shortlist(
        self,
        workers: Sequence[Worker],
        fleet: FleetFigures,
        queued: Sequence[int],
        policy: Policy,
        prompt_tokens: int,
    ) -> list[Worker]:
        """The candidates a policy sees in a large fleet, in fleet order (module
        contract). Per candidate only counters and a dict lookup, no view; the picks are
        C-level sorts over index lists."""
        n = len(workers)
        settings = self.shortlist
        k = settings.least_loaded
        matched, loads = fleet.matched_tokens, fleet.in_flight
        hints = policy.shortlist_hints(fleet, prompt_tokens, k)
        # ties start at a point moving by one per shortlist: equal workers take turns
        start = self._turn % n
        self._turn += 1
        order = [*range(start, n), *range(start)]
        by_load: Sequence[float] = loads
        if hints is not None and hints.load_key is not None:  # equal loads: its order
            by_load = hints.load_key
        keep = set(sorted(order, key=by_load.__getitem__)[:k])
        keep.update(sorted(order, key=queued.__getitem__)[:k])
        keep.add(loads.index(max(loads)))  # the highest load (imbalance), the first such
        if hints is not None:
            keep.update(hints.must_see)
        best = max(matched)
        if best > 0:
            floor = settings.match_fraction * best
            holders = list(
                itertools.compress(order, map(floor.__le__, map(matched.__getitem__, order)))
            )
            cap = settings.max_matchers
            if cap and len(holders) > cap:  # the longest first, then the least loaded
                cost = None if hints is None else hints.matcher_cost
                holders.sort(key=by_load.__getitem__)  # equal loads: the policy's order
                if cost is not None:  # the policy's queue-time estimate (equal: as loaded)
                    per_request, per_token = cost
                    waits = map(per_request.__mul__, loads)
                    work = map(per_token.__mul__, queued)
                    holders.sort(key=list(map(operator.add, waits, work)).__getitem__)
                holders.sort(key=matched.__getitem__, reverse=True)
                del holders[cap:]
            keep.update(holders)
        return [workers[i] for i in sorted(keep)]

    def _tiers(
        self,
        req: RouteRequest,
        views: list[WorkerView],
        matches: Mapping[str, int],
        exact: ExactRequest | None,
        exact_tokens: Mapping[str, int],
        host_blocks: dict[str, int],
    ) -> list[WorkerView]:
        """``views`` with each one's host-tier part of its match (see "Cache tiers");
        ``host_blocks`` gets the approximate index's host blocks per worker. Only the
        workers with a match are looked at, and only views with a host part are copied."""
        hosts = dict(exact.host_tokens()) if exact is not None and exact_tokens else {}
        tiers = self.tiers
        if tiers is not None:
            tiered = tiers.tiered()
            for wid, blocks in matches.items():
                if wid in exact_tokens or wid not in tiered:
                    continue
                device = tiers.device_blocks(wid, req.block_hashes, blocks)
                if device < blocks:
                    host_blocks[wid] = blocks - device
                    hosts[wid] = req.matched_tokens(blocks) - req.matched_tokens(device)
        if not hosts:
            return views
        return [
            replace(v, matched_host_tokens=h) if (h := hosts.get(v.id, 0)) > 0 else v for v in views
        ]

    def _shadows(
        self,
        req: RouteRequest,
        choice: Choice,
        policies: PolicySet,
        fleet: FleetFigures | None = None,
    ) -> None:
        by_id = {v.id: v for v in choice.views}
        estimate = self._ttft
        if estimate is not None:
            choice.estimated_ttft_s = estimate(by_id[choice.worker.id], req.prompt_tokens)
        picks = []
        for shadow, rng in zip(policies.shadows, policies.shadow_rngs, strict=True):
            try:
                d = self._select(req, choice.views, shadow, rng, fleet)
            except Exception:  # a shadow never routes: its bug must not fail the request
                self._shadow_failed(shadow.name)
                continue
            view = by_id.get(d.worker_id, choice.views[0])
            est = None if estimate is None else estimate(view, req.prompt_tokens)
            agrees = view.id == choice.worker.id
            picks.append(
                ShadowPick(shadow.name, view.id, d.reason, view.matched_tokens, est, agrees)
            )
        choice.shadows = tuple(picks)

    def _shadow_failed(self, name: str) -> None:
        self.shadow_failures[name] = self.shadow_failures.get(name, 0) + 1
        if self.shadow_failures[name] in (1, 10, 100, 1000):  # logged, not per request
            log.exception("shadow policy %s failed (%d times)", name, self.shadow_failures[name])

    def _select(
        self,
        req: RouteRequest,
        views: Sequence[WorkerView],
        policy: Policy,
        rng: random.Random,
        fleet: FleetFigures | None = None,
    ) -> Decision:
        if req.kind is ApiKind.EMBEDDINGS:
            return Decision(least_loaded(views, rng).id, "load")
        if len(views) == 1 and not policy.uses_prefix_match:
            return Decision(views[0].id, "only_candidate")
        ctx = RouteContext(
            prompt_tokens=req.prompt_tokens,
            candidates=views,
            rng=rng,
            routing_key=req.routing_key,
            prompt_chars=req.prompt_chars,
            block_hashes=req.block_hashes,
            block_chars=req.block_chars,
            fleet=fleet,
        )
        return policy.select(ctx)

    def dispatch(
        self,
        req: RouteRequest,
        choice: Choice,
        now: float,
        exact: ExactRequest | None = None,
    ) -> Lease:
        """Record the prompt under the chosen worker and lease it the request. The
        choice's views are dropped here (``Choice.views``)."""
        worker = choice.worker
        choice.views = []
        if choice.indexed:
            # at dispatch: co-locate (the match seen: where deferred marks start)
            self.index.record(req.block_hashes, worker.id, now, held=choice.predicted_blocks)
            if self.chains is not None:
                self.chains.dispatched(worker.id, req, now, choice.predicted_blocks)
        if exact is not None:
            choice.index_mode = exact.mode(worker.id)
            exact.dispatched(worker.id)
        return Lease(worker, max(0, req.prompt_tokens - choice.matched_tokens))

    def feedback(
        self,
        req: RouteRequest,
        choice: Choice,
        lease: Lease,
        outcome: ResponseOutcome,
        now: float,
        exact: ExactRequest | None = None,
    ) -> None:
        """Learn from a complete response: index correction, exact-mode fidelity, cost."""
        wid = choice.worker.id
        reported = outcome.cached_tokens
        if self.tokens is not None and outcome.status == 200:
            self.tokens.observe(wid, req, outcome.prompt_tokens)
        if choice.indexed:
            if reported is not None:
                self.index.correct(wid, req.block_hashes, choice.predicted_blocks, reported, now)
            else:
                self.index.release(wid, req.block_hashes, now)
        if exact is not None and reported is not None and choice.index_mode is not None:
            exact.observe(wid, choice.index_mode, choice.matched_tokens, reported)
        tiers = reported_tiers(outcome)
        host = choice.predicted_host_blocks
        if tiers is not None and self.tiers is not None and host is not None:
            device = choice.predicted_blocks - host
            self.tiers.observe_tiers(wid, device, host, tiers.device, tiers.host)
        if outcome.ttft_s is not None and outcome.status == 200:
            known = reported if reported is not None else choice.matched_tokens
            uncached = max(0, req.prompt_tokens - known)
            self.costs.observe(wid, uncached, lease.queued_ahead, outcome.ttft_s)


def reported_tiers(outcome: ResponseOutcome) -> CachedTiers | None:
    """The worker's ``cached_tokens_details`` from an outcome that carries them
    (``relay.Outcome.cached_tiers``, the replay's), else None: read apart from the
    protocol, so that outcomes without tiers need not name them."""
    tiers = getattr(outcome, "cached_tiers", None)
    return tiers if isinstance(tiers, CachedTiers) else None


class ResponseOutcome(Protocol):
    """What a complete response told (``gateway.forward.relay.Outcome`` live, the worker
    model's figures in the replay)."""

    @property
    def status(self) -> int: ...
    @property
    def ttft_s(self) -> float | None: ...
    @property
    def cached_tokens(self) -> int | None: ...
    @property
    def prompt_tokens(self) -> int | None: ...
