"""The simulated SGLang worker with HiCache's host tier (``--enable-hierarchical-cache``,
issue 20), over HTTP and ZMQ on loopback.

A prompt the GPU evicted is loaded back from the host: ``/generate``'s
``meta_info.cached_tokens_details`` splits the hit ``{"device", "host"}``; ``/metrics``
has the host pool gauges, ``cached_tokens_total{cache_source="host"}``, the load-back and
backup counters; the KV events carry ``medium`` (``CPU_PINNED`` for the host copies) and
rebuild both tiers; ``/server_info`` and ``/_sim/stats`` describe the tier. Without the
flag none of it appears.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from loadtests.replay.workers import ModelWorker
from simulator.fleet import SimConfig, SimulatedFleet, SimulatedWorker
from simulator.http.kv_publisher import END_SEQ, digest_to_hash
from simulator.model.hiradix_cache import HiRadixCache
from simulator.model.radix_cache import encode_tokens

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*",'
    '"replay_endpoint":"tcp://127.0.0.1:*","topic":"kv"}'
)
A = list(range(1, 2001))  # two 2,000-token prompts; the GPU pool holds one
B = list(range(5001, 7001))


def _config(**changes: Any) -> SimConfig:
    return SimConfig(
        speed=50.0,
        page_size=16,
        capacity_tokens=3000,
        enable_metrics=True,
        kv_events_config=KV_CONFIG,
        **changes,
    )


@pytest.fixture
async def hicache_fleet() -> AsyncIterator[SimulatedFleet]:
    async with await SimulatedFleet.start(1, _config(enable_hierarchical_cache=True)) as fleet:
        yield fleet


def _worker(fleet: SimulatedFleet) -> SimulatedWorker:
    worker = fleet.workers[0]
    assert isinstance(worker, SimulatedWorker)
    return worker


async def _generate(client: aiohttp.ClientSession, url: str, ids: list[int]) -> Any:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    async with client.post(url + "/generate", json=body) as resp:
        assert resp.status == 200
        return (await resp.json())["meta_info"]


async def _get(client: aiohttp.ClientSession, url: str) -> Any:
    async with client.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


async def _metrics(client: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """``{(sample name, sorted labels), value}``, parsed by prometheus_client."""
    async with client.get(url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[sample.name, labels] = sample.value
    return out


def _value(samples: dict[tuple[str, str], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = {f"{k}={v}" for k, v in labels.items()}
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls.split(",")))


async def test_a_prompt_evicted_to_the_host_is_loaded_back_and_reported_as_host(
    hicache_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = hicache_fleet.urls[0]
    first = await _generate(client, url, A)
    assert first["cached_tokens"] == 0 and first["cached_tokens_details"] is None
    await _generate(client, url, B)  # evicts A from the GPU: it moves to the host
    again = await _generate(client, url, A)
    details = again["cached_tokens_details"]
    assert again["cached_tokens"] == 1984  # (2000 - 1) // 16 * 16: the whole usual hit
    assert details["host"] > 0 and details["device"] + details["host"] == 1984
    assert set(details) == {"device", "host"}  # no storage keys without an L3 backend

    samples = await _metrics(client, url)
    cached = "sglang:cached_tokens_total"
    assert _value(samples, cached, cache_source="host") == details["host"]
    assert _value(samples, cached, cache_source="device") == details["device"]
    # the host pool: 2 x the device pool (2,992 tokens in whole pages) plus a padding page
    assert _value(samples, "sglang:hicache_host_total_tokens") == 6000
    assert _value(samples, "sglang:hicache_host_used_tokens") > 0
    assert _value(samples, "sglang:load_back_tokens_total", pool="kv") == details["host"]
    assert _value(samples, "sglang:load_back_duration_seconds_count") == 1
    assert _value(samples, "sglang:hicache_backup_tokens_total", pool="kv") >= 2 * 1984
    assert _value(samples, "sglang:evicted_tokens_total", cache_type="UnifiedRadixCache") > 0
    effective = "sglang:prefill_effective_tokens_total"
    assert _value(samples, effective, mode="host_hit") == details["host"]
    dropped = "sglang:hicache_dropped_tokens_total"
    assert _value(samples, dropped, reason="write_through_unbacked_eviction") == 0

    stats = await _get(client, url + "/_sim/stats")
    assert stats["host_capacity_tokens"] == 6000
    assert stats["cached_host_tokens_total"] == details["host"]
    assert stats["hicache_load_tokens_total"] == details["host"]


async def _post(client: aiohttp.ClientSession, url: str, path: str, body: Any) -> bytes:
    async with client.post(url + path, json=body) as resp:
        assert resp.status == 200
        return await resp.read()


async def test_openai_routes_answer_return_cached_tokens_details_in_sglext(
    hicache_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = hicache_fleet.urls[0]
    for ids in (A, B):
        await _generate(client, url, ids)
    body = {"model": "m", "prompt": A, "max_tokens": 2, "return_cached_tokens_details": True}
    doc = orjson.loads(await _post(client, url, "/v1/completions", body))
    assert list(doc)[-2:] == ["metadata", "sglext"]
    details = doc["sglext"]["cached_tokens_details"]
    assert details["host"] > 0 and details["device"] + details["host"] == 1984
    # streamed: one chunk of its own, after the finish and before the usage chunk
    await _generate(client, url, B)  # A back to the host
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    raw = await _post(client, url, "/v1/completions", stream)
    chunks = [orjson.loads(e[6:]) for e in raw.decode().split("\n\n") if e[6:7] == "{"]
    assert [("sglext" in c, c["usage"] is not None) for c in chunks[-3:]] == [
        (False, False), (True, False), (False, True)
    ]  # fmt: skip
    assert chunks[-2]["choices"] == [] and chunks[-2]["sglext"]["cached_tokens_details"]["host"]
    # chat: a repeat hits the GPU; without the flag no sglext
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}],
            "max_tokens": 2, "return_cached_tokens_details": True}  # fmt: skip
    await _post(client, url, "/v1/chat/completions", chat)
    doc = orjson.loads(await _post(client, url, "/v1/chat/completions", chat))
    assert doc["sglext"]["cached_tokens_details"]["host"] == 0
    assert doc["sglext"]["cached_tokens_details"]["device"] > 0
    plain = orjson.loads(
        await _post(
            client, url, "/v1/chat/completions", {**chat, "return_cached_tokens_details": False}
        )
    )
    assert "sglext" not in plain


async def test_server_info_names_the_tier_and_loads_are_sglangs(
    hicache_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = hicache_fleet.urls[0]
    info = await _get(client, url + "/server_info")
    assert info["enable_hierarchical_cache"] is True
    assert info["hicache_ratio"] == 2.0 and info["hicache_size"] == 0
    assert info["hicache_write_policy"] == "write_through"
    assert info["hicache_io_backend"] == "kernel"
    assert info["sim_hicache_link"] == "pcie-gen5-x16"
    loads = await _get(client, url + "/v1/loads")
    assert not any("hicache" in key or "host" in key for key in loads["loads"][0])


async def _replay(ctx: zmq.asyncio.Context, port: int) -> list[list[Any]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    await dealer.send_multipart([b"", struct.pack(">Q", 0)])
    batches: list[list[Any]] = []
    async with asyncio.timeout(5):
        while True:
            frames = await dealer.recv_multipart()
            if frames[2] == struct.pack(">Q", END_SEQ):
                return batches
            batches.append(msgpack.unpackb(frames[3]))


def _apply(batches: list[list[Any]]) -> dict[str, set[int]]:
    """The blocks a consumer following the events holds, per medium."""
    held: dict[str, set[int]] = {"GPU": set(), "CPU_PINNED": set()}
    for batch in batches:
        for event in batch[1]:
            if event["type"] == "AllBlocksCleared":
                for blocks in held.values():
                    blocks.clear()
            elif event["type"] == "BlockStored":
                held[event["medium"]].update(event["block_hashes"])
            else:
                held[event["medium"]].difference_update(event["block_hashes"])
    return held


def _tiers(cache: HiRadixCache) -> dict[str, set[int]]:
    gpu: set[int] = set()
    host: set[int] = set()
    for node in cache.iter_nodes():
        hashes = {digest_to_hash(d) for d in node.meta}
        gpu |= hashes
        if getattr(node, "backuped", False):
            host |= hashes
    for node in cache.iter_host_nodes():
        host |= {digest_to_hash(d) for d in node.meta}
    return {"GPU": gpu, "CPU_PINNED": host}


async def test_kv_events_carry_the_medium_and_rebuild_both_tiers(
    hicache_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = hicache_fleet.urls[0]
    for ids in (A, B, A):
        await _generate(client, url, ids)
    desc = (await _get(client, url + "/server_info"))["kv_events"]
    cache = _worker(hicache_fleet).engine.tiered
    assert cache is not None
    ctx = zmq.asyncio.Context()
    try:
        # the last batch may go out just after the answer: replay until it has (a safety
        # net of 10 s, not a timing check)
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            batches = await _replay(ctx, desc["replay_endpoint_port_base"])
            if _apply(batches) == _tiers(cache):
                break
            assert asyncio.get_running_loop().time() < deadline, "events never matched"
            await asyncio.sleep(0.02)
    finally:
        ctx.destroy(linger=0)
    events = [event for batch in batches for event in batch[1]]
    kinds = {(e["type"], e.get("medium")) for e in events}
    assert ("BlockStored", "CPU_PINNED") in kinds and ("BlockRemoved", "GPU") in kinds
    assert all(e["block_size"] == 16 for e in events if e["type"] == "BlockStored")


async def test_flush_cache_clears_both_tiers(
    hicache_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = hicache_fleet.urls[0]
    for ids in (A, B):
        await _generate(client, url, ids)
    cache = _worker(hicache_fleet).engine.tiered
    assert cache is not None and cache.host_used > 0
    async with client.post(url + "/flush_cache") as resp:
        assert resp.status == 200
    assert cache.host_used == 0 and not list(cache.iter_host_nodes())
    again = await _generate(client, url, A)
    assert again["cached_tokens"] == 0 and again["cached_tokens_details"] is None


async def test_without_the_flag_nothing_of_the_tier_appears(
    client: aiohttp.ClientSession,
) -> None:
    async with await SimulatedFleet.start(1, _config()) as fleet:
        url = fleet.urls[0]
        await _generate(client, url, A)
        hit = await _generate(client, url, A)
        assert hit["cached_tokens"] == 1984 and hit["cached_tokens_details"] is None
        samples = await _metrics(client, url)
        assert not any("hicache" in name or "load_back" in name for name, _ in samples)
        assert _value(samples, "sglang:cached_tokens_total", cache_source="device") == 1984
        info = await _get(client, url + "/server_info")
        assert "enable_hierarchical_cache" not in info
        body = {"model": "m", "prompt": A, "max_tokens": 2, "return_cached_tokens_details": True}
        assert "sglext" not in orjson.loads(await _post(client, url, "/v1/completions", body))
        assert _worker(fleet).engine.tiered is None


async def test_a_replay_worker_reports_what_the_live_worker_reports(
    hicache_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    """The offline replay's worker, built from the same SimConfig, reports the same cached
    tokens as the live HTTP worker for the same requests one at a time (host hits
    included): HiCache on or off is a setting of the replay like any other."""
    url = hicache_fleet.urls[0]
    replay = ModelWorker(_config(enable_hierarchical_cache=True))
    C = A[:1000] + list(range(9001, 10_001))
    sequence = [A, B, A, C, B, A, C]
    live = [(await _generate(client, url, ids))["cached_tokens"] for ids in sequence]
    offline = []
    now = 0.0
    for i, ids in enumerate(sequence):
        replay.submit(f"r{i}", encode_tokens(ids), 2, now)
        while (stepped := replay.step(now)) is not None:
            now += stepped[0]
            offline += [o.cached_tokens for o in stepped[1] if o.finished]
    assert live == offline
    assert live[2] == 1984 and min(live[1:]) < 1984  # A back from the host; a partial hit
    assert replay.model.tiered is not None and replay.model.tiered.counters.load_tokens > 0
