"""Shared state against a real Redis (127.0.0.1:6379), with fake index and fleet targets.

Each test uses its own random key prefix and deletes it afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from gateway.peers.codec import (
    CodecError,
    pack_items,
    pack_load,
    stream_id,
    unpack_items,
    unpack_load,
)
from gateway.peers.state import SharedSettings, SharedState
from loadtests.harness.ports import free_port
from loadtests.harness.redis import delete_prefix, redis_answers

REDIS_URL = "redis://127.0.0.1:6379/0"


class FakeIndex:
    def __init__(self) -> None:
        self.records: list[tuple[list[int], str]] = []

    def record(self, block_hashes: Sequence[int], worker_id: str) -> None:
        self.records.append((list(block_hashes), worker_id))

    def workers(self) -> list[str]:
        return sorted({w for _, w in self.records})

    def blocks(self, worker_id: str) -> Sequence[int]:
        seen: dict[int, None] = {}
        for hashes, w in reversed(self.records):
            if w == worker_id:
                for h in hashes:
                    seen.setdefault(h, None)
        return list(seen)


class FakeFleet:
    def __init__(self, urls: Sequence[str] = ()) -> None:
        self.states = {u: "active" for u in urls}
        self.load: dict[str, tuple[int, int, int]] = {}
        self.peer_load: dict[str, tuple[int, int, int]] = {}

    def local_load(self) -> dict[str, tuple[int, int, int]]:
        return dict(self.load)

    def set_peer_load(self, load: Mapping[str, tuple[int, int, int]]) -> None:
        self.peer_load = dict(load)

    def worker_states(self) -> dict[str, str]:
        return dict(self.states)

    def apply_workers(self, states: Mapping[str, str], keep: frozenset[str]) -> None:
        kept = {u: s for u, s in self.states.items() if u in keep}
        self.states = {u: s for u, s in states.items() if u not in keep} | kept

    def knows(self, worker_id: str) -> bool:
        return worker_id.startswith("w")


async def eventually(check: Callable[[], bool], within_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture
async def settings() -> AsyncIterator[SharedSettings]:
    if not await redis_answers(REDIS_URL):
        pytest.skip("no Redis on 127.0.0.1:6379")
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    yield SharedSettings(url=REDIS_URL, prefix=prefix, tick_s=0.02, load_ttl_s=0.3)
    await delete_prefix(REDIS_URL, prefix)


@contextlib.asynccontextmanager
async def running(state: SharedState) -> AsyncIterator[SharedState]:
    task = asyncio.get_running_loop().create_task(state.run())
    try:
        yield state
    finally:
        state.stop()
        await asyncio.wait_for(task, 3)


def test_codec_round_trip() -> None:
    items = [("w-1", [1, 2**64 - 1, 0]), ("é", []), ("w-2", [42])]
    assert list(unpack_items(pack_items(items))) == items
    assert unpack_load(pack_load((3, 400, 1))) == (3, 400, 1)
    assert unpack_load(b"x,1") is None
    assert stream_id(b"17-3") > stream_id("17-2") > stream_id("9")
    with pytest.raises(CodecError):
        list(unpack_items(pack_items(items)[:-3]))


def test_record_queue_is_bounded_and_deduplicated() -> None:
    state = SharedState(SharedSettings(url=REDIS_URL, queue_size=2), FakeIndex(), FakeFleet())
    state.record([1, 2], "w1")
    state.record([5, 2], "w1")  # same worker, same last hash: the same prefix
    state.record([3], "w1")
    state.record([4], "w1")
    assert state.dropped["records"] == 1


@pytest.mark.redis
async def test_peer_records_are_applied_not_own(settings: SharedSettings) -> None:
    ia, ib = FakeIndex(), FakeIndex()
    a = SharedState(replace(settings, gateway_id="a"), ia, FakeFleet())
    b = SharedState(replace(settings, gateway_id="b"), ib, FakeFleet())
    async with running(a), running(b):
        await asyncio.wait_for(a.synced.wait(), 2)
        await asyncio.wait_for(b.synced.wait(), 2)
        a.record([11, 12, 13], "w1")
        a.record([99], "x-unknown")  # a worker b does not know: not applied
        await eventually(lambda: ([11, 12, 13], "w1") in ib.records)
        assert not ia.records
        assert all(w != "x-unknown" for _, w in ib.records)
        assert b.lag.counts and sum(b.lag.counts) >= 1
        assert not b.degraded and a.published_records == 2


@pytest.mark.redis
async def test_load_is_summed_over_live_peers_and_expires(settings: SharedSettings) -> None:
    fa, fb, fc = FakeFleet(), FakeFleet(), FakeFleet()
    fa.load = {"w1": (3, 300, 1)}
    fb.load = {"w1": (1, 100, 0), "w2": (2, 0, 2)}
    a = SharedState(replace(settings, gateway_id="a"), FakeIndex(), fa)
    b = SharedState(replace(settings, gateway_id="b"), FakeIndex(), fb)
    c = SharedState(replace(settings, gateway_id="c"), FakeIndex(), fc)
    async with running(c):
        async with running(a), running(b):
            await eventually(lambda: fc.peer_load == {"w1": (4, 400, 1), "w2": (2, 0, 2)})
            await eventually(lambda: fa.peer_load == {"w1": (1, 100, 0), "w2": (2, 0, 2)})
            fb.load = {"w1": (1, 100, 0)}  # w2 gone from b: its field is deleted
            await eventually(lambda: fc.peer_load == {"w1": (4, 400, 1)})
        await eventually(lambda: fc.peer_load == {}, within_s=3.0)  # a and b expired


@pytest.mark.redis
async def test_worker_set_is_shared_and_persists(settings: SharedSettings) -> None:
    fa, fb = FakeFleet(["http://127.0.0.1:1"]), FakeFleet(["http://127.0.0.1:9"])
    a = SharedState(replace(settings, gateway_id="a"), FakeIndex(), fa)
    async with running(a):
        await asyncio.wait_for(a.synced.wait(), 2)
        b = SharedState(replace(settings, gateway_id="b"), FakeIndex(), fb)
        async with running(b):
            # a seeded the set; b's own --worker-urls lose to it
            await eventually(lambda: fb.states == {"http://127.0.0.1:1": "active"})
            fa.states["http://127.0.0.1:2"] = "active"
            fa.states["http://127.0.0.1:1"] = "draining"
            await eventually(lambda: fb.states.get("http://127.0.0.1:2") == "active")
            await eventually(lambda: fb.states.get("http://127.0.0.1:1") == "draining")
            del fb.states["http://127.0.0.1:2"]
            await eventually(lambda: "http://127.0.0.1:2" not in fa.states)
    fresh = FakeFleet()
    c = SharedState(replace(settings, gateway_id="c"), FakeIndex(), fresh)
    async with running(c):
        await eventually(lambda: fresh.states == {"http://127.0.0.1:1": "draining"})


@pytest.mark.redis
async def test_catch_up_from_snapshot_when_stream_trimmed(settings: SharedSettings) -> None:
    ia = FakeIndex()
    a = SharedState(replace(settings, gateway_id="a", snapshot_interval_s=0.05), ia, FakeFleet())
    async with running(a):
        await asyncio.wait_for(a.synced.wait(), 2)
        ia.record([1, 2, 3], "w1")  # a's local index (as the gateway records it)
        a.record([1, 2, 3], "w1")
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            snap = "{" + settings.prefix + "}:snapshot"
            await eventually(lambda: a.published_records == 1)
            for _ in range(100):
                if await client.exists(snap):
                    break
                await asyncio.sleep(0.02)
            await client.xtrim("{" + settings.prefix + "}:index", maxlen=0)
        finally:
            await client.aclose()
    ic = FakeIndex()
    c = SharedState(replace(settings, gateway_id="c"), ic, FakeFleet())
    async with running(c):
        await eventually(lambda: ([1, 2, 3], "w1") in ic.records)


@pytest.mark.redis
async def test_restarted_gateway_catches_up_from_stream(settings: SharedSettings) -> None:
    a = SharedState(replace(settings, gateway_id="a"), FakeIndex(), FakeFleet())
    async with running(a):
        await asyncio.wait_for(a.synced.wait(), 2)
        for i in range(1200):  # several read batches' worth of entries
            a.record([i, i + 10_000], "w1")
            if i % 100 == 0:
                await asyncio.sleep(0.03)
        await eventually(lambda: a.published_records == 1200)
    ib = FakeIndex()
    b = SharedState(replace(settings, gateway_id="b"), ib, FakeFleet())
    async with running(b):
        await asyncio.wait_for(b.synced.wait(), 5)
        assert len(ib.records) == 1200  # synced only once the stream was read


async def test_unreachable_redis_is_degraded_and_drops_counted() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    fleet = FakeFleet()
    fleet.peer_load = {"w1": (1, 1, 1)}
    state = SharedState(
        SharedSettings(url=url, queue_size=3, backoff_max_s=0.05, timeout_s=0.1),
        FakeIndex(),
        fleet,
    )
    async with running(state):
        await eventually(lambda: state.reconnects >= 2)
        for i in range(5):
            state.record([i], "w1")
        assert state.degraded
        assert state.dropped["records"] == 2
