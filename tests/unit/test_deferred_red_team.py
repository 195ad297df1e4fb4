"""Red team of deferred recording (``PrefixIndex.defer``) and the registry's load columns
(``registry.FleetColumns``): the two it found (a correction's gap the marks must not
skip; a decision doing the waiting recordings' bookkeeping through ``device_blocks`` for
workers with no host tier), fixed, and what was checked and holds."""

from __future__ import annotations

from shortlist_fleet import chat_request, min_ttft_core

from gateway.routing.decide import RoutingCore
from gateway.routing.lease import Lease
from gateway.routing.prefix_index import PrefixIndex
from gateway.workers.registry import HealthFlag, WorkerRegistry, fleet_columns
from policies.base import EngineLoad


def _h(tag: str, n: int) -> list[int]:
    return [hash((tag, i)) for i in range(n)]


def _fleet_of(n: int) -> WorkerRegistry:
    registry = WorkerRegistry(0.5, lambda: 0.0)
    for i in range(n):
        registry.add(f"http://10.9.0.{i}:30000", "sglang")[0].flags.clear()
    return registry


def _pair() -> tuple[PrefixIndex, PrefixIndex, list[int]]:
    """An index recording at once, and one deferring (its schedule only counted)."""
    scheduled: list[int] = []
    at_once = PrefixIndex(clock=lambda: 0.0)
    deferred = PrefixIndex(clock=lambda: 0.0)
    deferred.defer(lambda: scheduled.append(1))
    return at_once, deferred, scheduled


def test_mark_heals_a_corrected_gap_so_the_next_match_co_locates() -> None:
    """A correction that trims a chain cuts the blocks a sibling shares with it (the
    docstring's broken closure): worker ``w`` holds b0, not b1-b2, and b3-b9. Recording
    at once re-adds every block of the dispatched prompt; ``_mark``'s bisection alone
    lands past the gap (b3-b9 are held) and would mark only the new turn, so a match of
    the very prompt just dispatched there, before the flush, would stop at the gap (the
    next sibling in the same loop turn not co-located: ``w`` 1 block, not 12). The core
    passes the match its decision saw (``held``), where the marks start at the latest."""
    at_once, deferred, _ = _pair()
    b = _h("b", 10)
    sibling = [*b[:3], *_h("a", 2)]
    extended = [*b, *_h("turn", 2)]
    for ix in (at_once, deferred):
        ix.record(b, "w", now=0.0, pin=False)
        ix.record(sibling, "w", now=0.0, pin=False)
        ix.correct("w", sibling, len(sibling), 16, now=100.0)  # keeps 1 block of it
        ix.record(b[:2], "v", now=100.0, pin=False)  # a second holder of the root
    assert deferred.match(extended) == at_once.match(extended) == {"w": 1, "v": 2}
    for ix in (at_once, deferred):  # the dispatch, as RoutingCore.dispatch makes it
        ix.record(extended, "w", now=101.0, held=ix.match(extended).get("w", 0))
    assert at_once.match(extended) == {"w": 12, "v": 2}
    assert deferred.match(extended) == at_once.match(extended)


def test_a_decision_leaves_other_dispatches_bookkeeping_to_the_flush() -> None:
    """Live, ``core.tiers`` is the index (``gateway.app``), and ``choose`` asks
    ``device_blocks`` for every matched worker, which flushes first, even for workers
    with no host tier (whose answer no recording can change). So every decision with a
    match (a shared system prompt: nearly all) that runs before the ``call_soon`` turn
    does all waiting recordings' bookkeeping on its own path: the cost deferral was to
    take off the request's path lands on the next request's. (``loadtests.micro.decision``
    sets no tiers and flushes between decisions, so it never sees this.)"""
    core, index, _ = min_ttft_core(0, {})
    core.tiers = index  # as gateway.app
    scheduled: list[int] = []
    index.defer(lambda: scheduled.append(1))
    workers = list(_fleet_of(3))
    system = _h("system", 40)
    index.record(system, workers[0].id, now=0.0)
    index.flush()
    scheduled.clear()
    first = chat_request([*system, *_h("first", 200)])
    choice = core.choose(first, workers, 1.0)
    core.dispatch(first, choice, 1.0)
    assert len(index._pending) == 1 and scheduled == [1]  # waiting for the loop's turn
    second = chat_request([*system, *_h("second", 3)])
    core.choose(second, workers, 1.0)  # another request's decision, same turn
    assert index._pending, "the second decision did the first's index bookkeeping"


def test_device_blocks_of_a_worker_without_host_tier_need_no_flush() -> None:
    """The same, at the index: a worker with no host tier answers ``matched`` whatever
    the waiting recordings do, so ``device_blocks`` has no reason to flush for it."""
    _, ix, _ = _pair()
    chain = _h("c", 30)
    ix.record(chain, "w", now=1.0)
    assert ix.device_blocks("w", chain, 30) == 30
    assert ix._pending, "device_blocks flushed for a worker without a host tier"


def test_deferred_host_tier_and_reconfiguration_read_as_at_once() -> None:
    """Holds: HiCache's host tier, block-size and sequence-bound changes, tier reports
    and a forgotten worker's bit reused by a newcomer, interleaved with waiting
    recordings, read as recording at once did (every such call flushes first)."""
    at_once, deferred, _ = _pair()
    chains = [[*_h("root", 4), *_h(f"turn{i}", 6 + i)] for i in range(6)]

    def books(ix: PrefixIndex) -> list[object]:
        return [
            (w, ix.blocks(w), ix.stats(w), ix.tiers(w), ix.held_sequences(w))
            for w in ("a", "b", "c")
        ]

    for ix in (at_once, deferred):
        ix.set_capacity("a", 16 * 20)
        ix.set_host_capacity("a", 16 * 8)
        for i, c in enumerate(chains):
            ix.record(c, "a", now=float(i))
            ix.record(c[:5], "b", now=float(i))
        ix.correct("a", chains[0], len(chains[0]), 16 * len(chains[0]), now=7.0)
        ix.record(chains[1], "a", now=8.0)
        matched = ix.match(chains[2]).get("a", 0)
        ix.observe_tiers("a", ix.device_blocks("a", chains[2], matched), 0, 0, 16 * 4)
        ix.record(chains[3], "a", now=9.0)
        ix.set_block_tokens("a", 8.0)  # shrinks: evicts at once
        ix.record(chains[4], "b", now=10.0)
        ix.forget_worker("b")
        ix.record(chains[5], "c", now=11.0)  # takes b's bit while nothing waits
        ix.record(chains[2], "a", now=12.0)
        ix.set_capacity("a", None, max_sequences=2)  # bound: its blocks forgotten
        ix.record(chains[2], "c", now=13.0)
        ix.evict_idle(14.0, 2.5)
        assert books(ix) == books(at_once)
    deferred.flush()
    for c in chains:
        assert deferred.match(c) == at_once.match(c)


def test_columns_hold_in_panic_after_rejoin_and_with_ranks() -> None:
    """Holds: a fresh fleet (every worker unchecked: the panic list, in fleet order) is
    read from the columns and equals reading each worker; a worker removed and added
    again under its URL starts at zero whatever its old lease does; a draining worker,
    or one with DP ranks, makes the list the registry's no more (read one by one)."""
    registry = WorkerRegistry(0.5, lambda: 0.0)
    for i in range(5):
        registry.add(f"http://10.9.1.{i}:30000", "sglang")
    panic = registry.candidates()
    assert len(panic) == 5 and fleet_columns(panic) is not None
    stale = Lease(panic[1], 300)
    panic[2].engine_load = EngineLoad(1, 2, 900, 0.5)
    panic[3].peer_in_flight, panic[3].peer_queued_prefill_tokens = 2, 40
    registry.remove(panic[1].id)
    again = registry.add(panic[1].url, "sglang")[0]
    stale.release()  # the removed worker's late release
    workers = registry.candidates()
    assert again in workers and fleet_columns(workers) is not None
    figures, queued = RoutingCore._fleet(workers, {})
    assert (figures, queued) == RoutingCore._fleet(tuple(workers), {})
    assert figures.in_flight[workers.index(again)] == 0
    assert queued[workers.index(panic[2])] == 900
    workers[0].flags.add(HealthFlag.DRAINING)
    assert fleet_columns(registry.candidates()) is None
    workers[0].flags.discard(HealthFlag.DRAINING)
    workers[4].metadata.dp_size = 2
    assert registry.sync_ranks(workers[4])
    workers[4].ranks[0].in_flight = 3  # a rank's write: its own, in no column
    ranked = registry.candidates()
    assert fleet_columns(ranked) is None
    assert RoutingCore._fleet(ranked, {})[0].in_flight[4] == 3
