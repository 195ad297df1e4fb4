"""The registry's load columns (``registry.FleetColumns``, issue 22 "Scale"): whatever
writes the workers' counters (leases, peers' figures, polls), joins and removals, the
routing core's columns copied from them equal those read worker by worker."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.routing.decide import RoutingCore
from gateway.workers.registry import HealthFlag, Worker, WorkerRegistry, fleet_columns
from policies.base import EngineLoad, FleetFigures


def _read_one_by_one(
    workers: Sequence[Worker], tokens: dict[str, int]
) -> tuple[FleetFigures, list[int]]:
    """The core's columns from a candidate list that is not the registry's own (a tuple:
    never equal to its list), so every worker is read in turn."""
    return RoutingCore._fleet(tuple(workers), tokens)


def test_columns_follow_every_write_join_and_removal() -> None:
    rng = random.Random(7)
    registry = WorkerRegistry(0.5, lambda: 0.0)
    urls = [f"http://10.0.0.{i}:30000" for i in range(1, 40)]
    for url in urls[:20]:
        registry.add(url, "sglang")[0].flags.clear()
    for step in range(400):
        workers = list(registry)
        w = rng.choice(workers)
        what = rng.randrange(8)
        if what == 0:
            w.in_flight += 1
        elif what == 1:
            w.in_flight = max(0, w.in_flight - 1)
        elif what == 2:
            w.queued_prefill_tokens = rng.randrange(5000)
        elif what == 3:
            w.peer_in_flight, w.peer_queued_prefill_tokens = rng.randrange(3), rng.randrange(900)
        elif what == 4:
            uncached = rng.choice([None, 0, rng.randrange(9000)])
            w.engine_load = rng.choice([None, EngineLoad(1, 2, uncached, 0.3)])
        elif what == 5 and len(workers) < 39:
            added = next(u for u in urls if registry.find(u) is None)
            registry.add(added, "sglang")[0].flags.clear()
        elif what == 6 and len(workers) > 2:
            registry.remove(w.id)
        candidates = registry.candidates()
        tokens = {c.id: rng.randrange(4) * 16 for c in candidates if rng.random() < 0.5}
        assert fleet_columns(candidates) is not None, step
        assert RoutingCore._fleet(candidates, tokens) == _read_one_by_one(candidates, tokens)
    removed = next(iter(registry.candidates()))
    registry.remove(removed.id)
    removed.in_flight += 5  # a removed worker's late release touches no columns
    candidates = registry.candidates()
    assert RoutingCore._fleet(candidates, {}) == _read_one_by_one(candidates, {})


def test_a_filtered_candidate_list_is_read_worker_by_worker() -> None:
    registry = WorkerRegistry(0.5, lambda: 0.0)
    for i in range(6):
        worker = registry.add(f"http://10.0.1.{i}:30000", "sglang")[0]
        worker.flags.clear()
        worker.in_flight = i
    sick = list(registry)[2]
    sick.flags.add(HealthFlag.CHECK_FAILED)
    candidates = registry.candidates()
    assert len(candidates) == 5 and fleet_columns(candidates) is None
    figures, queued = RoutingCore._fleet(candidates, {})
    assert figures.in_flight == [0, 1, 3, 4, 5] and queued == [0] * 5
    assert fleet_columns(registry.candidates(excluded=[sick.id])) is None


def test_data_parallel_ranks_keep_their_own_figures() -> None:
    registry = WorkerRegistry(0.5, lambda: 0.0)
    for i in range(3):
        registry.add(f"http://10.0.2.{i}:30000", "sglang")[0].flags.clear()
    first = next(iter(registry))
    first.metadata.dp_size = 2
    assert registry.sync_ranks(first)
    rank = first.ranks[1]
    rank.in_flight, rank.queued_prefill_tokens = 4, 70
    candidates = registry.candidates()  # the ranks are targets: not the registry's list
    assert len(candidates) == 4 and fleet_columns(candidates) is None
    figures, _ = RoutingCore._fleet(candidates, {})
    assert figures.in_flight == [0, 4, 0, 0]
    assert first.in_flight == 0  # a rank's counters are its own
