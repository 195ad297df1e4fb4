"""Cache tiers in the approximate index (issue 20): the host tier of a HiCache worker,
its device/host split of a match, and its corrections from ``cached_tokens_details``;
the routing core's views, choice and feedback; the host tier read from ``/server_info``."""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson
import pytest

from gateway.forward.relay import CachedTiers
from gateway.routing.cost_model import CostModel
from gateway.routing.decide import RoutingCore
from gateway.routing.hashing import block_hashes
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RequestSettings, RouteRequest, parse_request
from gateway.workers.registry import Worker
from gateway.workers.replies import host_tier_tokens, parse_server_info
from policies.base import Decision, Policy, RouteContext, WorkerView


def chain(label: str, blocks: int) -> list[int]:
    return block_hashes("".join(f"{label}{i:062d}\n" for i in range(blocks)))


def tiered(device_blocks: int, host_blocks: int, worker: str = "w") -> PrefixIndex:
    """An index whose worker holds ``device_blocks`` on its GPU and ``host_blocks`` more
    on its host tier (one token per block, so tokens and blocks are the same numbers)."""
    ix = PrefixIndex(block_tokens=1.0)
    ix.set_capacity(worker, device_blocks)
    ix.set_host_capacity(worker, host_blocks)
    return ix


def settle(ix: PrefixIndex, worker: str, hashes: list[int], t: float) -> None:
    """Record and complete one request (the engine unlocks its path)."""
    ix.record(hashes, worker, now=t)
    ix.correct(worker, hashes, 0, 0, now=t)


# --- the host tier: demotion, split, load back, bounds -----------------------------------


def test_device_eviction_demotes_to_the_host_tier_tail_first() -> None:
    ix = tiered(10, 20)
    a, b = chain("a", 8), chain("b", 8)
    settle(ix, "w", a, 1.0)
    settle(ix, "w", b, 2.0)  # 16 blocks on a 10-block GPU: a's 6 deepest go to the host
    assert ix.match(a) == {"w": 8} and ix.match(b) == {"w": 8}  # still held: a tier down
    assert ix.device_blocks("w", a, 8) == 2
    assert ix.device_blocks("w", b, 8) == 8
    assert ix.tiers("w") == (10, 6, 1.0)
    assert ix.stats("w").blocks == 16


def test_without_a_host_tier_eviction_forgets_as_before() -> None:
    ix = PrefixIndex(block_tokens=1.0)
    ix.set_capacity("w", 10)
    a, b = chain("a", 8), chain("b", 8)
    settle(ix, "w", a, 1.0)
    settle(ix, "w", b, 2.0)
    assert ix.match(a) == {"w": 2}
    assert ix.device_blocks("w", a, 2) == 2
    assert ix.tiers("w") == (10, 0, 1.0)


def test_the_host_tier_is_bounded_first_demoted_first_dropped() -> None:
    ix = tiered(10, 4)
    a, b = chain("a", 8), chain("b", 8)
    settle(ix, "w", a, 1.0)
    settle(ix, "w", b, 2.0)  # a's 6 deepest demoted, the host keeps 4: the 2 deepest go
    assert ix.match(a) == {"w": 6}
    assert ix.device_blocks("w", a, 6) == 2
    assert ix.tiers("w") == (10, 4, 1.0)


def test_a_recording_through_host_blocks_loads_them_back() -> None:
    ix = tiered(10, 20)
    a, b = chain("a", 8), chain("b", 8)
    settle(ix, "w", a, 1.0)
    settle(ix, "w", b, 2.0)
    settle(ix, "w", a, 3.0)  # a again: loaded back whole, b's tail demoted in turn
    assert ix.device_blocks("w", a, 8) == 8
    assert ix.device_blocks("w", b, 8) == 2
    assert ix.match(b) == {"w": 8}
    assert ix.tiers("w") == (10, 6, 1.0)


def test_a_pinned_recording_demotes_others_not_itself() -> None:
    ix = tiered(10, 20)
    a = chain("a", 8)
    settle(ix, "w", a, 1.0)
    b = chain("b", 8)
    ix.record(b, "w", now=2.0)  # in flight: pinned, as SGLang locks a running path
    assert ix.device_blocks("w", b, 8) == 8
    assert ix.device_blocks("w", a, 8) == 2


def test_a_shortfall_trims_host_blocks_too() -> None:
    ix = tiered(10, 20)
    a, b = chain("a", 8), chain("b", 8)
    settle(ix, "w", a, 1.0)
    settle(ix, "w", b, 2.0)
    ix.record(a, "w", now=30.0)
    ix.correct("w", a, 8, 3, now=30.0)  # the engine held 3 blocks of a, not 8
    assert ix.match(a) == {"w": 3}
    ix2 = tiered(10, 20)
    settle(ix2, "w", a, 1.0)
    settle(ix2, "w", b, 2.0)
    ix2.correct("w", a, 8, 3, now=30.0)  # a report without its recording: host blocks go
    assert ix2.match(a) == {"w": 3}
    assert ix2.tiers("w") == (10, 1, 1.0)  # a's third block stays on the host


def test_forget_and_idle_sweep_reach_the_host_tier() -> None:
    ix = tiered(10, 20)
    a, b = chain("a", 8), chain("b", 8)
    settle(ix, "w", a, 1.0)
    settle(ix, "w", b, 100.0)
    assert ix.evict_idle(now=200.0, max_idle_s=150.0) == 8  # a, on both tiers
    assert ix.match(a) == {} and ix.match(b) == {"w": 8}
    ix.forget_worker("w")
    assert ix.match(b) == {}
    ix.record(a, "v")  # the freed bit is reused cleanly
    assert ix.match(a) == {"v": 8}


def test_host_capacity_none_forgets_the_host_tier() -> None:
    ix = tiered(10, 20)
    a, b = chain("a", 8), chain("b", 8)
    settle(ix, "w", a, 1.0)
    settle(ix, "w", b, 2.0)
    ix.set_host_capacity("w", None)  # the worker restarted without HiCache
    assert ix.match(a) == {"w": 2}
    assert ix.tiers("w") == (10, 0, 1.0)
    with pytest.raises(ValueError):
        ix.set_host_capacity("w", -1)


def test_memory_stays_bounded_by_both_capacities() -> None:
    ix = tiered(10, 20)
    for i in range(50):
        settle(ix, "w", chain(f"c{i}", 7), float(i))
    device, host, _ = ix.tiers("w")
    assert (device, host) == (10, 20)
    assert ix.stats("w").blocks == 30


def test_random_traffic_keeps_the_tiers_disjoint_bounded_and_prefix_closed() -> None:
    """Records, completions, shortfalls, share moves and idle sweeps at random: each held
    block is in exactly one of pins, the LRU and the host tier, the holders' bits say
    the same, both bounds hold, and a match's device part is its leading blocks."""
    rng = random.Random(5)
    ix = tiered(40, 60)
    chains = [chain(f"c{i}", rng.randrange(3, 20)) for i in range(30)]
    inflight: list[list[int]] = []
    for step in range(600):
        t = float(step)
        op = rng.random()
        if op < 0.5:
            c = rng.choice(chains)
            ix.record(c, "w", now=t)
            inflight.append(c)
        elif op < 0.8 and inflight:
            c = inflight.pop(rng.randrange(len(inflight)))
            ix.correct("w", c, len(c), rng.choice([len(c), rng.randrange(len(c))]), now=t)
        elif op < 0.9:
            ix.observe_tiers("w", 30, 0, rng.randrange(0, 40), 10)
        else:
            ix.evict_idle(t, 150.0)
        state = ix._workers["w"]
        pins, lru, host = set(state.pins), set(state.lru), set(state.host)
        assert not (pins & lru or pins & host or lru & host)
        held = {h for h, mask in ix._holders.items() if mask & state.bit}
        assert held == pins | lru | host
        assert len(host) <= state.host_capacity
        assert len(lru) + len(pins) <= state.capacity or not lru
        for c in chains:
            m = ix.match(c).get("w", 0)
            d = ix.device_blocks("w", c, m)
            assert all(h not in host for h in c[:d])
            if not any(c[:m] == o[:m] for o in chains if o is not c):  # no sibling's cut
                assert all(h in host for h in c[d:m])


# --- approximate mode's corrections from cached_tokens_details ----------------------------


def test_a_shorter_device_hit_than_believed_shrinks_the_device_share() -> None:
    ix = tiered(100, 200)
    a, b = chain("a", 80), chain("b", 20)
    settle(ix, "w", a, 1.0)
    settle(ix, "w", b, 2.0)
    assert ix.device_blocks("w", a, 80) == 80
    for _ in range(10):  # believed 80 on the GPU; the engine found 20 there, 60 on host
        ix.observe_tiers("w", 80, 0, 20, 60)
    device, host, share = ix.tiers("w")
    assert 0.8 < share < 0.9  # 0.98 ** 10
    assert (device, host) == (82, 18)  # the GPU bound follows: a's tail demoted
    assert ix.device_blocks("w", a, 80) == 62


def test_a_longer_device_hit_grows_the_share_back_never_past_one() -> None:
    ix = tiered(100, 200)
    for _ in range(5):
        ix.observe_tiers("w", 80, 0, 20, 60)
    low = ix.tiers("w")[2]
    for _ in range(50):  # believed 40 device + 40 host; the engine had all 80 on its GPU
        ix.observe_tiers("w", 40, 40, 80, 0)
    assert ix.tiers("w")[2] == 1.0 > low


def test_reports_within_tolerance_or_without_a_host_tier_change_nothing() -> None:
    ix = tiered(100, 200)
    ix.observe_tiers("w", 80, 0, 70, 10)  # within the 25 % tolerance
    ix.observe_tiers("w", 80, 0, 80, 0)
    assert ix.tiers("w")[2] == 1.0
    plain = PrefixIndex(block_tokens=1.0)
    plain.set_capacity("w", 100)
    plain.observe_tiers("w", 80, 0, 0, 80)  # no host tier known: cached_tokens rule it
    assert plain.tiers("w")[2] == 1.0


# --- the routing core: views, choice, feedback ------------------------------------------


class _Longest(Policy):
    name = "longest"
    uses_prefix_match = True

    def __init__(self) -> None:
        self.seen: list[WorkerView] = []

    def select(self, ctx: RouteContext) -> Decision:
        self.seen = list(ctx.candidates)
        best = max(ctx.candidates, key=lambda w: (w.matched_tokens, w.id))
        return Decision(best.id, "prefix_hit")


@dataclass(frozen=True)
class _Outcome:
    status: int = 200
    ttft_s: float | None = 0.1
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tiers: CachedTiers | None = None


def _ids_request(first: int, tokens: int) -> RouteRequest:
    """A completions request of ``tokens`` token ids (16 per 64-character block)."""
    body = orjson.dumps({"model": "m", "prompt": list(range(first, first + tokens))})
    return parse_request(ApiKind.COMPLETIONS, body, {}, RequestSettings())


def test_the_core_splits_each_match_by_tier_and_feeds_back_the_details() -> None:
    req = _ids_request(1, 320)  # 20 blocks of 16 tokens
    n = len(req.block_hashes)
    ix = PrefixIndex(block_tokens=16.0)
    workers = [Worker("http://a:1", 0.0), Worker("http://b:1", 0.0)]
    for w in workers:
        w.flags.clear()
        ix.set_capacity(w.id, 640)  # 40 blocks on the GPU, 80 on the host
        ix.set_host_capacity(w.id, 1280)
    a, b = workers[0].id, workers[1].id
    settle(ix, a, req.block_hashes, 1.0)
    for i in range(2):  # two other prompts push it down to a's host tier
        settle(ix, a, _ids_request(10_000 * (i + 1), 320).block_hashes, 2.0 + i)
    assert ix.match(req.block_hashes) == {a: n}
    device = ix.device_blocks(a, req.block_hashes, n)
    assert device == 0
    policy = _Longest()
    core = RoutingCore(policy, ix, CostModel(), random.Random(0))
    blind = core.choose(req, workers, 10.0)  # no tiers read: every match on the GPU
    assert blind.matched_host_tokens == 0 and blind.predicted_host_blocks is None
    assert all(v.matched_host_tokens == 0 for v in policy.seen)
    core.tiers = ix
    choice = core.choose(req, workers, 10.0)
    view = {v.id: v for v in policy.seen}
    assert choice.worker.id == a and view[b].matched_tokens == 0
    assert view[a].matched_host_tokens == view[a].matched_tokens == choice.matched_tokens == 320
    assert choice.matched_host_tokens == 320 and choice.predicted_host_blocks == n
    lease = core.dispatch(req, choice, 10.0)
    lease.release()
    # the engine had loaded it back, all 319 from the host (its hit caps at prompt - 1)
    report = _Outcome(cached_tokens=319, cached_tiers=CachedTiers(0, 319))
    core.feedback(req, choice, lease, report, 11.0)
    assert ix.tiers(a)[2] == 1.0  # as believed: nothing to learn
    assert ix.device_blocks(a, req.block_hashes, n) == n  # recorded again: on the GPU
    # believed on the GPU, found on the host: the device share shrinks
    again = core.choose(req, workers, 12.0)
    assert again.matched_host_tokens == 0 and again.predicted_host_blocks == 0
    lease = core.dispatch(req, again, 12.0)
    lease.release()
    core.feedback(req, again, lease, _Outcome(cached_tokens=319,
                  cached_tiers=CachedTiers(0, 319)), 13.0)  # fmt: skip
    assert ix.tiers(a)[2] < 1.0
    # an outcome that names no tiers (the protocol's own fields only) is fine
    core.feedback(req, again, lease, _Outcome(cached_tokens=0), 14.0)


# --- the host tier's size, from /server_info ---------------------------------------------


def test_host_tier_tokens_from_server_info() -> None:
    on = {"enable_hierarchical_cache": True}
    # write-through (SGLang's default) keeps a copy of the GPU's blocks: 2x - 1x
    assert host_tier_tokens(on, 1000) == 1000
    assert host_tier_tokens({**on, "hicache_ratio": 3.0}, 1000) == 2000
    assert host_tier_tokens({**on, "hicache_write_policy": "write_back"}, 1000) == 2000
    assert host_tier_tokens({**on, "hicache_write_policy": "write_through_selective"}, 1000) == 1000
    # a size in GB over the KV bytes per token (1 GiB of KV for 8,192 tokens: 131,072 B)
    sized = {**on, "hicache_size": 2, "internal_states": [{"memory_usage": {"kvcache": 1.0}}]}
    assert host_tier_tokens(sized, 8192) == int(2e9 / 131072) - 8192
    assert host_tier_tokens({**on, "hicache_size": 2}, 8192) == 8192  # no kvcache: the ratio
    assert host_tier_tokens({**on, "hicache_ratio": 1.0}, 1000) is None  # all copies
    assert host_tier_tokens({}, 1000) is None
    assert host_tier_tokens({"enable_hierarchical_cache": "yes"}, 1000) is None
    assert host_tier_tokens(on, 0) is None
    for bad in (float("nan"), float("inf"), -1.0, True, "2"):
        assert host_tier_tokens({**on, "hicache_ratio": bad}, 1000) == 1000  # the default
    info = {"max_total_num_tokens": 4096, **on}
    assert parse_server_info(info).host_capacity_tokens == 4096
    assert parse_server_info({"max_total_num_tokens": 4096}).host_capacity_tokens is None
