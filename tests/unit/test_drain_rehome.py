"""Drains that re-home, pre-warms within the budget, slow start (issue 20): the rules of
``gateway.routing.rehome`` and ``gateway.workers.slow_start``, and the replay driving
them (``loadtests.replay.membership``)."""

from __future__ import annotations

import math
import random

import orjson
import pytest

from gateway.config import ConfigError, config_from_dict
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.prewarm import prefix_body
from gateway.routing.rehome import (
    REASON_DRAIN,
    ChainLog,
    PrewarmItem,
    PrewarmJob,
    PrewarmQueue,
    PromptStore,
    RehomeSettings,
    TokenBudget,
    join_items,
    plan_rehome,
    prefill_only,
    still_wanted,
)
from gateway.routing.request import ApiKind, RequestSettings, parse_request
from gateway.workers.slow_start import SlowStart, time_factor
from loadtests.replay.membership import MembershipPlan
from loadtests.replay.run import ReplayConfig, run_replay
from policies.base import WorkerView

SYSTEM = list(range(10**9, 10**9 + 10))  # a prompt every worker holds (10 blocks)


def _chain(tag: int, n: int, base: list[int] | None = None) -> list[int]:
    return [*(SYSTEM if base is None else base), *(tag * 1000 + i for i in range(n))]


def _setup(store: bool = True) -> tuple[PrefixIndex, ChainLog[bytes]]:
    index = PrefixIndex(block_tokens=16.0)
    for w in "abc":
        index.set_capacity(w, 420_000)
    prompts = PromptStore[bytes](1 << 20, len) if store else None
    return index, ChainLog(index.capacity_blocks, store=prompts)


def _dispatch(index: PrefixIndex, log: ChainLog[bytes], w: str, chain: list[int], t: float) -> None:
    index.record(chain, w, t, pin=False)
    log.record(w, chain, len(chain) * 16, t, b"x" * len(chain))


# --- the chain log ---------------------------------------------------------------------


def test_a_conversations_turns_are_one_entry_and_its_prompt_follows() -> None:
    _, log = _setup()
    turn1 = _chain(1, 5)
    turn2 = [*turn1, 77, 78]  # the next turn extends the previous one
    log.record("a", turn1, 240, 1.0, b"one")
    log.record("a", turn2, 270, 5.0, b"two!")
    (entry,) = log.entries("a")
    assert entry.chain == turn2 and entry.uses == 2
    assert (entry.first_s, entry.last_s) == (1.0, 5.0)
    assert log.payload("a", turn2[-1]) == b"two!" and log.payload("a", turn1[-1]) is None
    log.record("a", _chain(2, 5), 240, 6.0)  # another conversation sharing the system prompt
    assert [e.chain[-1] for e in log.entries("a")] == [2004, 78]  # most recent first


def test_the_log_is_bounded_by_chains_and_blocks_and_forgets_a_worker() -> None:
    store = PromptStore[bytes](1 << 20, len)
    log: ChainLog[bytes] = ChainLog(lambda _w: 100, max_chains=3, blocks_factor=1.0, store=store)
    for i in range(5):
        log.record("a", _chain(i + 1, 5), 240, float(i), b"p")
    assert len(log.entries("a")) == 3 and log.stats()["prompts"] == 3
    log.record("a", list(range(50_000, 50_095)), 1, 9.0, b"p")  # 95 blocks: 100 at most
    assert [len(e.chain) for e in log.entries("a")] == [95]
    log.forget_worker("a")
    assert log.entries("a") == [] and len(store) == 0


def test_the_prompt_store_is_bounded_in_bytes() -> None:
    store = PromptStore[bytes](100, len, max_item_bytes=60)
    store.put(("a", 1), b"x" * 40)
    store.put(("a", 2), b"x" * 40)
    store.put(("a", 3), b"x" * 40)  # over 100 bytes: the oldest goes
    assert store.get(("a", 1)) is None and store.bytes == 80 and store.dropped == 1
    store.put(("a", 4), b"x" * 61)  # larger than one item may be: not kept
    assert store.get(("a", 4)) is None and store.bytes == 80


# --- re-homing -------------------------------------------------------------------------


def test_a_drain_rehomes_the_drained_workers_hot_prefixes_by_load() -> None:
    index, log = _setup()
    hot = [_chain(i, 20) for i in range(1, 5)]
    for i, chain in enumerate(hot):
        _dispatch(index, log, "a", chain, 100.0 + i)
    _dispatch(index, log, "a", _chain(9, 20), 0.0)  # cold: not used within recent_s
    shared = _chain(8, 20)
    _dispatch(index, log, "a", shared, 101.0)
    _dispatch(index, log, "b", shared, 101.0)  # b holds it too: it is no drain's to move
    for w in "bc":
        index.record(SYSTEM, w, 50.0, pin=False)
    loads = {"b": 0.0, "c": 0.0}
    job = PrewarmJob(REASON_DRAIN, "a", 200.0)
    report, items = plan_rehome(
        log,
        index,
        ["a"],
        loads,
        110.0,
        RehomeSettings(recent_s=60.0, prewarm=True, min_uses=1),
        job,
    )
    assert (report.considered, report.rehomed, report.cold, report.held_elsewhere) == (6, 4, 1, 1)
    assert report.homes == {"b": 2, "c": 2}  # spread by load: 320 tokens each to compute
    for chain in hot:  # each is recorded under its new home: the next turn goes there
        holders = index.match(chain)
        home = max((w for w in "bc"), key=lambda w: holders.get(w, 0))
        assert holders[home] == len(chain)
        assert log.get(home, chain[-1]) is not None and log.payload(home, chain[-1]) == b"x" * 30
    assert [i.last_s for i in items] == sorted((i.last_s for i in items), reverse=True)
    assert len(items) == 4 and all(i.tokens == 320 for i in items)  # 20 blocks each, not held
    assert report.tokens_rehomed == 4 * 320
    assert {e.chain[-1] for e in log.entries("a")} == {9019, 8019}  # what stayed: cold, shared


def test_max_home_share_keeps_the_least_loaded_home_from_taking_every_conversation() -> None:
    index = PrefixIndex(block_tokens=16.0)
    for w in "abcde":
        index.set_capacity(w, 420_000)
    log: ChainLog[bytes] = ChainLog(index.capacity_blocks)
    for i in range(1, 41):  # 40 conversations of 30 blocks on a
        _dispatch(index, log, "a", _chain(i, 20), 100.0 + i)
    for j, w in enumerate("bcd"):  # b, c, d hold conversations of their own; e none
        for i in range(20):
            _dispatch(index, log, w, _chain(100 + 20 * j + i, 20), 100.0)
    loads = dict.fromkeys("bcde", 0.0)
    spread, _ = plan_rehome(log, index, ["a"], loads, 150.0,
                            RehomeSettings(min_uses=1, max_home_share=1.25))  # fmt: skip
    # an even share is 10 conversations; 1.25 of it: at most 12 on a home (e the most)
    assert spread.rehomed == 40 and max(spread.homes.values()) <= 12
    assert spread.homes["e"] == 12 and len(spread.homes) == 4
    index2 = PrefixIndex(block_tokens=16.0)
    for w in "abcde":
        index2.set_capacity(w, 420_000)
    log2: ChainLog[bytes] = ChainLog(index2.capacity_blocks)
    for i in range(1, 41):
        _dispatch(index2, log2, "a", _chain(i, 20), 100.0 + i)
    for j, w in enumerate("bcd"):
        for i in range(20):
            _dispatch(index2, log2, w, _chain(100 + 20 * j + i, 20), 100.0)
    by_load, _ = plan_rehome(log2, index2, ["a"], loads, 150.0, RehomeSettings(min_uses=1))
    assert by_load.homes["e"] > 12  # by load alone, the empty home takes the most


def test_siblings_follow_the_chain_rehomed_before_them() -> None:
    index, log = _setup()
    trunk = _chain(1, 30)
    first = [*trunk, *range(5001, 5007)]
    second = [*trunk, *range(6001, 6007)]
    _dispatch(index, log, "a", first, 100.0)
    _dispatch(index, log, "a", second, 99.0)
    report, items = plan_rehome(
        log, index, ["a"], {"b": 0.0, "c": 500.0}, 100.0, RehomeSettings(prewarm=True, min_uses=1),
        PrewarmJob(REASON_DRAIN, "a", 200.0),
    )  # fmt: skip
    # b: 736 tokens given + 96 to compute for the second (it shares 40 blocks there) is
    # less than c's 500 queued + 736: it follows the first
    assert report.homes == {"b": 2}
    assert [i.tokens for i in items] == [46 * 16, 6 * 16]


def test_only_what_was_reused_is_rehomed_a_siblings_prefix_cut_to_it() -> None:
    index, log = _setup()
    turn1 = _chain(1, 20)
    _dispatch(index, log, "a", turn1, 90.0)
    index.record([*turn1, 42], "a", 95.0, pin=False)
    log.record("a", [*turn1, 42], 500, 95.0, b"turn2", reused=30)  # its conversation came back
    trunk = _chain(2, 20)
    _dispatch(index, log, "a", [*trunk, *range(7001, 7011)], 96.0)
    sibling = [*trunk, *range(8001, 8011)]  # shared the other's 30-block prefix there
    index.record(sibling, "a", 97.0, pin=False)
    log.record("a", sibling, 640, 97.0, b"sib", reused=30)
    lonely = _chain(3, 20)
    index.record(lonely, "a", 98.0, pin=False)
    log.record("a", lonely, 480, 98.0, b"one", reused=10)  # only the system prompt reused
    for w in "bc":
        index.record(SYSTEM, w, 50.0, pin=False)
    job = PrewarmJob(REASON_DRAIN, "a", 200.0)
    report, items = plan_rehome(log, index, ["a"], {"b": 0.0, "c": 0.0}, 100.0,
                                RehomeSettings(prewarm=True), job)  # fmt: skip
    assert (report.rehomed, report.not_reused) == (2, 2)  # the trunk's first use: nothing reused
    by_leaf = {i.key[1]: i for i in items}
    assert by_leaf[42].prefix_blocks is None and len(by_leaf[42].chain) == 31  # all of it
    cut = by_leaf[sibling[-1]]
    assert cut.prefix_blocks == 30 and list(cut.chain) == sibling[:30]  # the reused prefix
    assert cut.tokens == 20 * 16  # the system prompt is held there already
    assert index.match(lonely).get("b", 0) == index.match(lonely).get("c", 0) == 10


def test_when_most_conversations_come_back_first_turns_are_rehomed_whole() -> None:
    index, log = _setup()
    for i in range(1, 4):  # three conversations that came back, one on its first turn
        chain = _chain(i, 20)
        _dispatch(index, log, "a", chain, 90.0 + i)
        index.record([*chain, i], "a", 95.0 + i, pin=False)
        log.record("a", [*chain, i], 500, 95.0 + i, b"next", reused=30)
    first = _chain(7, 20)
    index.record(first, "a", 99.0, pin=False)
    log.record("a", first, 480, 99.0, b"first", reused=10)
    report, _ = plan_rehome(log, index, ["a"], {"b": 0.0}, 100.0, RehomeSettings())
    assert report.rehomed == 4 and report.returning_share == 0.75
    assert index.match(first).get("b") == len(first)
    log2_index, log2 = _setup()
    _dispatch(log2_index, log2, "a", first, 99.0)
    strict = RehomeSettings(returning_share=1.5)  # never
    report2, _ = plan_rehome(log2, log2_index, ["a"], {"b": 0.0}, 100.0, strict)
    assert report2.rehomed == 0 and report2.not_reused == 1


def test_without_a_prompt_store_nothing_is_queued_and_no_home_is_counted() -> None:
    index, log = _setup(store=False)
    _dispatch(index, log, "a", _chain(1, 20), 100.0)
    job = PrewarmJob(REASON_DRAIN, "a", 200.0)
    everything = RehomeSettings(min_uses=1)
    report, items = plan_rehome(log, index, ["a"], {"b": 0.0}, 100.0, everything, job)
    assert report.rehomed == 1 and items == []
    index2, log2 = _setup()
    _dispatch(index2, log2, "a", _chain(1, 20), 100.0)
    report2, _ = plan_rehome(log2, index2, ["a"], {}, 100.0, everything, None)
    assert report2.no_home == 1 and report2.rehomed == 0


# --- the budget ------------------------------------------------------------------------


def _items(job: PrewarmJob, n: int, rng: random.Random) -> list[PrewarmItem]:
    return [
        PrewarmItem(job, rng.choice("bcd"), [i], rng.randint(100, 3000), -i, ("a", i))
        for i in range(n)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pre_warming_never_goes_beyond_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    rate, burst = 1000.0, 4000.0
    queue = PrewarmQueue(TokenBudget(rate, burst, 0.0), max_in_flight=2)
    job = PrewarmJob(REASON_DRAIN, "a", deadline_s=30.0)
    queue.add(_items(job, 200, rng))
    queue.add([PrewarmItem(job, "b", [1], 5000, 0.0, ("a", 99))])  # over the burst: never
    in_flight: dict[str, int] = {}
    sent, t = 0.0, 0.0
    while t < 40.0:
        for item in queue.due(t, in_flight, lambda _i: True):
            sent += item.tokens
            in_flight[item.worker_id] = in_flight.get(item.worker_id, 0) + 1
        assert sent <= burst + rate * t + 1e-3, (t, sent)
        assert all(n <= 2 for n in in_flight.values())
        for w in list(in_flight):  # some finish
            if rng.random() < 0.5:
                in_flight[w] -= 1
        wake = queue.next_wake(t, in_flight)
        t = max(t + 0.01, wake if wake is not None else t + rng.uniform(0.01, 0.5))
    assert sent == job.tokens_sent and job.sent > 10
    assert len(queue) == 0 and job.dropped >= 1  # the rest dropped at the deadline
    assert job.planned == job.sent + job.dropped + job.skipped
    assert job.tokens_sent <= burst + rate * job.deadline_s


def test_a_stopped_job_and_unwanted_items_send_nothing() -> None:
    queue = PrewarmQueue(TokenBudget(1000.0, 10_000.0, 0.0))
    job, other = PrewarmJob(REASON_DRAIN, "a", 100.0), PrewarmJob(REASON_DRAIN, "x", 100.0)
    queue.add([PrewarmItem(job, "b", [1], 10, 0.0, ("a", 1)),
               PrewarmItem(other, "c", [2], 10, 0.0, ("x", 2))])  # fmt: skip
    queue.stop(job)
    assert job.dropped == 1 and job.stopped
    assert queue.due(1.0, {}, lambda _i: False) == [] and other.skipped == 1
    assert queue.next_wake(1.0, {}) is None


def test_a_busy_home_gets_no_prewarm_until_its_queue_drains() -> None:
    queue = PrewarmQueue(TokenBudget(1e6, 1e6, 0.0), max_in_flight=4,
                         max_home_queued_tokens=1000, busy_poll_s=0.05)  # fmt: skip
    job = PrewarmJob(REASON_DRAIN, "a", 100.0)
    queue.add([PrewarmItem(job, "b", [1], 1200, 0.0, ("a", 1)),
               PrewarmItem(job, "b", [2], 1200, 0.0, ("a", 2)),
               PrewarmItem(job, "c", [3], 1200, 0.0, ("a", 3))])  # fmt: skip
    busy = {"b": 5000.0, "c": 0.0}
    # b is busy with live prefill: c's goes, b's wait and are polled
    assert [i.chain for i in queue.due(1.0, {}, lambda _i: True, busy)] == [[3]]
    assert queue.next_wake(1.0, {"c": 1}, busy) == pytest.approx(1.05)
    # b idle: one goes, and its own tokens make b busy for the next
    idle = {"b": 0.0, "c": 1200.0}
    assert [i.chain for i in queue.due(2.0, {"c": 1}, lambda _i: True, idle)] == [[1]]
    assert len(queue) == 1
    assert [i.chain for i in queue.due(3.0, {}, lambda _i: True, {"b": 0.0})] == [[2]]
    assert job.sent == 3 and len(queue) == 0


def test_a_queued_prewarm_is_skipped_once_the_conversation_came_back() -> None:
    index, log = _setup()
    chain = _chain(1, 20)
    _dispatch(index, log, "a", chain, 100.0)
    _, (item,) = plan_rehome(log, index, ["a"], {"b": 0.0}, 100.0,
                             RehomeSettings(prewarm=True, min_uses=1),
                             PrewarmJob(REASON_DRAIN, "a", 200.0))  # fmt: skip
    assert still_wanted(log, item)
    log.record("b", [*chain, 42], 400, 101.0)  # its next turn reached the new home
    assert not still_wanted(log, item)


def test_a_joining_worker_gets_the_most_shared_prefixes() -> None:
    index, log = _setup()
    for t, w in enumerate("ab"):
        _dispatch(index, log, w, _chain(t + 1, 20), 100.0)
    job = PrewarmJob("join", "c", 200.0)
    (item,) = join_items(log, index, "c", ["a", "b", "c"], 100.0, 300.0, 4, job)
    assert list(item.chain) == SYSTEM and item.prefix_blocks == len(SYSTEM)
    assert item.tokens == len(SYSTEM) * 16 and item.worker_id == "c"


# --- prefill-only copies -----------------------------------------------------------------


def test_prefill_only_copies_ask_for_one_token() -> None:
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "stream": True, "stream_options": {"include_usage": True},
                         "max_completion_tokens": 99, "n": 3, "rid": "client"})  # fmt: skip
    out = orjson.loads(prefill_only(ApiKind.CHAT, chat, {"routed_dp_rank": 1}) or b"")
    assert out == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                   "stream": False, "max_tokens": 1, "routed_dp_rank": 1}  # fmt: skip
    gen = orjson.dumps({"text": "abc", "sampling_params": {"max_new_tokens": 50, "top_p": 0.9}})
    out = orjson.loads(prefill_only(ApiKind.GENERATE, gen) or b"")
    assert out["sampling_params"] == {"max_new_tokens": 1, "top_p": 0.9}
    assert prefill_only(ApiKind.EMBEDDINGS, b'{"input": "x"}') is None
    assert prefill_only(ApiKind.CHAT, b"[1]") is None


def test_a_shared_prefix_is_cut_from_a_stored_chat_within_its_blocks() -> None:
    settings = RequestSettings()
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    user = {"role": "user", "content": "q" * 500}
    body = orjson.dumps({"model": "m", "messages": [system, user]})
    prefix = parse_request(ApiKind.CHAT, orjson.dumps({"model": "m", "messages": [system]}),
                           {}, settings)  # fmt: skip
    full = prefix.prompt_chars // prefix.block_chars
    cut = prefix_body(ApiKind.CHAT, body, prefix.block_hashes[:full], settings)
    assert cut is not None and orjson.loads(cut)["messages"] == [system]
    text = orjson.dumps({"prompt": "abcd" * 100})
    cut = prefix_body(ApiKind.COMPLETIONS, text, [1, 2], settings)
    assert cut is not None and orjson.loads(cut)["prompt"] == ("abcd" * 100)[:128]


# --- slow start --------------------------------------------------------------------------


def _views(new_match: int = 0) -> list[WorkerView]:
    return [WorkerView("new", matched_tokens=new_match), WorkerView("old1"), WorkerView("old2")]


def _kept_share(ramp: SlowStart, t: float, rng: random.Random, n: int = 2000) -> float:
    return sum("new" in {v.id for v in ramp.admit(_views(), t, rng)} for _ in range(n)) / n


def test_slow_start_ramps_and_ends() -> None:
    ramp, rng = SlowStart(window_s=100.0, aggression=1.0, min_factor=0.1), random.Random(3)
    views = _views()
    assert ramp.admit(views, 0.0, rng) is views  # nobody ramps yet
    ramp.begin("new")
    assert ramp.factor("new", 5.0) == 1.0  # not seen as a candidate yet: its clock waits
    ramp.admit(_views(), 0.0, rng)  # now it is: the window starts
    shares = [_kept_share(ramp, t, rng) for t in (10.0, 20.0, 50.0, 90.0)]
    assert shares == sorted(shares) and shares[0] < 0.3 < 0.7 < shares[-1]
    assert ramp.factor("new", 2.0) == pytest.approx(0.1) and ramp.factor("new@dp1", 50.0) == 0.5
    assert ramp.ramping(90.0) == {"new": 10.0}
    views = _views()
    assert list(ramp.admit(views, 100.0, rng)) == views  # the window has passed ...
    assert not ramp.active and ramp.ramping(120.0) == {}  # ... and the ramp is gone
    assert ramp.admit(views, 120.0, rng) is views


def test_slow_start_keeps_a_worker_that_alone_holds_the_prefix_and_never_empties() -> None:
    ramp, rng = SlowStart(window_s=100.0, min_factor=0.0), random.Random(1)
    ramp.begin("new")
    ramp.admit(_views(), 0.0, rng)
    for _ in range(200):
        assert "new" in {v.id for v in ramp.admit(_views(new_match=500), 1.0, rng)}
    only = [WorkerView("new")]
    assert list(ramp.admit(only, 1.0, rng)) == only


def test_time_factor_is_envoys() -> None:
    assert time_factor(25.0, 100.0, 2.0, 0.1) == pytest.approx(0.5)
    assert time_factor(1.0, 100.0, 1.0, 0.1) == pytest.approx(0.1)
    assert time_factor(100.0, 100.0, 1.0, 0.1) == 1.0 == time_factor(5.0, 0.0, 1.0, 0.1)


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [("drain", {"recent_s": 0}), ("slow_start", {"window_s": -1}),
     ("slow_start", {"min_factor": 2}), ("prewarm", {"prompt_store_bytes": -5}),
     ("prewarm", {"max_in_flight": 0}), ("prefix_index", {"recent_chains": -1})],
)  # fmt: skip
def test_bad_membership_settings_are_refused_naming_the_key(
    key: str, value: dict[str, float]
) -> None:
    with pytest.raises(ConfigError, match=f"{key}.{next(iter(value))}"):
        config_from_dict({key: value})


def test_the_defaults_rehome_but_keep_no_prompt() -> None:
    cfg = config_from_dict({})
    assert cfg.drain.rehome and cfg.prewarm.prompt_store_bytes == 0
    assert cfg.slow_start.window_s == 0 and cfg.prefix_index.recent_chains > 0


# --- the replay ---------------------------------------------------------------------------


def _replay(
    mode: str, sessions: int = 48, policy: str = "min_ttft", /, **plan: float
) -> dict[str, object]:
    membership = MembershipPlan(mode=mode, **plan)  # type: ignore[arg-type]
    config = ReplayConfig(
        workers=4, capacity_tokens=100_000, policy=policy, workload="multi-turn",
        workload_args=(f"sessions={sessions}", "session_rate=4", "turns=5"), bounds=False,
        membership=membership,
    )  # fmt: skip
    figures = run_replay(config)["membership"]
    assert isinstance(figures, dict)
    return figures


def test_the_replays_cache_aware_drain_prewarms_within_budget_and_keeps_sessions_warm() -> None:
    drain = {"drain_worker": 1, "drain_at_s": 40.0, "drain_period_s": 20.0, "window_s": 120.0,
             "prewarm_tokens_per_s": 2000.0}  # fmt: skip
    naive, aware = _replay("naive", **drain), _replay("cache_aware", **drain)
    affected_naive, affected_aware = naive["affected"], aware["affected"]
    assert isinstance(affected_naive, dict) and isinstance(affected_aware, dict)
    assert affected_naive["requests"] == affected_aware["requests"] > 0  # one set, both modes
    assert affected_aware["hit_rate"] > affected_naive["hit_rate"]
    rehome, job = aware["rehome"], aware["prewarm"]
    assert isinstance(rehome, dict) and isinstance(job, dict)
    assert rehome["chains_rehomed"] > 0 and job["completed"] > 0
    assert job["tokens_sent"] <= 65536 + 2000.0 * 20.0  # burst + rate x drain period
    assert naive["prewarm_tokens"] == 0 and naive["rehome"] is None


def test_the_replays_join_ramps_the_new_worker_under_slow_start() -> None:
    # least_load: every new placement is the ramp's to slow (min_ttft's affinity would keep
    # this light load's sessions on the workers holding them, new worker or not)
    join = {"join_at_s": 30.0, "window_s": 30.0, "slow_start_s": 60.0}  # new sessions to 60 s
    naive = _replay("naive", 240, "least_load", **join)
    ramped = _replay("rehome", 240, "least_load", **join)
    share_naive, share_ramped = naive["new_worker_share"], ramped["new_worker_share"]
    assert isinstance(share_naive, float) and isinstance(share_ramped, float)
    assert 0 < share_ramped < share_naive
    slow = ramped["slow_start"]
    assert isinstance(slow, dict) and slow["dropped"] > 0
    assert not math.isnan(share_naive)
