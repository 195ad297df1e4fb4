"""Decision records: why each request went where it went, kept in a bounded ring.

A :class:`DecisionRecord` is made by the router right after ``policy.select`` (from the
policy's :class:`~policies.base.Decision` and the candidates it saw) and added to the
:class:`DecisionLog`. Its :attr:`DecisionRecord.outcome` is filled in once the request
is over (status, TTFT, the worker's reported cached tokens, retries), so the ring shows
the prediction next to what the worker then reported. Routing capture per request
(``docs/TELEMETRY.md``): :attr:`DecisionRecord.available_tokens` (the longest match on
any candidate), :attr:`DecisionRecord.matched_tokens` (captured, at the chosen worker),
the outcome's ``reported_cached_tokens`` (delivered). Cache tiers (HiCache):
:attr:`DecisionRecord.matched_host_tokens` (of the match, the part believed on the
chosen worker's host tier) beside the outcome's ``reported_device_tokens`` /
``reported_host_tokens`` (the worker's ``cached_tokens_details``, when it answered them).

Contract: a record never holds prompt text, only counts, ids and scores. The log holds at
most ``capacity`` records; the oldest are dropped first. Both are used from the event
loop's thread only (no locking).
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, overload

from gateway.routing.policy_set import ShadowPick
from policies.base import Decision, WorkerView

DEFAULT_CAPACITY = 1024


class CandidateScore(NamedTuple):
    """One candidate as the policy saw it: matched prefix tokens and its score (if any).

    A record made by :meth:`DecisionRecord.from_decision` keeps its candidates as
    :class:`CandidateColumns` and builds these when read."""

    worker: str
    matched_tokens: int
    score: float | None = None
    matched_host_tokens: int = 0  # of matched_tokens, on its host tier (HiCache)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; a non-finite score becomes ``None``; ``matched_host_tokens``
        only when some of the match is on the host tier."""
        score = self.score if self.score is not None and math.isfinite(self.score) else None
        out = {"worker": self.worker, "matched_tokens": self.matched_tokens, "score": score}
        if self.matched_host_tokens:
            out["matched_host_tokens"] = self.matched_host_tokens
        return out


_ID = operator.attrgetter("id")
_MATCHED = operator.attrgetter("matched_tokens")
_HOST = operator.attrgetter("matched_host_tokens")


class CandidateColumns(Sequence[CandidateScore]):
    """The candidates of one decision as columns: a tuple of worker ids, one of matched
    tokens, one of scores (None: the policy gave none), one of host-tier tokens (None:
    all 0). A sequence of :class:`CandidateScore`, built when read.

    Why columns: the ring keeps 1,024 records, each with every candidate (256 at a large
    fleet). A :class:`CandidateScore` per candidate made a quarter of a million objects
    the cyclic garbage collector walked on every full collection (a named tuple is never
    untracked); four tuples of numbers and strings per record are untracked by the
    collector once it has seen them, and cost less to build (BENCHMARKS.md, "Scale")."""

    __slots__ = ("host", "matched", "scores", "workers")

    def __init__(
        self,
        workers: tuple[str, ...],
        matched: tuple[int, ...],
        scores: tuple[float | None, ...],
        host: tuple[int, ...] | None = None,
    ) -> None:
        if not len(workers) == len(matched) == len(scores) == len(host or workers):
            raise ValueError("candidate columns must have one entry per candidate")
        self.workers = workers
        self.matched = matched
        self.scores = scores
        self.host = host or None  # () of no candidate: no column either

    @classmethod
    def of(cls, views: Sequence[WorkerView], scores: Mapping[str, float]) -> CandidateColumns:
        """The columns of ``views`` with their ``scores`` (C-level passes only)."""
        workers = tuple(map(_ID, views))
        host: tuple[int, ...] | None = tuple(map(_HOST, views))
        if not any(host or ()):
            host = None
        return cls(workers, tuple(map(_MATCHED, views)), tuple(map(scores.get, workers)), host)

    def __len__(self) -> int:
        return len(self.workers)

    @overload
    def __getitem__(self, i: int) -> CandidateScore: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[CandidateScore, ...]: ...
    def __getitem__(self, i: int | slice) -> CandidateScore | tuple[CandidateScore, ...]:
        if isinstance(i, slice):
            return tuple(self)[i]
        host = 0 if self.host is None else self.host[i]
        return CandidateScore(self.workers[i], self.matched[i], self.scores[i], host)

    def __iter__(self) -> Iterator[CandidateScore]:
        host = self.host or (0,) * len(self.workers)
        for args in zip(self.workers, self.matched, self.scores, host, strict=True):
            yield CandidateScore(*args)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CandidateColumns | tuple | list):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CandidateColumns({tuple(self)!r})"


@dataclass(frozen=True, slots=True)
class DecisionOutcome:
    """What happened to the request after the decision."""

    status: int
    ttft_s: float | None = None
    reported_cached_tokens: int | None = None  # None: the worker did not report
    retries: int = 0
    duration_s: float | None = None
    reported_prompt_tokens: int | None = None  # the worker's usage.prompt_tokens
    output_tokens: int | None = None  # the worker's usage.completion_tokens
    # the worker's cached_tokens_details: of its cached tokens, on its GPU and loaded
    # from its host tier (HiCache); None: not reported
    reported_device_tokens: int | None = None
    reported_host_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "status": self.status,
            "ttft_s": self.ttft_s,
            "reported_cached_tokens": self.reported_cached_tokens,
            "reported_device_tokens": self.reported_device_tokens,
            "reported_host_tokens": self.reported_host_tokens,
            "retries": self.retries,
            "duration_s": self.duration_s,
            "reported_prompt_tokens": self.reported_prompt_tokens,
            "output_tokens": self.output_tokens,
        }


@dataclass(slots=True)
class DecisionRecord:
    """One routing decision. Mutable only in :attr:`outcome`, set once at the end."""

    time: float  # wall clock, seconds since the epoch
    request_id: str
    policy: str
    worker: str
    reason: str
    # as the policy saw them: ``CandidateColumns`` when made by ``from_decision``
    candidates: Sequence[CandidateScore]
    prompt_tokens: int = 0  # estimated
    matched_tokens: int = 0  # the chosen worker's predicted cached prefix
    model: str | None = None
    outcome: DecisionOutcome | None = None
    index_mode: str | None = None  # exact / approximate / degraded for the chosen worker
    slot_wait_s: float | None = (
        None  # held for a busy slot (``gateway.routing.slot_gate``), seconds
    )
    arm: str | None = None  # A/B arm (``gateway.routing.policy_set``); None without a split
    shadows: tuple[ShadowPick, ...] = ()  # what the shadow policies would have picked
    estimated_ttft_s: float | None = None  # of the pick, when shadows are compared
    # PD mode: ``worker`` is the prefill; the decode worker, its policy's reason and name
    decode: tuple[str, str, str] | None = None
    # the longest match on any candidate (``Choice.available_tokens``: routing capture's
    # *available*, ``matched_tokens`` its *captured*); None: no index was consulted
    available_tokens: int | None = None
    # of ``matched_tokens``, the part believed on the chosen worker's host tier (HiCache)
    matched_host_tokens: int = 0
    # candidates the routing core's shortlist left out (``Choice.left_out``; large fleets)
    left_out: int = 0

    @classmethod
    def from_decision(
        cls,
        *,
        request_id: str,
        policy: str,
        decision: Decision,
        candidates: Sequence[WorkerView],
        prompt_tokens: int,
        model: str | None = None,
        now: float | None = None,
    ) -> DecisionRecord:
        """Build a record from a policy's decision and the candidates it was given
        (copied: the record keeps no view)."""
        cands = CandidateColumns.of(candidates, decision.scores)
        try:
            i = cands.workers.index(decision.worker_id)
        except ValueError:  # not among them (a policy's bug): nothing matched there
            matched = host = 0
        else:
            matched = cands.matched[i]
            host = 0 if cands.host is None else cands.host[i]
        return cls(
            time=time.time() if now is None else now,
            request_id=request_id,
            policy=policy,
            worker=decision.worker_id,
            reason=decision.reason,
            candidates=cands,
            prompt_tokens=prompt_tokens,
            matched_tokens=matched,
            model=model,
            matched_host_tokens=host,
        )

    @property
    def match_ratio(self) -> float:
        """Predicted cached share of the prompt, in [0, 1]."""
        if self.prompt_tokens <= 0:
            return 0.0
        return min(1.0, self.matched_tokens / self.prompt_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, as served by ``/debug/decisions``."""
        return {
            "time": self.time,
            "request_id": self.request_id,
            "model": self.model,
            "policy": self.policy,
            "worker": self.worker,
            "reason": self.reason,
            "prompt_tokens": self.prompt_tokens,
            "matched_tokens": self.matched_tokens,
            "matched_host_tokens": self.matched_host_tokens,
            "available_tokens": self.available_tokens,
            "candidates": [c.to_dict() for c in self.candidates],
            "outcome": None if self.outcome is None else self.outcome.to_dict(),
        } | (
            ({} if self.index_mode is None else {"index_mode": self.index_mode})
            | ({} if self.slot_wait_s is None else {"slot_wait_s": self.slot_wait_s})
            | ({} if self.arm is None else {"arm": self.arm})
            | (
                {}
                if self.decode is None
                else {
                    "decode": {
                        "worker": self.decode[0],
                        "reason": self.decode[1],
                        "policy": self.decode[2],
                    }
                }
            )
            | (
                {}
                if not self.shadows
                else {
                    "shadows": [s.to_dict() for s in self.shadows],
                    "estimated_ttft_s": self.estimated_ttft_s,
                }
            )
            | ({} if not self.left_out else {"candidates_left_out": self.left_out})
        )


class DecisionSource(Protocol):
    """Anything that can list recent decisions, newest first."""

    def latest(self, limit: int) -> Sequence[DecisionRecord]:
        """At most ``limit`` records, newest first."""
        ...


class DecisionLog:
    """A bounded ring of :class:`DecisionRecord`, newest last internally."""

    __slots__ = ("_ring",)

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"decision log capacity must be >= 1, got {capacity}")
        self._ring: deque[DecisionRecord] = deque(maxlen=capacity)

    @property
    def capacity(self) -> int:
        """The most records kept."""
        maxlen = self._ring.maxlen
        assert maxlen is not None
        return maxlen

    def add(self, record: DecisionRecord) -> None:
        """Keep ``record``; drops the oldest when full. O(1)."""
        self._ring.append(record)

    def latest(self, limit: int) -> list[DecisionRecord]:
        """At most ``limit`` records, newest first."""
        return list(itertools.islice(reversed(self._ring), max(0, limit)))

    def __len__(self) -> int:
        return len(self._ring)
