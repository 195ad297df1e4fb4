"""Red team of min_ttft over the routing core's shortlist of a large fleet (issue 22):
states a misbehaving worker, an operator or an unlucky fleet produce, each decided
shortlisted (above ``policy.shortlist_above``) and over every candidate, or checked
against the eager share memory."""

from __future__ import annotations

import random

from shortlist_fleet import chat_request, healthy_fleet, min_ttft_core

from gateway.routing.decide import Choice
from gateway.workers.registry import Worker
from gateway.workers.slow_start import SlowStart
from policies.base import FleetFigures, RouteContext, WorkerView
from policies.min_ttft import MinTtftPolicy


def _workers(n: int, port: int = 24000) -> list[Worker]:
    return healthy_fleet(n, port)


_request = chat_request


_core = min_ttft_core


def _same(a: Choice, b: Choice) -> None:
    assert (a.worker.id, a.decision.reason) == (b.worker.id, b.decision.reason)


def test_a_ramping_worker_the_gate_drops_does_not_starve_the_fleet() -> None:
    """Slow start drops a joining worker from the candidates the policy sees. Over every
    candidate it is then no candidate: not starving, its share not decayed. Shortlisted,
    the fleet's columns counted it: a joiner below half the fair share made the starving
    rule bind for every prompt some worker holds, and the holders of a shared system
    prompt (above the fair share, at light load) were skipped for a worker no request
    could reach."""
    workers = _workers(100)
    joiner = workers[99]
    shares = {w.id: 0.96 / 97 for w in workers}
    holders = workers[10:12]
    for w in workers:
        w.in_flight, w.queued_prefill_tokens = 1, 50  # light load, nobody idle
    for w in holders:
        shares[w.id] = 0.02  # above the fair share 0.01, below the hot line
    joiner.in_flight, joiner.queued_prefill_tokens = 0, 0
    shares[joiner.id] = 0.0  # below half the fair share, nothing queued
    system = list(range(1, 65))
    req = _request([*system, 7000], extra=40)
    choices = []
    for above in (64, 0):
        gate = SlowStart(window_s=1000.0, min_factor=0.0)  # drops it for now
        gate.begin(joiner.id)
        core, index, _ = _core(above, shares, gate)
        for w in holders:
            index.record(system, w.id, 0.0, pin=False)
        choices.append(core.choose(req, workers, 10.0))
        assert joiner.id not in [v.id for v in choices[-1].views]
    shortlisted, full = choices
    assert shortlisted.left_out > 0
    _same(shortlisted, full)
    assert full.worker in holders and full.decision.reason == "prefix_hit"


def test_more_holders_than_the_shortlist_takes_show_one_the_rules_keep() -> None:
    """Forty idle holders of a system prompt (more than ``max_matchers``, 32), equal
    queue times; a worker starves, so the holders above the fair share are skipped.
    Over every candidate the one holder below the fair share takes the request (a hit);
    shortlisted, equal holders were taken in fleet order, the 32 shown were all above
    the fair share and the request went to a non-holder (the prompt computed again).
    Equal holders are now taken by the policy's load key (lowest share first), as
    equally loaded workers are."""
    n = 100
    workers = _workers(n, port=24200)
    for w in workers:
        w.in_flight, w.queued_prefill_tokens = 0, 0
    shares = {w.id: 0.55 / n for w in workers}  # below fair, none starving
    holders = workers[60:]
    for w in holders:
        shares[w.id] = 2.0 / n  # above the fair share, below the hot line
    keeper = holders[-1]
    shares[keeper.id] = 0.6 / n  # below the fair share: kept while a worker starves
    starving = workers[30]
    shares[starving.id] = 0.0
    system = list(range(1, 33))
    req = _request([*system, 7100], extra=100)
    choices = []
    for above in (64, 0):
        core, index, _ = _core(above, shares)
        for w in holders:
            index.record(system, w.id, 0.0, pin=False)
        choices.append(core.choose(req, workers, 10.0))
    shortlisted, full = choices
    assert shortlisted.left_out > 0
    assert full.worker is keeper and full.decision.reason == "prefix_hit"
    _same(shortlisted, full)


def test_a_ramping_worker_the_gate_drops_keeps_its_share() -> None:
    """Decisions the gate kept a joiner out of do not decay its share, shortlisted or
    not (it decayed every decision shortlisted, so the joiner was soon starving)."""
    workers = _workers(100, port=24400)
    joiner = workers[0]
    for w in workers:
        w.in_flight, w.queued_prefill_tokens = 1, 50
    joiner.in_flight, joiner.queued_prefill_tokens = 0, 0  # shown: the least loaded
    shares = {w.id: 0.01 for w in workers}
    kept = []
    for above in (64, 0):
        gate = SlowStart(window_s=1000.0, min_factor=0.0)
        gate.begin(joiner.id)
        core, _, policy = _core(above, shares, gate)
        for i in range(80):
            choice = core.choose(_request([50_000 + i], extra=40), workers, 10.0)
            assert choice.worker is not joiner
        assert gate.dropped == 80
        policy._settle()
        kept.append(policy._shares[joiner.id])
    assert kept == [0.01, 0.01]


def _moved_conversation(n: int) -> tuple[list[WorkerView], dict[str, float]]:
    """Light load; a long conversation was moved once: ``w1`` holds it up to the turn
    before (2,800 tokens), ``w2`` up to this turn (2,950 of 3,050: a lead of 150, short
    of private), three others the system prompt; ``w{n-1}`` idle and starving; the
    holders above the fair share, far below the hot line."""
    fair = 1.0 / n
    views, shares = [], {}
    for i in range(n):
        match = {1: 2800, 2: 2950, 3: 256, 4: 256, 5: 256}.get(i, 0)
        idle = i == n - 1
        views.append(
            WorkerView(
                f"w{i}", in_flight=0 if idle else 1,
                queued_prefill_tokens=0 if idle else 100, matched_tokens=match,
            )
        )  # fmt: skip
        shares[f"w{i}"] = 0.2 * fair if idle else 1.2 * fair
    shares["w2"] = 1.3 * fair
    return views, shares


def test_a_moved_conversation_stays_on_its_one_holder_at_light_load() -> None:
    """The starving rule binds at any load for a prompt some worker holds part of
    (b4a4635: against holders of a shared system prompt taking every new session). Its
    one holder of the longest match, not private (an old copy of the conversation on
    another worker cuts its lead), was then skipped at light load too and the
    conversation sent to the idle worker, its 2,950 tokens computed again; it is spared
    up to an even load, as before that change. Over every candidate and shortlisted."""
    for n in (8, 100):
        views, shares = _moved_conversation(n)
        picks = []
        fleets: list[FleetFigures | None] = [None]
        if n > 64:
            fleets.append(
                FleetFigures(
                    [v.id for v in views], [v.in_flight for v in views],
                    [v.queued_prefill_tokens for v in views],
                    [v.matched_tokens for v in views], [v.engine_load for v in views],
                )
            )  # fmt: skip
        for fleet in fleets:
            policy = MinTtftPolicy()
            policy._shares, policy._decisions = dict(shares), 1000
            shown = views if fleet is None else [*views[:8], views[-1]]
            d = policy.select(RouteContext(3050, shown, random.Random(0), fleet=fleet))
            picks.append((d.worker_id, d.reason))
        assert set(picks) == {("w2", "prefix_hit")}, (n, picks)


def test_a_ramping_worker_left_out_of_the_shortlist_is_no_candidate_either() -> None:
    """A joiner the shortlist leaves out (as loaded as most, not the first most loaded)
    was still in the fleet's columns: counted in the fair share and load lines, its share
    decayed each decision though the gate would have dropped it, and its ramp did not
    start (the gate saw only the shortlist). The gate now admits over every candidate
    first, as without a shortlist."""
    workers = _workers(100, port=24600)
    joiner = workers[-1]
    for i, w in enumerate(workers):
        idle = 40 <= i < 60
        w.in_flight, w.queued_prefill_tokens = (0, 0) if idle else (1, 50)
    shares = {w.id: 0.01 for w in workers}
    kept, dropped = [], []
    for above in (64, 0):
        gate = SlowStart(window_s=1000.0, min_factor=0.0)
        gate.begin(joiner.id)
        core, _, policy = _core(above, shares, gate)
        for i in range(80):
            choice = core.choose(_request([60_000 + i], extra=40), workers, 10.0)
            assert joiner.id not in [v.id for v in choice.views]
        policy._settle()
        kept.append(policy._shares[joiner.id])
        dropped.append(gate.dropped)
    assert kept == [0.01, 0.01] and dropped == [80, 80]
