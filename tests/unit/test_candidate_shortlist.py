"""The candidate shortlist of a large fleet (``gateway.routing.decide.Shortlist``, issue
22): above the threshold a checked policy (cache_aware, min_ttft) sees the best
matchers, the least loaded and the most loaded only, the choice says how many were left
out; at or below it (or turned off, or for a policy not checked) every candidate, and
the very same decisions. min_ttft's decisions against the full ones:
``test_min_ttft_shortlist``."""

from __future__ import annotations

import random

import pytest
from shortlist_fleet import chat_request, healthy_fleet

from gateway.routing.cost_model import CostModel
from gateway.routing.decide import Choice, RoutingCore, Shortlist
from gateway.routing.prefix_index import PrefixIndex
from gateway.workers.registry import Worker
from policies.base import EngineLoad
from policies.registry import create_policy


def _fleet(n: int, seed: int = 3) -> list[Worker]:
    rng = random.Random(seed)
    fleet = healthy_fleet(n, 21000)
    for i, worker in enumerate(fleet):
        worker.in_flight = 2 + rng.randrange(6)
        worker.queued_prefill_tokens = 500 + rng.randrange(4000)
        worker.decoding_requests = rng.randrange(2)
        if i % 3:
            worker.engine_load = EngineLoad(1, 1, 800 + rng.randrange(3000), 0.3)
            worker.load_read_at = 9.0
    return fleet


_request = chat_request


def _core(policy: str, shortlist: Shortlist | None = None) -> tuple[RoutingCore, PrefixIndex]:
    index = PrefixIndex(block_tokens=16.0, max_blocks_per_worker=100_000)
    core = RoutingCore(create_policy(policy), index, CostModel(), random.Random(0))
    if shortlist is not None:
        core.shortlist = shortlist
    return core, index


def _ids(choice: Choice) -> list[str]:
    return [v.id for v in choice.views]


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft"])
def test_the_shortlist_holds_the_best_matcher_and_the_least_loaded(policy: str) -> None:
    workers = _fleet(200)
    core, index = _core(policy)
    shared = list(range(1, 9))
    for w in workers[::2]:  # a shared prefix on every other worker
        index.record(shared, w.id, 0.0, pin=False)
    holder = workers[77]
    index.record([*shared, 100, 101, 102, 103, 104, 105], holder.id, 0.0, pin=False)
    idle = workers[150]
    idle.in_flight, idle.queued_prefill_tokens, idle.engine_load = 0, 0, None
    busiest = workers[10]
    busiest.in_flight = 40
    choice = core.choose(_request([*shared, 100, 101, 102, 103, 104, 105, 106]), workers, 10.0)
    ids = _ids(choice)
    assert holder.id in ids and idle.id in ids and busiest.id in ids
    assert choice.left_out == len(workers) - len(ids) > 100
    assert ids == [w.id for w in workers if w.id in set(ids)]  # fleet order
    assert choice.worker is holder  # its private history wins, as over every worker
    assert choice.available_tokens == choice.matched_tokens  # the longest, still
    # the 16 least loaded by in-flight count are all there (ties: some of the last level)
    cut = sorted(w.in_flight for w in workers)[15]
    assert all(w.id in ids for w in workers if w.in_flight < cut)
    assert sum(w.in_flight <= cut for w in workers if w.id in ids) >= 16


def test_a_shared_prefix_held_everywhere_keeps_the_least_loaded_holders() -> None:
    workers = _fleet(150)
    core, index = _core("cache_aware", Shortlist(above=64, least_loaded=4, max_matchers=10))
    shared = list(range(1, 30))
    for w in workers:
        index.record(shared, w.id, 0.0, pin=False)
    choice = core.choose(_request(shared), workers, 10.0)
    assert choice.left_out == 150 - len(choice.views)
    assert len(choice.views) <= 10 + 4 + 4 + 1
    lowest = min(w.in_flight for w in workers)
    assert choice.worker.in_flight == lowest  # the least loaded holder, as over all


@pytest.mark.parametrize("n", [8, 64])
@pytest.mark.parametrize("policy", ["min_ttft", "cache_aware"])
def test_at_or_below_the_threshold_nothing_changes(n: int, policy: str) -> None:
    runs = []
    for shortlist in (Shortlist(above=64), Shortlist(above=0)):
        workers = _fleet(n, seed=5)
        core, _ = _core(policy, shortlist)
        rng = random.Random(11)
        out = []
        for step in range(120):
            group = rng.randrange(6)
            hashes = [1000 * group + j for j in range(rng.randrange(1, 12))]
            choice = core.choose(_request(hashes), workers, 10.0 + step)
            out.append((choice.worker.id, choice.decision.reason, _ids(choice), choice.left_out))
            core.dispatch(_request(hashes), choice, 10.0 + step)
            choice.worker.in_flight += 1
            if step % 3 == 0:
                w = workers[rng.randrange(n)]
                w.in_flight = max(0, w.in_flight - 2)
        runs.append(out)
    assert runs[0] == runs[1]
    assert all(left == 0 and len(ids) == n for _, _, ids, left in runs[0])


@pytest.mark.parametrize("policy", ["round_robin", "consistent_hash", "least_load"])
def test_a_policy_not_checked_sees_every_candidate(policy: str) -> None:
    workers = _fleet(100)
    core, _ = _core(policy)
    choice = core.choose(_request([1, 2, 3]), workers, 10.0)
    assert len(choice.views) == 100 and choice.left_out == 0


def test_cache_aware_decides_as_over_every_candidate() -> None:
    """Unique lowest loads (no random tie): the shortlisted decision is the full one,
    imbalance, prefix hit and miss alike."""
    reasons = set()
    for seed in range(40):
        rng = random.Random(seed)
        picks = []
        for shortlist in (Shortlist(above=64), Shortlist(above=0)):
            workers = _fleet(120, seed=seed)
            for i, w in enumerate(workers):
                w.in_flight = 3 + rng.randrange(8) if i != seed else 1 + seed % 2
            workers[(seed * 7) % 120].in_flight = 80 if seed % 3 == 0 else 12
            core, index = _core("cache_aware", shortlist)
            for i, w in enumerate(workers):
                index.record(list(range(1, 1 + (i * 13) % 9)), w.id, 0.0, pin=False)
            choice = core.choose(_request(list(range(1, 1 + seed % 10))), workers, 10.0)
            picks.append((choice.worker.id, choice.decision.reason, choice.available_tokens))
            rng = random.Random(seed)
        assert picks[0] == picks[1], seed
        reasons.add(picks[0][1])
    assert reasons == {"imbalance", "prefix_hit", "miss"}


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        Shortlist(above=-1)
    with pytest.raises(ValueError):
        Shortlist(least_loaded=0)
    with pytest.raises(ValueError):
        Shortlist(match_fraction=0.0)
