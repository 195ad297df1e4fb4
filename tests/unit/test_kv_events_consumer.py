"""The gateway's KV-event consumer: decoding, the exact index, feeds (gaps, restarts), modes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import zmq.asyncio

from gateway.exact.feed import RankFeed
from gateway.exact.index import ExactIndex, PredictedBlocks, chain_hashes, namespace_seed
from gateway.exact.manager import (
    MODE_APPROXIMATE,
    MODE_DEGRADED,
    MODE_EXACT,
    KVEventsManager,
    KVEventsSettings,
    _WorkerState,
)
from gateway.exact.request import request_tokens
from gateway.exact.tokenizer import load_tokenizer
from gateway.exact.wire import Cleared, Descriptor, Event, Removed, Stored, decode_batch
from loadtests.harness.inprocess import SIM_TOKENIZER
from simulator.config import KVEventsConfig
from simulator.http.kv_publisher import BlockStored as SimStored
from simulator.http.kv_publisher import KVEventPublisher, encode_batch
from simulator.model.radix_cache import RadixCache, encode_tokens

NS0 = (None, None, None)


def _ids(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("legacy", [False, True])
def test_decode_both_encodings(legacy: bool) -> None:
    events = [SimStored([11, 12], None, _ids(8), 4, cache_salt="s")]
    ts, decoded, rank = decode_batch(encode_batch(5.0, events, 2, legacy_array=legacy))
    assert ts == 5.0 and rank == 2
    assert decoded == [Stored([11, 12], None, _ids(8), 4, "s", None)]


def test_decode_ignores_unknown_events_and_keys() -> None:
    import msgpack

    payload = msgpack.packb(
        [
            1.0,
            [{"type": "Mystery"}, {"type": "BlockRemoved", "block_hashes": [1], "x": 2}],
            0,
            "extra",
        ]
    )
    assert decode_batch(payload)[1] == [Removed([1])]


def _feed_cache(
    page: int = 4,
) -> tuple[RadixCache, list[Event], ExactIndex, Callable[[], None]]:
    """A radix cache whose events are decoded and applied to an ExactIndex as worker 'w'."""
    from simulator.http.kv_publisher import EventRecorder

    applied: list[Event] = []
    index = ExactIndex()
    recorder = EventRecorder(page)

    def pump() -> None:
        for ev in decode_batch(encode_batch(0.0, recorder.take()))[1]:
            applied.append(ev)
            index.apply("w", 0, ev, page)

    return RadixCache(1000, page, recorder), applied, index, pump


def test_exact_index_multi_hash_split_and_remove() -> None:
    cache, applied, index, pump = _feed_cache()
    cache.insert(encode_tokens(_ids(12)))
    cache.insert(encode_tokens([*_ids(4), 9, 9, 9, 9]))
    pump()
    assert isinstance(applied[0], Cleared) and len(applied[1].block_hashes) == 3  # type: ignore[union-attr]
    seed = namespace_seed(*NS0)
    assert index.match(chain_hashes(_ids(12), 4, seed), ["w"]) == {"w": 3}
    assert index.match(chain_hashes([*_ids(4), 9, 9, 9, 9, 5], 4, seed), ["w"]) == {"w": 2}
    cache.evict(4)  # the LRU leaf: [5..12], older than the [9,9,9,9] branch
    pump()
    assert index.match(chain_hashes([*_ids(4), 9, 9, 9, 9], 4, seed), ["w"]) == {"w": 2}
    assert index.match(chain_hashes(_ids(12), 4, seed), ["w"]) == {"w": 1}
    cache.reset()
    pump()
    assert index.match(chain_hashes(_ids(12), 4, seed), ["w"]) == {}


def test_exact_index_salt_partitions() -> None:
    cache, _, index, pump = _feed_cache()
    cache.insert(encode_tokens(_ids(8)), "\x1f\x1fs1")
    pump()
    assert index.match(chain_hashes(_ids(8), 4, namespace_seed(None, "s1", None)), ["w"]) == {
        "w": 2
    }
    assert index.match(chain_hashes(_ids(8), 4, namespace_seed(*NS0)), ["w"]) == {}
    assert index.match(chain_hashes(_ids(8), 4, namespace_seed(None, "s2", None)), ["w"]) == {}


def test_exact_index_drops_orphans_and_wrong_block_size() -> None:
    index = ExactIndex()
    assert index.apply("w", 0, Stored([5], 999, _ids(4), 4), 4) == []
    assert index.apply("w", 0, Stored([5], None, _ids(8), 8), 4) == []
    assert index.dropped_orphans == 1 and index.dropped_block_size == 1 and index.blocks("w") == 0


def test_exact_index_ranks_union_and_clear() -> None:
    index = ExactIndex()
    index.apply("w", 0, Stored([1], None, _ids(4), 4), 4)
    index.apply("w", 1, Stored([1], None, _ids(4), 4), 4)
    h = chain_hashes(_ids(4), 4, namespace_seed(*NS0))
    index.clear("w", 0)
    assert index.match(h, ["w"]) == {"w": 1}
    index.apply("w", 1, Removed([1]), 4)
    assert index.match(h, ["w"]) == {}


def test_predicted_ttl_follows_delay() -> None:
    pred = PredictedBlocks(ttl_factor=2.0, ttl_min_s=0.1, ttl_max_s=10.0)
    pred.record("w", [1, 2], now=0.0)
    assert pred.holds("w", 1, 1.0)
    pred.confirm("w", [1], now=0.5)
    assert pred.mean_delay_s == 0.5 and pred.ttl_s == 1.0
    assert not pred.holds("w", 1, 0.6)  # confirmed: the exact index has it now
    pred.record("w", [3], now=10.0)
    assert pred.holds("w", 3, 10.9) and not pred.holds("w", 3, 11.1)


def test_request_tokens_match_the_simulator() -> None:
    tok = load_tokenizer(SIM_TOKENIZER)
    from simulator.model.tokenizer import default_tokenizer

    messages = [{"role": "user", "content": "Hello there"}]
    body = b'{"model":"m:ad","messages":[{"role":"user","content":"Hello there"}],"cache_salt":"s"}'
    ids, ns = request_tokens("chat", body, tok)
    assert ids == default_tokenizer().encode_chat(messages, None)
    assert ns == ("ad", "s", None)
    assert request_tokens("generate", b'{"input_ids":[1,2,3]}', tok)[0] == [1, 2, 3]
    assert request_tokens("completions", b'{"prompt":["a b","c"]}', tok)[0] == tok.encode("a b")
    for bad in (
        "bogus",
        "sim",
        "python:simulator.model.tokenizer",
        "python:no_such_module:f",
        "python:simulator.model.tokenizer:no_such_factory",
        "python:json:JSONDecoder",
    ):
        with pytest.raises(ValueError, match="tokenizer"):
            load_tokenizer(bad)


# ---------------------------------------------------------------------- feeds
@pytest.fixture
async def publisher() -> AsyncIterator[KVEventPublisher]:
    cfg = KVEventsConfig.from_json(
        '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
    )
    pub = KVEventPublisher(cfg, page_size=4)
    pub.start()
    try:
        yield pub
    finally:
        await pub.close()


class _Sink:
    def __init__(self) -> None:
        self.batches: list[tuple[int, list[Event]]] = []
        self.resets: list[int] = []
        self.lost: list[int] = []

    def apply(self, rank: int, ts: float, events: list[Event]) -> None:
        self.batches.append((rank, events))

    def reset(self, rank: int) -> None:
        self.resets.append(rank)

    def gap(self, rank: int) -> None:
        self.lost.append(rank)


def _desc(pub: KVEventPublisher, replay: bool = True) -> Descriptor:
    d = Descriptor.parse(pub.descriptor(), "http://127.0.0.1:1")
    assert d is not None
    return d if replay else Descriptor(d.host, d.port_base, d.topic, d.block_size, 1, None)


def _publish(pub: KVEventPublisher, cache: RadixCache, start: int) -> None:
    cache.insert(encode_tokens(_ids(4, start)))
    pub.flush()


async def test_feed_catch_up_gap_replay_and_restart(publisher: KVEventPublisher) -> None:
    cache = RadixCache(1000, 4, publisher.recorder)
    for i in range(3):
        _publish(publisher, cache, 100 * (i + 1))  # seqs 1..3 (0: AllBlocksCleared)
    ctx = zmq.asyncio.Context()
    sink = _Sink()
    feed = RankFeed(ctx, _desc(publisher), 0, sink.apply, sink.reset, sink.gap)
    try:
        assert await feed._catch_up(0, None)
        assert feed.last_seq == 3 and len(sink.batches) == 4
        _publish(publisher, cache, 500)  # seq 4, "lost"
        _publish(publisher, cache, 600)  # seq 5
        seq5 = publisher._buffer[-1]
        await feed._on_message(*seq5)
        assert feed.last_seq == 5 and [len(b[1]) for b in sink.batches[-2:]] == [1, 1]
        assert not sink.lost and feed.replays == 2
        await feed._on_message(*seq5)  # seq not after last: a restart
        assert sink.resets == [0] and feed.restarts == 1
    finally:
        feed.close()
        ctx.term()


async def test_feed_gap_without_replay_is_lost(publisher: KVEventPublisher) -> None:
    cache = RadixCache(1000, 4, publisher.recorder)
    ctx = zmq.asyncio.Context()
    sink = _Sink()
    feed = RankFeed(ctx, _desc(publisher, replay=False), 0, sink.apply, sink.reset, sink.gap)
    try:
        _publish(publisher, cache, 100)
        await feed._on_message(*publisher._buffer[-1])
        _publish(publisher, cache, 200)
        _publish(publisher, cache, 300)
        await feed._on_message(*publisher._buffer[-1])
        assert sink.lost == [0] and feed.last_seq == 3
    finally:
        feed.close()
        ctx.term()


# ---------------------------------------------------------------------- modes
async def test_modes_degrade_after_silence_and_return() -> None:
    now = [0.0]
    settings = KVEventsSettings(enabled="true", stale_timeout_s=1.0)
    import aiohttp

    async with aiohttp.ClientSession() as session:
        mgr = KVEventsManager(
            settings, load_tokenizer(SIM_TOKENIZER), list, session, clock=lambda: now[0]
        )
        try:
            assert mgr.mode("w") == MODE_APPROXIMATE
            desc = Descriptor("127.0.0.1", 1, "", 4, 1, None)
            mgr._states["w"] = _WorkerState(tokenizer=mgr.tokenizers.default, desc=desc)
            assert mgr.mode("w") == MODE_EXACT  # idle: silence is fine
            mgr.dispatched("w", _ids(8), NS0)
            assert mgr.match(_ids(9), NS0, ["w"]) == {"w": 8}  # predicted (hybrid)
            now[0] = 1.5
            assert mgr.mode("w") == MODE_DEGRADED
            assert mgr.match(_ids(9), NS0, ["w"]) == {}  # degraded: not answered here
            mgr._apply("w", 0, 0.0, [Stored([7, 8], None, _ids(8), 4)])
            assert mgr.mode("w") == MODE_EXACT
            assert mgr.match(_ids(9), NS0, ["w"]) == {"w": 8}
            assert mgr.match(_ids(9), (None, None, "k"), ["w"]) == {"w": 0}
            mgr._gap_lost("w", 0)
            assert mgr.mode("w") == MODE_DEGRADED
            now[0] = 3.0
            assert mgr.mode("w") == MODE_EXACT and mgr.match(_ids(9), NS0, ["w"]) == {"w": 0}
        finally:
            await mgr.close()


async def test_a_prompt_already_held_whole_arms_no_staleness() -> None:
    """A repeat whose every full block the worker holds stores nothing: no event follows
    it, and that silence must not turn the worker degraded (a shorter-than-a-block prompt
    neither); a prompt with one new block does arm the check."""
    now = [0.0]
    settings = KVEventsSettings(enabled="true", stale_timeout_s=1.0)
    import aiohttp

    async with aiohttp.ClientSession() as session:
        mgr = KVEventsManager(
            settings, load_tokenizer(SIM_TOKENIZER), list, session, clock=lambda: now[0]
        )
        try:
            desc = Descriptor("127.0.0.1", 1, "", 4, 1, None)
            mgr._states["w"] = _WorkerState(tokenizer=mgr.tokenizers.default, desc=desc)
            mgr._apply("w", 0, 0.0, [Stored([7, 8], None, _ids(8), 4)])
            mgr.dispatched("w", _ids(9), NS0)  # blocks 1-2 held; the 9th token is no block
            mgr.dispatched("w", _ids(3), NS0)  # no full block at all
            now[0] = 5.0
            assert mgr.mode("w") == MODE_EXACT
            mgr.dispatched("w", _ids(12), NS0)  # block 3 is new: an event must follow
            now[0] = 6.5
            assert mgr.mode("w") == MODE_DEGRADED
        finally:
            await mgr.close()


async def test_prepared_request_and_fidelity() -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        mgr = KVEventsManager(
            KVEventsSettings(enabled="true"), load_tokenizer(SIM_TOKENIZER), list, session
        )
        try:
            mgr._states["w"] = _WorkerState(
                tokenizer=mgr.tokenizers.default, desc=Descriptor("127.0.0.1", 1, "", 4, 1, None)
            )
            mgr._apply("w", 0, 0.0, [Stored([7], None, _ids(4), 4)])
            req = mgr.prepare("generate", b'{"input_ids":[1,2,3,4,5,6,7,8,9]}')
            assert req.match(["w", "other"]) == {"w": 4} and req.mode("other") == MODE_APPROXIMATE
            req.dispatched("w")
            assert req.match(["w"]) == {"w": 8}  # hybrid: its own blocks predicted
            req.observe("w", MODE_EXACT, 8, 4)
            f = mgr.fidelity[("w", MODE_EXACT)]
            assert (f.requests, f.predicted_tokens, f.true_predicted_tokens) == (1, 8, 4)
        finally:
            await mgr.close()


async def test_a_match_stops_one_token_short_of_the_prompt() -> None:
    """As SGLang's ``cached_tokens`` (measured on the real server, tests/sglang): at most
    ``(len - 1) // block_size`` blocks, so an exact repeat of a prompt of whole blocks
    matches one block less than it holds."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        mgr = KVEventsManager(
            KVEventsSettings(enabled="true", hybrid=False), load_tokenizer(SIM_TOKENIZER), list,
            session,
        )  # fmt: skip
        try:
            mgr._states["w"] = _WorkerState(
                tokenizer=mgr.tokenizers.default, desc=Descriptor("127.0.0.1", 1, "", 4, 1, None)
            )
            mgr._apply("w", 0, 0.0, [Stored([7, 8, 9], None, _ids(12), 4)])
            assert [mgr.match(_ids(n), NS0, ["w"])["w"] for n in (3, 4, 5, 8, 9, 12, 13)] == [
                0, 0, 4, 4, 8, 8, 12,
            ]  # fmt: skip
        finally:
            await mgr.close()


def test_config_section() -> None:
    from gateway.config import ConfigError, config_from_dict

    section = {"enabled": True, "stale_timeout_s": 2, "tokenizer": SIM_TOKENIZER}
    cfg = config_from_dict({"kv_events": section})
    assert cfg.kv_events.enabled and cfg.kv_events.stale_timeout_s == 2.0
    assert cfg.kv_events.tokenizer == SIM_TOKENIZER
    assert config_from_dict({}).kv_events.tokenizer == ""  # no tokenizer chosen by default
    for bad in (
        {"tokenizer": "gpt"},
        {"tokenizer": "sim"},
        {"enabled": True},  # exact mode without a tokenizer
        {"stale_timeout_s": 0},
        {"ttl_min_s": 20.0},
    ):
        with pytest.raises(ConfigError, match="kv_events"):
            config_from_dict({"kv_events": bad})
