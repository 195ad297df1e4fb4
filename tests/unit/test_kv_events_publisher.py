"""The simulated worker's KV-event publisher against SGLANG_API.md §4 (bytes and hashes)."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from simulator.config import KVEventsConfig
from simulator.http.kv_publisher import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventRecorder,
    KVEventPublisher,
    digest_to_hash,
    encode_batch,
    page_digests,
    salt_seed,
)
from simulator.model.radix_cache import RadixCache, encode_tokens


def test_hash_vector() -> None:
    digests = page_digests([1, 2, 3, 4, 5, 6, 7, 8], 4, None)
    assert digests[0].hex().startswith("cf97adee") and digests[0].hex().endswith("2ab733b72")
    assert digests[1].hex().startswith("4ebfa8a1") and digests[1].hex().endswith("0f54396d6")
    assert [digest_to_hash(d) for d in digests] == [-3488128144981237669, 5674439469042975057]


def test_partial_page_not_hashed_and_chain_continues() -> None:
    whole = page_digests(list(range(1, 13)), 4, None)
    assert len(page_digests(list(range(1, 11)), 4, None)) == 2
    assert page_digests(list(range(5, 13)), 4, whole[0]) == whole[1:]


def _f64(x: float) -> bytes:
    return b"\xcb" + struct.pack(">d", x)


def _s(text: str) -> bytes:
    raw = text.encode()
    return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else b"\xd9" + bytes([len(raw)])) + raw


def test_map_encoding_reference_bytes() -> None:
    events: list[Event] = [
        BlockStored([1234567890123, -42], None, [1, 2, 3, 4, 5, 6, 7, 8], 4),
        BlockRemoved([-42]),
        AllBlocksCleared(),
    ]
    stored = (
        b"\x87"
        + _s("type")
        + _s("BlockStored")
        + _s("block_hashes")
        + b"\x92\xcf"
        + struct.pack(">Q", 1234567890123)
        + b"\xd0\xd6"
        + _s("parent_block_hash")
        + b"\xc0"
        + _s("token_ids")
        + b"\x98\x01\x02\x03\x04\x05\x06\x07\x08"
        + _s("block_size")
        + b"\x04"
        + _s("lora_id")
        + b"\xc0"
        + _s("medium")
        + _s("GPU")
    )
    removed = (
        b"\x83"
        + _s("type")
        + _s("BlockRemoved")
        + _s("block_hashes")
        + b"\x91\xd0\xd6"
        + _s("medium")
        + _s("GPU")
    )
    cleared = b"\x81" + _s("type") + _s("AllBlocksCleared")
    expected = b"\x93" + _f64(1700000000.5) + b"\x93" + stored + removed + cleared + b"\x00"
    assert encode_batch(1700000000.5, events, 0) == expected


def test_array_encoding_matches_reference() -> None:
    events: list[Event] = [
        BlockStored([1234567890123, -42], None, [1, 2, 3, 4, 5, 6, 7, 8], 4),
        BlockRemoved([-42]),
        AllBlocksCleared(),
    ]
    decoded = msgpack.unpackb(encode_batch(1700000000.5, events, 0, legacy_array=True))
    assert decoded == [
        1700000000.5,
        [
            ["BlockStored", [1234567890123, -42], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"],
            ["BlockRemoved", [-42], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]


def _cache(page: int = 4, capacity: int = 64) -> tuple[RadixCache, EventRecorder]:
    recorder = EventRecorder(page)
    recorder.take()  # the startup AllBlocksCleared
    return RadixCache(capacity, page, recorder), recorder


def test_recorder_store_split_remove_clear() -> None:
    cache, rec = _cache()
    cache.insert(encode_tokens(list(range(1, 13))))
    (stored,) = rec.take()
    assert isinstance(stored, BlockStored)
    whole = [digest_to_hash(d) for d in page_digests(list(range(1, 13)), 4, None)]
    assert stored.block_hashes == whole and stored.parent_block_hash is None
    # diverges after page 1: the split emits nothing; the new node links to page 0
    cache.insert(encode_tokens([1, 2, 3, 4, 9, 9, 9, 9]))
    (branch,) = rec.take()
    assert isinstance(branch, BlockStored) and branch.parent_block_hash == whole[0]
    assert branch.block_hashes == [
        digest_to_hash(page_digests([1, 2, 3, 4, 9, 9, 9, 9], 4, None)[1])
    ]
    # extend the first branch: parent = last page of the split lower node
    cache.insert(encode_tokens([*range(1, 13), 7, 7, 7, 7]))
    (ext,) = rec.take()
    assert isinstance(ext, BlockStored) and ext.parent_block_hash == whole[2]
    cache.evict(100)
    removed = rec.take()
    assert len(removed) == 1 and isinstance(removed[0], BlockRemoved)
    assert sorted(removed[0].block_hashes) == sorted(
        [*whole, *branch.block_hashes, *ext.block_hashes]
    )
    cache.reset()
    assert [type(e) for e in rec.take()] == [AllBlocksCleared]


def test_recorder_coalesces_chained_stores() -> None:
    cache, rec = _cache()
    cache.insert(encode_tokens([1, 2, 3, 4]))
    cache.insert(encode_tokens([1, 2, 3, 4, 5, 6, 7, 8]))
    (event,) = rec.take()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [-3488128144981237669, 5674439469042975057]
    assert event.token_ids == list(range(1, 9))


def test_recorder_salt_seeds_chain() -> None:
    cache, rec = _cache()
    cache.insert(encode_tokens([1, 2, 3, 4]), "\x1f\x1fs1")
    (event,) = rec.take()
    assert isinstance(event, BlockStored) and event.cache_salt == "s1"
    assert event.block_hashes == [digest_to_hash(page_digests([1, 2, 3, 4], 4, salt_seed("s1"))[0])]


def test_config_parse() -> None:
    cfg = KVEventsConfig.from_json('{"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv"}')
    assert cfg.enabled and cfg.topic == "kv" and cfg.replay_endpoint is None
    with pytest.raises(ValueError):
        KVEventsConfig.from_json('{"publisher":"kafka"}')


async def _first_stored(sub: zmq.asyncio.Socket) -> tuple[bytes, bytes, list[Any]]:
    """The first message whose batch starts with a BlockStored (resets may come first)."""
    while True:
        topic, seq8, payload = await sub.recv_multipart()
        batch = msgpack.unpackb(payload)
        if batch[1] and batch[1][0]["type"] == "BlockStored":
            return topic, seq8, batch


async def test_publish_and_replay_on_the_wire() -> None:
    cfg = KVEventsConfig.from_json(
        '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","topic":"kv",'
        '"replay_endpoint":"tcp://127.0.0.1:*"}'
    )
    pub = KVEventPublisher(cfg, page_size=4)
    ctx = zmq.asyncio.Context()
    try:
        pub.start()  # batch 0: AllBlocksCleared, sent before anyone subscribed
        desc = pub.descriptor()
        assert desc["block_size"] == 4 and desc["dp_size"] == 1 and desc["topic"] == "kv"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{desc['endpoint_port_base']}")
        cache = RadixCache(64, 4, pub.recorder)
        for _ in range(200):  # slow joiner: publish until the subscription is live
            cache.insert(encode_tokens([1, 2, 3, 4]))
            pub.flush()
            if await sub.poll(10):
                break
            cache.reset()
            pub.flush()
        async with asyncio.timeout(5):
            topic, seq8, (ts, events, rank) = await _first_stored(sub)
        assert topic == b"kv" and len(seq8) == 8
        assert isinstance(ts, float) and rank == 0
        assert events[0]["block_hashes"] == [-3488128144981237669]  # the §4.4 vector, page 0
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{desc['replay_endpoint_port_base']}")
        await dealer.send_multipart([b"", struct.pack(">Q", 0)])
        replies = []
        async with asyncio.timeout(5):
            while True:
                frames = await dealer.recv_multipart()
                replies.append(frames)
                if frames[2] == struct.pack(">Q", END_SEQ):
                    break
        assert replies[-1] == [b"", b"", struct.pack(">Q", END_SEQ), b""]
        seqs = [struct.unpack(">Q", f[2])[0] for f in replies[:-1]]
        assert seqs == list(range(len(seqs))) and struct.unpack(">Q", seq8)[0] in seqs
        first = msgpack.unpackb(replies[0][3])
        assert replies[0][1] == b"kv" and first[1] == [{"type": "AllBlocksCleared"}]
    finally:
        ctx.destroy(linger=0)
        await pub.close()
