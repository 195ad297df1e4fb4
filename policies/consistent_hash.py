"""Consistent hash with bounded load: affinity by routing key (session / user / tenant).

Algorithm: each candidate owns ``virtual_nodes`` points on a 64-bit hash ring (xxh3 of
``"<worker id>#<i>"``). A request with a routing key hashes the key onto the ring and
walks clockwise to the first worker whose in-flight count, with this request, stays
within ``ceil(load_factor * (total in flight + 1) / n)`` (Mirrokni et al., "Consistent
Hashing with Bounded Loads"): no worker goes above (1 + epsilon) times the mean. The
first worker on the walk is the key's owner (reason ``affinity``); a later one means the
owner was full (reason ``load``). Requests without a key go to the least-loaded worker
(in flight + engine waiting queue, ties at random).

The ring is rebuilt only when the candidate set changes (a few rings are cached, so a
retry that excludes one failed worker does not thrash). Removing a worker moves only the
keys it owned; adding one takes about 1/n of the keys.

Cost: O(log(n * virtual_nodes)) per request plus the walk (at most n distinct workers);
a rebuild is O(n * virtual_nodes * log). Trade-offs: deterministic, identical across
gateway replicas with no shared state, sessions stay put; but blind to prefixes shared
*across* keys (a common system prompt is recomputed on every worker), and with
``load_factor`` close to 1 affinity breaks often under skewed keys.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any, ClassVar

from xxhash import xxh3_64_intdigest

from policies.base import (
    REASON_AFFINITY,
    REASON_LOAD,
    REASON_ONLY_CANDIDATE,
    Decision,
    Policy,
    RouteContext,
    WorkerView,
)
from policies.least_load import worker_load

_RING_CACHE_SIZE = 4


class _Ring:
    __slots__ = ("owners", "points")

    def __init__(self, ids: frozenset[str], virtual_nodes: int) -> None:
        pairs = sorted(
            (xxh3_64_intdigest(f"{wid}#{i}".encode()), wid)
            for wid in ids
            for i in range(virtual_nodes)
        )
        self.points = [p for p, _ in pairs]
        self.owners = [w for _, w in pairs]


MAX_VIRTUAL_NODES = 10_000


class ConsistentHashPolicy(Policy):
    name: ClassVar[str] = "consistent_hash"
    uses_routing_key: ClassVar[bool] = True

    def __init__(self, virtual_nodes: int = 160, load_factor: float = 1.25) -> None:
        # an integer, and bounded: the ring holds virtual_nodes x workers points and is
        # rebuilt on the request path when the fleet changes
        if not isinstance(virtual_nodes, int) or not 1 <= virtual_nodes <= MAX_VIRTUAL_NODES:
            raise ValueError(f"virtual_nodes must be an integer in 1..{MAX_VIRTUAL_NODES}")
        if not math.isfinite(load_factor) or load_factor < 1.0:
            raise ValueError("load_factor must be finite and >= 1 (1 + epsilon)")
        self._virtual_nodes = virtual_nodes
        self._load_factor = load_factor
        self._rings: dict[frozenset[str], _Ring] = {}
        self.rebuilds = 0  # observable for tests and /debug

    def select(self, ctx: RouteContext) -> Decision:
        candidates = ctx.candidates
        scores = {w.id: float(w.in_flight) for w in candidates}
        if len(candidates) == 1:
            return Decision(candidates[0].id, REASON_ONLY_CANDIDATE, scores)
        if not ctx.routing_key:
            return Decision(_least_load(candidates, ctx).id, REASON_LOAD, scores)
        by_id = {w.id: w for w in candidates}
        ring = self._ring(frozenset(by_id))
        total = sum(w.in_flight for w in candidates) + 1
        cap = math.ceil(self._load_factor * total / len(candidates))
        start = bisect_right(ring.points, xxh3_64_intdigest(ctx.routing_key.encode()))
        seen: set[str] = set()
        size = len(ring.owners)
        for step in range(size):
            wid = ring.owners[(start + step) % size]
            if wid in seen:
                continue
            if by_id[wid].in_flight + 1 <= cap:
                return Decision(wid, REASON_AFFINITY if not seen else REASON_LOAD, scores)
            seen.add(wid)
            if len(seen) == len(by_id):
                break
        # unreachable with integer loads (the least loaded always fits); kept for safety
        return Decision(_least_load(candidates, ctx).id, REASON_LOAD, scores)

    def _ring(self, ids: frozenset[str]) -> _Ring:
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) >= _RING_CACHE_SIZE:
                self._rings.pop(next(iter(self._rings)))
            ring = _Ring(ids, self._virtual_nodes)
            self._rings[ids] = ring
            self.rebuilds += 1
        return ring

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "virtual_nodes": self._virtual_nodes,
            "load_factor": self._load_factor,
        }


def _least_load(candidates: Sequence[WorkerView], ctx: RouteContext) -> WorkerView:
    best = min(worker_load(w) for w in candidates)
    tied = [w for w in candidates if worker_load(w) == best]
    return tied[0] if len(tied) == 1 else ctx.rng.choice(tied)
