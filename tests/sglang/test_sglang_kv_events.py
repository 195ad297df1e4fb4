"""KV-cache events of real SGLang 0.5.23, against the simulator's publisher and the
gateway's consumer: ZMQ framing, msgpack encoding, block hashes, ``AllBlocksCleared``,
replay, and the two endpoint forms (``"bind": true`` and the connect form).

Servers: ``sglang_pair[0]`` publishes with ``"bind": true`` on ``tcp://127.0.0.1:P`` (and a
replay ROUTER), ``sglang_pair[1]`` with ``"endpoint": "tcp://127.0.0.1:P"`` alone, which
SGLang *connects* (a subscriber must bind that address to hear it).
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio
from sglang_helpers import PAGE, call, chat_body, post_json, simulated, token_ids

from gateway.exact.wire import END_SEQ, Cleared, Descriptor, Stored, decode_batch
from loadtests.engine.sglang_fleet import SGLangFleet
from loadtests.harness.inprocess import run_gateway
from loadtests.harness.ports import free_port

pytestmark = pytest.mark.sglang

QUIET_S = 3.0  # how long "nothing arrives" is watched


def sglang_block_hashes(ids: list[int], page: int) -> list[int]:
    """SGLang 0.5.9+'s block hashes (SGLANG_API.md §4.4), written from the spec: SHA-256
    over each page's little-endian u32 tokens, chained on the previous page's digest; the
    published hash is the digest's first 8 bytes, big-endian signed."""
    out, prev = [], b""
    for start in range(0, len(ids) - len(ids) % page, page):
        prev = hashlib.sha256(prev + struct.pack(f"<{page}I", *ids[start : start + page])).digest()
        out.append(int.from_bytes(prev[:8], "big", signed=True))
    return out


def test_the_hash_spec_matches_its_published_test_vector() -> None:
    """SGLANG_API.md §4.4's vector (checked there against SGLang 0.5.9's own code)."""
    assert sglang_block_hashes(list(range(1, 9)), 4) == [-3488128144981237669, 5674439469042975057]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def zctx() -> Any:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def descriptor(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    status, _, data = await call(http, "GET", base + "/server_info")
    assert status == 200
    desc: dict[str, Any] = orjson.loads(data)["kv_events"]
    return desc


async def receive(sock: Any, timeout_s: float) -> list[list[bytes]]:
    """Every multipart message arriving within ``timeout_s``."""
    out: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            out.append(await asyncio.wait_for(sock.recv_multipart(), left))
        except TimeoutError:
            break
    return out


async def until_event(sock: Any, want: type, timeout_s: float = 15.0) -> list[list[bytes]]:
    """Messages up to and including the first batch holding an event of type ``want``."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), deadline - time.monotonic())
        except TimeoutError:
            break
        got.append(frames)
        if any(isinstance(e, want) for e in decode_batch(frames[2])[1]):
            return got
    raise AssertionError(f"no {want.__name__} within {timeout_s} s; got {len(got)} batches")


async def generate(http: aiohttp.ClientSession, base: str, ids: list[int]) -> int:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    doc = await post_json(http, base + "/generate", body)
    cached: int = doc["meta_info"]["cached_tokens"]
    return cached


def bound_sim_config() -> str:
    return '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","topic":"kv","replay_endpoint":"tcp://127.0.0.1:*"}'


async def check_bound_publisher(http: aiohttp.ClientSession, zctx: Any, base: str) -> None:
    """What a subscriber that connects to the advertised endpoint sees (both servers)."""
    desc = await descriptor(http, base)
    parsed = Descriptor.parse(desc, base)
    assert parsed is not None and parsed.block_size == PAGE and parsed.topic == "kv"
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://{parsed.host}:{parsed.port_base}")
    await asyncio.sleep(0.5)  # slow joiner: PUB drops what it sends before the subscription
    ids = token_ids(100, 40)
    assert await generate(http, base, ids) == 0
    msgs = await until_event(sub, Stored)
    seqs = []
    for frames in msgs:
        assert len(frames) == 3 and frames[0] == b"kv" and len(frames[1]) == 8
        seqs.append(struct.unpack(">Q", frames[1])[0])
        body = msgpack.unpackb(frames[2], raw=False)
        assert isinstance(body, list) and len(body) == 3
        assert isinstance(body[0], float) and body[2] == 0  # [ts, events, dp_rank]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    raw_events = msgpack.unpackb(msgs[-1][2], raw=False)[1]
    stored = [e for e in raw_events if e.get("type") == "BlockStored"]
    assert stored, raw_events
    first = stored[0]
    # 0.5.23: tagged maps; parent/lora_id always present (null), medium "GPU" even on a CPU
    assert list(first) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                           "block_size", "lora_id", "medium"]  # fmt: skip
    assert first["parent_block_hash"] is None and first["lora_id"] is None
    assert first["medium"] == "GPU" and first["block_size"] == PAGE
    # the prompt's two full pages (40 tokens: 32 stored), hashes as SGLang's spec says
    assert first["token_ids"] == ids[:32]
    assert first["block_hashes"] == sglang_block_hashes(ids, PAGE)
    # a new tail on the cached prefix: a store chained on the last page
    longer = ids + token_ids(101, 30)
    assert await generate(http, base, longer) == 32
    batches = await until_event(sub, Stored)
    more = [event for frames in batches for event in decode_batch(frames[2])[1]]
    chained = next(e for e in more if isinstance(e, Stored))
    assert chained.parent == first["block_hashes"][-1]
    assert (
        chained.block_hashes == sglang_block_hashes(longer, PAGE)[2 : 2 + len(chained.block_hashes)]
    )
    # /flush_cache: AllBlocksCleared
    status, _, _ = await call(http, "POST", base + "/flush_cache?timeout=5")
    assert status == 200
    await until_event(sub, Cleared)
    # replay from seq 0: [b"", topic, seq8, payload] per batch, then [b"", b"", END, b""]
    assert parsed.replay_port_base is not None
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://{parsed.host}:{parsed.replay_port_base}")
    await dealer.send_multipart([b"", struct.pack(">Q", 0)])
    replies = []
    while True:
        frames = await asyncio.wait_for(dealer.recv_multipart(), 5.0)
        replies.append(frames)
        if struct.unpack(">Q", frames[2])[0] == END_SEQ:
            break
    assert replies[-1] == [b"", b"", struct.pack(">Q", END_SEQ), b""]
    assert all(len(f) == 4 and f[0] == b"" and f[1] == b"kv" for f in replies[:-1])
    replayed = [struct.unpack(">Q", f[2])[0] for f in replies[:-1]]
    assert replayed == list(range(len(replayed))) and replayed[-1] >= seqs[-1]
    # the start-up reset is the first batch ever published
    assert any(isinstance(e, Cleared) for e in decode_batch(replies[0][3])[1])
    dealer.close(linger=0)
    sub.close(linger=0)


async def test_bound_publisher_real(
    sglang_pair: SGLangFleet, http: aiohttp.ClientSession, zctx: Any
) -> None:
    await check_bound_publisher(http, zctx, sglang_pair.servers[0].url)


async def test_bound_publisher_simulated(http: aiohttp.ClientSession, zctx: Any) -> None:
    async with simulated(bound_sim_config()) as url:
        await check_bound_publisher(http, zctx, url)


async def check_connecting_publisher(
    http: aiohttp.ClientSession, zctx: Any, base: str, endpoint: str
) -> None:
    """Connect form: the descriptor looks the same, nothing listens there, so a SUB that
    connects hears nothing; a SUB that binds the endpoint hears the events."""
    desc = await descriptor(http, base)
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    assert (desc["endpoint_host"], desc["endpoint_port_base"]) == (host, int(port))
    connecting = zctx.socket(zmq.SUB)
    connecting.setsockopt(zmq.SUBSCRIBE, b"")
    connecting.connect(endpoint)
    await asyncio.sleep(0.5)
    await generate(http, base, token_ids(200, 40))
    assert await receive(connecting, QUIET_S) == []
    connecting.close(linger=0)
    binding = zctx.socket(zmq.SUB)
    binding.setsockopt(zmq.SUBSCRIBE, b"")
    binding.bind(endpoint)
    # the publisher redials us (ZMQ retries every 100 ms or so, and a batch sent before
    # the subscription reached it is dropped): a new prompt per try until events arrive
    for attempt in range(10):
        ids = token_ids(201 + attempt, 40)
        await generate(http, base, ids)
        msgs = await receive(binding, 1.5)
        stored = [e for m in msgs for e in decode_batch(m[2])[1] if isinstance(e, Stored)]
        if stored:
            break
    assert stored, "a binding subscriber heard nothing"
    assert stored[0].block_hashes == sglang_block_hashes(ids, PAGE)
    binding.close(linger=0)


async def test_connecting_publisher_real(
    sglang_pair: SGLangFleet, http: aiohttp.ClientSession, zctx: Any
) -> None:
    server = sglang_pair.servers[1]
    assert server.kv_events_config is not None and '"bind"' not in server.kv_events_config
    await check_connecting_publisher(http, zctx, server.url, f"tcp://127.0.0.1:{server.kv_port}")


async def test_connecting_publisher_simulated(http: aiohttp.ClientSession, zctx: Any) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = f'{{"publisher":"zmq","endpoint":"{endpoint}","topic":"kv"}}'
    async with simulated(config) as url:
        await check_connecting_publisher(http, zctx, url, endpoint)


async def index_mode(http: aiohttp.ClientSession, gateway: str) -> str:
    status, _, data = await call(http, "GET", gateway + "/dashboard/data")
    assert status == 200
    mode: str = orjson.loads(data)["workers"][0]["index_mode"]
    return mode


@pytest.mark.parametrize(("server", "expected"), [(0, "exact"), (1, "degraded")])
async def test_the_gateway_follows_the_bound_form_only(
    sglang_pair: SGLangFleet, http: aiohttp.ClientSession, sglang_model: Any,
    server: int, expected: str,
) -> None:  # fmt: skip
    """The gateway's consumer connects a SUB to the advertised endpoint: it follows the
    ``"bind": true`` worker (``exact`` mode after a request), and hears nothing from the
    connect-form one, whose descriptor looks the same, so after a request and
    ``stale_timeout_s`` of silence that worker is ``degraded`` (routing falls back to the
    approximate index). docs/REAL_ENGINE.md: configure workers with ``"bind": true``."""
    async with run_gateway(
        [sglang_pair.servers[server].url],
        ready_within_s=10.0,
        policy__name="min_ttft",
        kv_events__enabled=True,
        kv_events__tokenizer=f"hf:{sglang_model}",
        kv_events__stale_timeout_s=1.0,
    ) as gw:
        await asyncio.sleep(0.5)
        assert await index_mode(http, gw.url) == "exact"  # discovered, nothing awaited yet
        await post_json(http, gw.url + "/v1/chat/completions", chat_body(400 + server, 48))
        await asyncio.sleep(2.0)
        assert await index_mode(http, gw.url) == expected
