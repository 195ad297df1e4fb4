"""Slow start: a worker that joins the fleet ramps its share of new placements over a
window, as Envoy's slow start mode ramps a new host's weight.

Rule (composes with every policy, and with the routing core the replay shares): while a
target ramps, each decision keeps it among the candidates the policy sees with
probability ``f = max(min_factor, (elapsed / window_s) ** (1 / aggression))`` (Envoy's
time factor), drawn from the routing core's rng, so its share of the requests a policy
would have sent it grows from about ``min_factor`` to all of it. It is always kept when
it alone holds this request's longest prefix match among the candidates (a conversation
that landed there stays: the ramp slows new placements, it never breaks affinity), and when
dropping it would leave no candidate. When the window has passed the target leaves the
ramp for good (the state is gone: no cost afterwards); a decision with no target ramping
costs one truth test.

Which targets ramp: those :meth:`SlowStart.begin` names (a worker added at run time, by
``POST /workers`` or the replay's join), from the first decision that sees them among the
candidates (a worker still failing its first probe is not yet ramping). A worker's DP
ranks ramp with it (targets ``<worker>@dp<r>``). The workers the gateway starts with never
ramp. Envoy applies slow start to hosts returning from unhealthy too; here a worker that
recovers keeps its cache and does not ramp.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

from gateway.config.workerspec import split_target_id
from policies.base import WorkerView


class SlowStart:
    def __init__(self, window_s: float, aggression: float = 1.0, min_factor: float = 0.1) -> None:
        if window_s < 0 or aggression <= 0 or not 0.0 <= min_factor <= 1.0:
            raise ValueError("window_s ≥ 0, aggression > 0 and min_factor in 0..1 required")
        self.window_s = window_s
        self.aggression = aggression
        self.min_factor = min_factor
        self._pending: set[str] = set()  # named by begin, not yet seen as a candidate
        self._started: dict[str, float] = {}  # worker id -> start of its window
        self.kept = 0  # ramping candidates kept in a decision (by the draw)
        self.dropped = 0  # ramping candidates left out of a decision

    @property
    def active(self) -> bool:
        return bool(self._pending or self._started)

    def begin(self, worker_id: str) -> None:
        """``worker_id`` joined: it ramps from the first decision that sees it."""
        if self.window_s > 0:
            self._pending.add(worker_id)
            self._started.pop(worker_id, None)

    def forget(self, worker_id: str) -> None:
        self._pending.discard(worker_id)
        self._started.pop(worker_id, None)

    def factor(self, worker_id: str, now: float) -> float:
        """The share factor of ``worker_id`` (a target id) at ``now``: 1 when not
        ramping."""
        start = self._started.get(split_target_id(worker_id)[0])
        if start is None:
            return 1.0
        return time_factor(now - start, self.window_s, self.aggression, self.min_factor)

    def ramping(self, now: float) -> dict[str, float]:
        """Worker id -> seconds of its window left (pending ones: the whole window)."""
        out = {w: self.window_s for w in self._pending}
        for w, start in self._started.items():
            if now - start < self.window_s:
                out[w] = round(self.window_s - (now - start), 3)
        return out

    def admit(
        self, views: Sequence[WorkerView], now: float, rng: random.Random
    ) -> Sequence[WorkerView]:
        """The candidates a policy sees in this decision (module docstring)."""
        if not self._pending and not self._started:
            return views
        self._start_seen(views, now)
        if not self._started:
            return views
        # the longest match, and whether one candidate alone holds it
        first, second = _top_two(v.matched_tokens for v in views)
        kept: list[WorkerView] = []
        ramped: list[WorkerView] = []
        for v in views:
            f = self.factor(v.id, now)
            home = v.matched_tokens == first > second  # this request's cache is there alone
            if f >= 1.0 or home or rng.random() < f:
                kept.append(v)
                if f < 1.0:
                    self.kept += 1
            else:
                ramped.append(v)
        if not kept:  # never leave the policy without a candidate
            return views
        self.dropped += len(ramped)
        return kept

    def _start_seen(self, views: Sequence[WorkerView], now: float) -> None:
        if self._pending:
            for v in views:
                server = split_target_id(v.id)[0]
                if server in self._pending:
                    self._pending.discard(server)
                    self._started[server] = now
        for w in [w for w, s in self._started.items() if now - s >= self.window_s]:
            del self._started[w]  # the window has passed: the ramp ends for good


def _top_two(values: Iterable[int]) -> tuple[int, int]:
    first = second = 0
    for x in values:
        if x > first:
            first, second = x, first
        elif x > second:
            second = x
    return first, second


def time_factor(elapsed_s: float, window_s: float, aggression: float, min_factor: float) -> float:
    """Envoy's slow-start time factor alone (for reports and tests)."""
    if window_s <= 0 or elapsed_s >= window_s:
        return 1.0
    return max(min_factor, math.pow(max(0.0, elapsed_s) / window_s, 1.0 / aggression))
