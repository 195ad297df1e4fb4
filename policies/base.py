"""The policy interface: what a policy sees of the fleet, and what it decides.

A policy is pure decision logic. ``select`` is synchronous, performs no I/O, and is
deterministic given its :class:`RouteContext` (randomness comes only from ``ctx.rng``).
The live gateway and the offline replay build the same context from their own state and
call the very same policy objects, so a result tuned offline reproduces live.

Every field a policy may read can be missing or stale (a worker that has not been polled
yet, a cost model that is not calibrated yet): policies fall back to sensible defaults
rather than fail.
"""

from __future__ import annotations

import operator
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

_IN_FLIGHT = operator.attrgetter("in_flight")

# Reasons a policy gives for a decision. Bounded set: they become metric labels.
REASON_PREFIX_HIT = "prefix_hit"
REASON_LOAD = "load"
REASON_IMBALANCE = "imbalance"
REASON_MISS = "miss"
REASON_AFFINITY = "affinity"
REASON_ROUND_ROBIN = "round_robin"
REASON_RANDOM = "random"
REASON_ONLY_CANDIDATE = "only_candidate"
REASONS: frozenset[str] = frozenset(
    {
        REASON_PREFIX_HIT,
        REASON_LOAD,
        REASON_IMBALANCE,
        REASON_MISS,
        REASON_AFFINITY,
        REASON_ROUND_ROBIN,
        REASON_RANDOM,
        REASON_ONLY_CANDIDATE,
    }
)


# EngineLoad and WorkerView are read-only by contract (nothing changes one once built)
# but not frozen: one of each is built per candidate per decision, and a frozen dataclass
# sets every field through ``object.__setattr__`` (1.8 and 1.0 us each on the benchmark
# machine against about 0.4 and 0.3 us: BENCHMARKS.md, "Scale"). Copy with
# ``dataclasses.replace``.


@dataclass(slots=True)
class EngineLoad:
    """The worker's own load figures, as last polled (``/v1/loads`` or ``/metrics``)."""

    running_requests: int = 0
    waiting_requests: int = 0
    waiting_uncached_tokens: int | None = None  # queued prefill work the engine reports
    token_usage: float = 0.0  # KV held by live requests / capacity, 0..1
    age_s: float = 0.0  # seconds since the figures were read


@dataclass(frozen=True, slots=True)
class WorkerCost:
    """A worker's latency model, calibrated online by the gateway from observed TTFTs.

    ``prefill_s(n) = fixed_s + per_token_s * n`` (+ the attention term, see
    ``prefill_pair_s``). ``None`` fields mean "not calibrated":
    policies then use their own defaults.
    """

    prefill_per_token_s: float | None = None
    prefill_fixed_s: float | None = None
    decode_step_s: float | None = None  # one decode step of the running batch
    # attention term of prefill: seconds per (new token x context token) pair, so that
    # prefill_s(n new over c cached) adds prefill_pair_s * n * (c + n / 2)
    prefill_pair_s: float | None = None


@dataclass(slots=True)
class WorkerView:
    """What a policy sees of one candidate worker, at decision time (read-only: see
    above)."""

    id: str
    in_flight: int = 0  # requests this gateway (or the gateway fleet) has in flight there
    queued_prefill_tokens: int = 0  # uncached prompt tokens dispatched, first token not yet seen
    decoding_requests: int = 0  # in-flight requests past their first token
    capacity_tokens: int | None = None  # KV capacity reported by the worker
    engine_load: EngineLoad | None = None
    matched_tokens: int = 0  # this request's prefix believed cached there
    # of ``matched_tokens``, the part believed on the worker's host tier (HiCache), which
    # the engine loads back over PCIe before the prefill rather than recomputes; the
    # rest is on the GPU. 0 when the gateway knows no host tier there (or is tier-blind).
    matched_host_tokens: int = 0
    cost: WorkerCost = field(default_factory=WorkerCost)
    # prompts it can still cache without evicting one, when a number of prompts (slots)
    # binds rather than tokens (llama.cpp); None: no such bound known
    free_sequences: int | None = None
    # seconds before this request could start there beyond its queue, e.g. loading the
    # LoRA adapter it names (read by policies whose ``weighs_setup`` is true)
    setup_s: float = 0.0


@dataclass(slots=True)
class FleetFigures:
    """Every candidate of a decision, as columns aligned with ``ids`` (fleet order), for a
    policy shown only a shortlist of them (``RouteContext.fleet``; the routing core's
    candidate shortlist, ``gateway.routing.decide.Shortlist``). Each column holds what
    the candidate's :class:`WorkerView` would: ``in_flight``, ``queued_prefill_tokens``
    (the gateway's count, not the engine's), ``matched_tokens`` (0 where none); and
    ``engine_load`` as last polled (its ``age_s`` is not set). Read-only by contract.
    Built from counters the core already reads, in C-level passes: no view, no object
    per candidate."""

    ids: Sequence[str]
    in_flight: Sequence[int]
    queued_prefill_tokens: Sequence[int]
    matched_tokens: Sequence[int]
    engine_load: Sequence[EngineLoad | None]


@dataclass(frozen=True, slots=True)
class ShortlistHints:
    """What a policy asks of the core's shortlist (:meth:`Policy.shortlist_hints`):
    ``must_see``, indices into the :class:`FleetFigures` of candidates to show it
    whatever their load or match; ``load_key``, per candidate (aligned), the key the
    least loaded are taken by (lowest first) in place of the in-flight count, ordering
    unequal counts as they are (e.g. the count plus a tie-break below 1; None: the count;
    equal keys: the core's rotating order); ``matcher_cost``, (seconds per request in
    flight, seconds per queued prefill token): when more candidates match than the
    shortlist takes, those with equal matches are taken lowest ``a x in flight + b x
    queued`` first (a queue-time estimate; None: fewest in flight first), equal ones by
    ``load_key``."""

    must_see: Iterable[int] = ()
    load_key: Sequence[float] | None = None
    matcher_cost: tuple[float, float] | None = None


@dataclass(frozen=True, slots=True)
class RouteContext:
    """Everything a policy may use to choose among ``candidates`` (non-empty)."""

    prompt_tokens: int  # estimated prompt length in tokens
    candidates: Sequence[WorkerView]
    rng: random.Random
    routing_key: str | None = None  # session / user / tenant affinity key, if any
    prompt_chars: int = 0  # length of the canonical prompt text
    # the prompt's chained block hashes and the characters per block, for a policy that
    # keeps its own record of prompts (the replay's reference rule of sglang-router)
    block_hashes: Sequence[int] = ()
    block_chars: int = 0
    # every candidate when ``candidates`` is the core's shortlist of a large fleet (the
    # policy's cross-candidate figures are then the fleet's); None: ``candidates`` are all
    fleet: FleetFigures | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's choice, with the reason and per-candidate scores for the decision record."""

    worker_id: str
    reason: str
    scores: Mapping[str, float] = field(default_factory=dict)


class Policy(ABC):
    """Chooses one worker among the candidates of a :class:`RouteContext`."""

    name: ClassVar[str]
    # Capabilities the router reads instead of branching on a policy's name.
    uses_prefix_match: ClassVar[bool] = False  # router fills WorkerView.matched_tokens
    uses_routing_key: ClassVar[bool] = False  # router extracts RouteContext.routing_key
    # weighs WorkerView.setup_s: the router may then offer workers that need a setup
    # (a LoRA adapter load) beside those that do not, and let the estimate decide
    weighs_setup: ClassVar[bool] = False

    @abstractmethod
    def select(self, ctx: RouteContext) -> Decision:
        """Return the chosen worker. Sync, no I/O, deterministic given ``ctx``."""

    def describe(self) -> dict[str, Any]:
        """The policy's name and parameters, for ``/debug`` and the decision record."""
        return {"name": self.name}

    def shortlist_hints(
        self, fleet: FleetFigures, prompt_tokens: int, limit: int
    ) -> ShortlistHints | None:
        """For a policy the core shortlists (``gateway.routing.decide.SHORTLISTED``):
        candidates its rules could pick that the core's shortlist might leave out, and
        the order of equally loaded ones; ``limit``: about how many more it may ask for.
        Called before :meth:`select` of the same decision, with the same ``fleet``."""
        return None


def least_loaded(candidates: Sequence[WorkerView], rng: random.Random) -> WorkerView:
    """The candidate with the fewest in-flight requests; ties broken at random."""
    best = min(map(_IN_FLIGHT, candidates))  # a C loop: per candidate per decision
    tied = [w for w in candidates if w.in_flight == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
