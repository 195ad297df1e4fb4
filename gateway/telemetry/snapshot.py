"""Point-in-time view of the fleet that telemetry reads at scrape time.

Pull-style figures (in-flight, queued, health flags, engine load, prefix index size) are
not updated on the request path: the composition root hands telemetry a
:data:`SnapshotProvider`, a cheap synchronous callable that copies them out of the
registry and the prefix index whenever ``/metrics`` or ``/dashboard/data`` is read.

Contract: a snapshot lists exactly the workers currently in the registry. Telemetry uses
that list to drop the series of removed workers, so worker labels stay bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Health flags, each with its own source (ARCHITECTURE.md §4.4), named as
# ``gateway.workers.registry.HealthFlag`` values. Bounded: they are label values.
FLAG_UNCHECKED = "unchecked"  # added, first active probe not passed yet
FLAG_CHECK_FAILED = "check_failed"  # active probes failed
FLAG_EJECTED = "ejected"  # passive outlier ejection
FLAG_DRAINING = "draining"  # operator drain
HEALTH_FLAGS: tuple[str, ...] = (FLAG_UNCHECKED, FLAG_CHECK_FAILED, FLAG_EJECTED, FLAG_DRAINING)


@dataclass(frozen=True, slots=True)
class IndexFigures:
    """The prefix index's own figures for one worker (``PrefixIndex.stats``)."""

    blocks: int = 0
    approx_bytes: int = 0
    predicted_tokens: int = 0  # cached tokens the index predicted, cumulative
    reported_tokens: int = 0  # cached tokens the worker reported, cumulative
    chars_per_token: float | None = None  # learnt from the worker's answers (routing.tokens)


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One worker's live state. ``None`` engine figures mean "not polled yet"."""

    worker: str  # the worker id, as used in metric labels
    url: str = ""
    healthy: bool = True  # no health flag set
    health_flags: Mapping[str, bool] = field(default_factory=dict)  # flag -> set
    in_flight: int = 0  # requests leased by this gateway
    queued: int = 0  # in-flight requests still waiting for their first byte
    queued_prefill_tokens: int = 0  # uncached prompt tokens dispatched, first byte not seen
    engine_running: int | None = None
    engine_waiting: int | None = None
    engine_token_usage: float | None = None  # 0..1
    engine_age_s: float | None = None
    index: IndexFigures | None = None
    # exact / approximate / degraded (gateway.exact.manager); None: not reported
    index_mode: str | None = None
    index_mode_reason: str | None = None  # why it is in that mode, for an operator
    # (mode, requests, predicted, true predicted, reported) cached tokens, cumulative
    mode_fidelity: Sequence[tuple[str, int, int, int, int]] = ()
    role: str = "regular"  # PD mode: "prefill" or "decode" (sglang-router's worker_type)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for ``/dashboard/data`` and ``/debug/index``."""
        return {
            "worker": self.worker,
            "url": self.url,
            "healthy": self.healthy,
            "health_flags": {f: bool(self.health_flags.get(f, False)) for f in HEALTH_FLAGS},
            "in_flight": self.in_flight,
            "queued": self.queued,
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "engine_running": self.engine_running,
            "engine_waiting": self.engine_waiting,
            "engine_token_usage": self.engine_token_usage,
            "engine_age_s": self.engine_age_s,
            "index_mode": self.index_mode,
            "index_mode_reason": self.index_mode_reason,
            "role": self.role,
        }


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """All workers plus gateway-wide admission figures."""

    workers: Sequence[WorkerSnapshot] = ()
    # characters per token learnt per model (``""``: requests naming none), routing.tokens
    chars_per_token: Mapping[str, float] = field(default_factory=dict)
    policy: str | None = None
    admission_in_flight: int | None = None
    admission_queued: int | None = None
    admission_rejections: Mapping[str, int] | None = None  # reason -> count, cumulative


SnapshotProvider = Callable[[], FleetSnapshot]


def empty_snapshot() -> FleetSnapshot:
    """The snapshot of a gateway with no workers (the default provider)."""
    return FleetSnapshot()
