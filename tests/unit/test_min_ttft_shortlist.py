"""``min_ttft`` over the routing core's shortlist of a large fleet (issue 22): its rules
read the fleet's figures (``RouteContext.fleet``), so where a rule decides (a private
holder kept or skipped, a starving worker, a hot shared prefix) the shortlisted decision
is the one over every candidate; the share memory's lazy decay keeps the shares; at or
below the threshold nothing changes (``test_candidate_shortlist``)."""

from __future__ import annotations

import math
import random

import pytest
from shortlist_fleet import chat_request, healthy_fleet, min_ttft_core

from gateway.routing.decide import Choice, RoutingCore
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import RouteRequest
from gateway.workers.registry import Worker
from policies.base import EngineLoad, FleetFigures, RouteContext, WorkerView
from policies.min_ttft import MinTtftPolicy

N = 120  # above the default threshold (64)


def _fleet(n: int, seed: int) -> list[Worker]:
    rng = random.Random(seed)
    fleet = healthy_fleet(n, 23000)
    for worker in fleet:
        worker.in_flight = 2 + rng.randrange(4)
        worker.queued_prefill_tokens = 200 * worker.in_flight + rng.randrange(50)
        worker.decoding_requests = rng.randrange(2)
    return fleet


_request = chat_request


def _cores(shares: dict[str, float]) -> list[tuple[RoutingCore, PrefixIndex, MinTtftPolicy]]:
    """Two cores with the same share memory: shortlisted above 64, and never."""
    return [min_ttft_core(above, shares) for above in (64, 0)]


def _both(
    shares: dict[str, float],
    workers: list[Worker],
    records: list[tuple[list[int], str]],
    req: RouteRequest,
) -> tuple[Choice, Choice]:
    choices = []
    for core, index, _ in _cores(shares):
        for hashes, wid in records:
            index.record(hashes, wid, 0.0, pin=False)
        choices.append(core.choose(req, workers, 10.0))
    shortlisted, full = choices
    assert shortlisted.left_out > 0 and full.left_out == 0
    return shortlisted, full


def _same(a: Choice, b: Choice) -> None:
    assert (a.worker.id, a.decision.reason) == (b.worker.id, b.decision.reason)


def _even_shares(workers: list[Worker]) -> dict[str, float]:
    return {w.id: 1.0 / len(workers) for w in workers}


def test_a_private_holder_keeps_its_conversation() -> None:
    workers = _fleet(N, 1)
    holder = workers[40]
    holder.in_flight = 6  # above an even load, below the cap
    shares = _even_shares(workers)
    shares[holder.id] = 3.0 / N  # hot-ish but under the private margin
    system = list(range(1, 33))
    records = [(system, w.id) for w in workers[::3]]
    records.append(([*system, *range(500, 540)], holder.id))
    a, b = _both(shares, workers, records, _request([*system, *range(500, 541)]))
    _same(a, b)
    assert a.worker is holder and a.decision.reason == "prefix_hit"


def test_a_crowded_private_holder_above_its_margin_is_skipped_as_over_every_worker() -> None:
    workers = _fleet(N, 2)
    holder = workers[70]
    holder.in_flight = 30  # crowded
    shares = _even_shares(workers)
    shares[holder.id] = 0.5  # far above 1/n + the private margin
    workers[5].in_flight, workers[5].queued_prefill_tokens = 0, 0  # the one least loaded
    history = list(range(900, 960))
    a, b = _both(shares, workers, [(history, holder.id)], _request([*history, 961], 200))
    _same(a, b)
    assert a.worker is not holder and a.decision.reason == "load"


def test_a_starving_worker_takes_a_shared_prefix_request() -> None:
    """Four holders of a system prompt above an even load and share; one worker left
    below half the fair share with nothing queued: the new session goes to it, shortlisted
    or not (over a shortlist's own figures the fair share is 1 / its length)."""
    workers = _fleet(N, 3)
    n = len(workers)
    holders = workers[10:14]
    starving = workers[90]
    shares = {w.id: 0.9 / (n - 5) for w in workers}
    for w in holders:
        w.in_flight, shares[w.id] = 5, 0.025  # above even (ceil(mean + 1/n)) and 1/n
    starving.in_flight, starving.queued_prefill_tokens, shares[starving.id] = 1, 0, 0.0005
    for w in workers[100:120]:  # fewer in flight than the starving one, but queued prefill
        w.in_flight, w.queued_prefill_tokens = 0, 0
    system = list(range(1, 65))
    records = [(system, w.id) for w in holders]
    a, b = _both(shares, workers, records, _request([*system, 7000, 7001], extra=200))
    _same(a, b)
    assert a.worker not in holders


def test_a_hot_crowded_holder_of_a_shared_prefix_is_skipped_as_over_every_worker() -> None:
    workers = _fleet(N, 4)
    hot = workers[20]
    hot.in_flight = 25  # crowded
    shares = _even_shares(workers)
    shares[hot.id] = 0.3  # above 1/n + hot_margin
    system = list(range(1, 65))
    others = workers[60:63]
    records = [(system, w.id) for w in (hot, *others)]
    a, b = _both(shares, workers, records, _request([*system, 8000], extra=100))
    _same(a, b)
    assert a.worker in others  # the prefix stays on a holder, not the hot one


def test_holders_under_the_fleets_load_cap_keep_a_shared_prefix() -> None:
    """Two holders of a prefix, hot (share above 1/n + hot_margin) at 8 in flight: the
    fleet's cap (mean about 6: cap 9) keeps them; the shortlist's own mean (its least
    loaded) would call them crowded and send the request elsewhere."""
    workers = _fleet(N, 6)
    for i, w in enumerate(workers):
        w.in_flight = 2 if i < 16 else 6 + i % 2
        w.queued_prefill_tokens = 100 + 150 * w.in_flight  # none idle: nobody starves
    shares = _even_shares(workers)
    holders = workers[50:52]
    for w in holders:
        w.in_flight, shares[w.id] = 8, 0.25
    total = sum(w.in_flight for w in workers) + 1
    assert math.ceil(1.5 * total / N) == 9  # not crowded at 8 + 1
    prefix = list(range(1, 121))
    records = [(prefix, w.id) for w in holders]
    a, b = _both(shares, workers, records, _request([*prefix, 9000], extra=300))
    _same(a, b)
    assert a.worker in holders and a.decision.reason == "prefix_hit"


def test_among_more_holders_than_the_shortlist_takes_the_least_queue_time_is_shown() -> None:
    """Every worker holds the prompt's prefix (more than max_matchers): the one with the
    lowest estimate has more in flight than most (they decode) but little queued; taken
    by queue time, not by in-flight count, it is shown and chosen, as over every worker."""
    workers = _fleet(N, 7)
    for i, w in enumerate(workers):
        w.in_flight, w.decoding_requests = 3 + i % 2, 0
        w.queued_prefill_tokens = 3000 + i
    for w in workers[:20]:  # little queued, but many waiting
        w.in_flight, w.queued_prefill_tokens = 9, 100
    best = workers[77]
    best.in_flight, best.decoding_requests, best.queued_prefill_tokens = 5, 4, 500
    prefix = list(range(1, 129))
    records = [(prefix, w.id) for w in workers]
    a, b = _both(_even_shares(workers), workers, records, _request([*prefix, 9100], extra=300))
    _same(a, b)
    assert a.worker is best


def test_a_kv_bound_holder_is_skipped_as_over_every_worker() -> None:
    workers = _fleet(N, 5)
    holder = workers[33]
    holder.in_flight = 30
    holder.engine_load, holder.load_read_at = EngineLoad(8, 3, None, 0.97), 9.0
    shares = _even_shares(workers)
    history = list(range(300, 380))
    a, b = _both(shares, workers, [(history, holder.id)], _request([*history, 381], 200))
    _same(a, b)
    assert a.worker is not holder


@pytest.mark.parametrize("seed", range(30))
def test_random_states_decide_as_over_every_worker(seed: int) -> None:
    """Unique lowest loads (no random tie among more equal workers than the shortlist
    holds), matches of a few lengths, uneven shares: the same worker and reason."""
    rng = random.Random(seed)
    workers = _fleet(N, 100 + seed)
    for i, w in enumerate(workers):
        w.in_flight = 2 + rng.randrange(8) if i != seed else 0
        w.queued_prefill_tokens = 0 if i % 11 == 0 else 300 * w.in_flight + i
    shares = {w.id: rng.choice((0.2, 0.8, 1.5, 4.0)) / N for w in workers}
    records = [(list(range(1, 1 + (i * 13) % 9 * 4)), w.id) for i, w in enumerate(workers)]
    req = _request(list(range(1, 1 + seed % 10 * 4)), extra=rng.choice((8, 400)))
    a, b = _both(shares, workers, records, req)
    _same(a, b)


def test_the_policy_reads_the_fleets_figures_not_the_shortlists() -> None:
    """Given the fleet's columns, a decision over a subset of the views is the one over
    every view when the subset holds the pick: load lines, fair share and starving test
    come from the fleet."""
    rng = random.Random(9)
    views = [
        WorkerView(f"w{i}", in_flight=rng.randrange(2, 9), queued_prefill_tokens=500 + i)
        for i in range(100)
    ]
    views[37] = WorkerView("w37", in_flight=0, queued_prefill_tokens=0)  # the least loaded
    fleet = FleetFigures(
        [v.id for v in views],
        [v.in_flight for v in views],
        [v.queued_prefill_tokens for v in views],
        [v.matched_tokens for v in views],
        [v.engine_load for v in views],
    )
    full, short = MinTtftPolicy(), MinTtftPolicy()
    for step in range(50):
        subset = [v for v in views if v.id == "w37" or int(v.id[1:]) % 7 == step % 7]
        want = full.select(RouteContext(3000, views, random.Random(step)))
        got = short.select(RouteContext(3000, subset, random.Random(step), fleet=fleet))
        assert got.worker_id == want.worker_id == "w37"
    short._settle()
    assert short._shares.keys() == full._shares.keys()
    assert all(math.isclose(short._shares[k], v, rel_tol=1e-9) for k, v in full._shares.items())
    assert short._touched == full._touched


def test_the_lazy_share_decay_matches_the_eager_one() -> None:
    """Decisions over one fleet of 100: the lazily decayed shares equal the eager ones
    (to rounding), through a renormalisation and a change of fleet; share_window 1 (no
    memory) too."""
    for window in (64, 1):
        ids = [f"w{i}" for i in range(100)]
        lazy, eager = MinTtftPolicy(share_window=window), MinTtftPolicy(share_window=window)
        rng = random.Random(window)
        for step in range(4000):
            fleet = ids if step < 3000 else ids[:90]
            chosen = fleet[rng.randrange(len(fleet))]
            lazy._remember_fleet(chosen, list(fleet))
            eager._remember(chosen, list(fleet))
            if step in (1000, 2999, 3999):
                lazy._settle()
                assert all(
                    math.isclose(lazy._shares[k], v, rel_tol=1e-9, abs_tol=1e-300)
                    for k, v in eager._shares.items()
                )
                assert lazy._touched == eager._touched
