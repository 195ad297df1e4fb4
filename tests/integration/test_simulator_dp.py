"""The simulated SGLang worker with data-parallel ranks (``--dp-size``, issue 19).

Each rank has its own radix cache: a prompt cached on one rank is a miss on the other. A
request goes to the rank its ``routed_dp_rank`` (or ``data_parallel_rank``, or the
``X-Data-Parallel-Rank`` header) names, else round robin; an out-of-range rank is SGLang's
``ValueError``. ``/server_info``, ``/v1/loads``, ``/metrics``, ``/_sim/stats`` and the KV
events (rank r on ``port + r``, rank r in every batch) report each rank.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from loadtests.harness.ports import free_port_range
from simulator.fleet import SimConfig, SimulatedFleet, SimulatedWorker
from simulator.http.kv_publisher import END_SEQ
from simulator.model.radix_cache import RadixCache

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*",'
    '"replay_endpoint":"tcp://127.0.0.1:*","topic":"kv"}'
)
RANGE_ERROR = "routed_dp_rank={} out of range [0, 2)"


def _text(doc: int, words: int = 60) -> str:
    return " ".join(f"d{doc}w{i}" for i in range(words))


async def _eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` until it holds (a safety net of 10 s, not a timing assertion)."""
    deadline = asyncio.get_running_loop().time() + 10
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("never happened")
        await asyncio.sleep(0.01)


@pytest.fixture
async def dp_fleet() -> AsyncIterator[SimulatedFleet]:
    config = SimConfig(speed=50.0, capacity_tokens=20_000, dp_size=2, kv_events_config=KV_CONFIG)
    async with await SimulatedFleet.start(1, config) as fleet:
        yield fleet


async def _generate(
    client: aiohttp.ClientSession, url: str, text: str, **extra: Any
) -> tuple[int, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}, **extra}
    async with client.post(url + "/generate", json=body) as resp:
        return resp.status, await resp.json()


async def _completion(
    client: aiohttp.ClientSession,
    url: str,
    prompt: str,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> tuple[int, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, **extra}
    async with client.post(url + "/v1/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def _get(client: aiohttp.ClientSession, url: str) -> Any:
    async with client.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


# ---------------------------------------------------------------------- dispatch
async def test_pinned_requests_hit_only_their_rank_cache(
    dp_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = dp_fleet.urls[0]
    status, first = await _generate(client, url, _text(1), routed_dp_rank=1)
    assert status == 200 and first["meta_info"]["dp_rank"] == 1
    assert first["meta_info"]["cached_tokens"] == 0
    # the same prompt on rank 0: rank 1's cache is not rank 0's
    _, other = await _generate(client, url, _text(1), routed_dp_rank=0)
    assert other["meta_info"]["dp_rank"] == 0 and other["meta_info"]["cached_tokens"] == 0
    # back on rank 1 (through the deprecated alias): a hit
    _, again = await _generate(client, url, _text(1), data_parallel_rank=1)
    assert again["meta_info"]["dp_rank"] == 1 and again["meta_info"]["cached_tokens"] > 50
    # OpenAI route, the header wins over the body
    status, chat = await _completion(
        client, url, _text(2), routed_dp_rank=0, headers={"X-Data-Parallel-Rank": "1"}
    )
    assert status == 200
    status, chat = await _completion(client, url, _text(2), routed_dp_rank=1)
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] > 50
    stats = await _get(client, url + "/_sim/stats")
    per_rank = {r["dp_rank"]: r for r in stats["dp_ranks"]}
    assert per_rank[1]["finished_total"] == 4 and per_rank[0]["finished_total"] == 1
    assert per_rank[0]["cached_tokens_total"] == 0 and per_rank[1]["cached_tokens_total"] > 100
    assert stats["finished_total"] == 5  # the server's figures sum the ranks
    assert stats["kv_capacity_tokens"] == 40_000 and per_rank[0]["kv_capacity_tokens"] == 20_000


async def test_requests_without_a_rank_take_turns(
    dp_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = dp_fleet.urls[0]
    ranks = []
    for doc in range(4):
        _, body = await _generate(client, url, _text(10 + doc))
        ranks.append(body["meta_info"]["dp_rank"])
    assert sorted(ranks) == [0, 0, 1, 1] and ranks[0] != ranks[1] and ranks[2] != ranks[3]
    # a batch's prompts take a turn each
    body = {"text": [_text(20), _text(21)], "sampling_params": {"max_new_tokens": 2}}
    async with client.post(url + "/generate", json=body) as resp:
        outs = await resp.json()
    assert sorted(out["meta_info"]["dp_rank"] for out in outs) == [0, 1]


async def test_a_rank_out_of_range_is_sglangs_error(
    dp_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = dp_fleet.urls[0]
    status, body = await _generate(client, url, "hello", routed_dp_rank=2)
    assert (status, body) == (400, {"error": {"message": RANGE_ERROR.format(2)}})
    status, body = await _completion(client, url, "hello", data_parallel_rank=-1)
    assert status == 400 and body["message"] == RANGE_ERROR.format(-1)
    assert body["type"] == "BadRequestError"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "routed_dp_rank": 7}
    async with client.post(url + "/v1/chat/completions", json=chat) as resp:
        assert resp.status == 400
        assert (await resp.json())["message"] == RANGE_ERROR.format(7)
    stream = {"text": "hello", "stream": True, "routed_dp_rank": 3}
    async with client.post(url + "/generate", json=stream) as resp:
        text = await resp.text()
    assert resp.status == 200 and RANGE_ERROR.format(3) in text and text.endswith("[DONE]\n\n")
    # not an integer: pydantic's 400, or /generate's JSON contract
    status, body = await _generate(client, url, "hello", routed_dp_rank="x")
    assert status == 400 and "Input should be a valid integer" in body["message"]
    status, body = await _generate(client, url, "hello", routed_dp_rank="1")
    assert (status, body) == (400, {"error": 'invalid type: string "1", expected i64'})
    status, body = await _completion(client, url, "hi", headers={"X-Data-Parallel-Rank": "one"})
    assert status == 400 and body["message"].startswith("Invalid X-Data-Parallel-Rank header")
    stats = await _get(client, url + "/_sim/stats")
    assert stats["finished_total"] == 0


async def test_single_rank_ignores_rank_zero_and_refuses_others(
    client: aiohttp.ClientSession,
) -> None:
    async with await SimulatedFleet.start(1, SimConfig(speed=50.0)) as fleet:
        url = fleet.urls[0]
        status, body = await _generate(client, url, "hello", routed_dp_rank=0)
        assert status == 200 and body["meta_info"]["dp_rank"] is None
        status, body = await _generate(client, url, "hello", routed_dp_rank=1)
        assert (status, body) == (
            400,
            {"error": {"message": "routed_dp_rank=1 out of range [0, 1)"}},
        )
        info = await _get(client, url + "/server_info")
        assert info["dp_size"] == 1 and len(info["internal_states"]) == 1
        assert "dp_ranks" not in await _get(client, url + "/_sim/stats")


# ---------------------------------------------------------------------- reporting
async def test_server_info_loads_and_metrics_per_rank(
    dp_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = dp_fleet.urls[0]
    await _generate(client, url, _text(30, 200), routed_dp_rank=1)
    info = await _get(client, url + "/server_info")
    assert info["dp_size"] == 2 and info["max_total_num_tokens"] == 20_000
    states = info["internal_states"]
    assert len(states) == 2 and all(s["memory_usage"]["token_capacity"] == 20_000 for s in states)
    assert info["kv_events"]["dp_size"] == 2

    loads = (await _get(client, url + "/v1/loads"))["loads"]
    assert [entry["dp_rank"] for entry in loads] == [0, 1]
    assert loads[0]["total_prefill_uncached_tokens"] == 0  # rank 0 saw only health checks
    assert loads[1]["total_prefill_uncached_tokens"] >= 199
    only = (await _get(client, url + "/v1/loads?dp_rank=1&include=core"))["loads"]
    assert [entry["dp_rank"] for entry in only] == [1] and "memory" not in only[0]
    assert (await _get(client, url + "/v1/loads?dp_rank=2"))["loads"] == []
    async with client.get(url + "/v1/loads?format=prometheus") as resp:
        text = await resp.text()
    assert 'sglang_max_total_num_tokens{dp_rank="0"} 20000' in text
    assert 'sglang_max_total_num_tokens{dp_rank="1"} 20000' in text

    async with client.get(url + "/metrics") as resp:
        exposition = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(exposition)}
    samples = families["sglang:max_total_num_tokens"].samples
    assert sorted(s.labels["dp_rank"] for s in samples) == ["0", "1"]
    retracted = families["sglang:num_retracted_reqs"].samples
    assert sorted(s.labels["dp_rank"] for s in retracted) == ["0", "1"]
    # tokenizer metrics are the server's: one series, no dp_rank
    prompt = families["sglang:prompt_tokens"].samples
    assert prompt and all("dp_rank" not in s.labels for s in prompt)


async def test_flush_abort_and_lora_reach_every_rank(client: aiohttp.ClientSession) -> None:
    config = SimConfig(speed=50.0, dp_size=2, enable_lora=True, lora_load_s=0.0)
    async with await SimulatedFleet.start(1, config) as fleet:
        url = fleet.urls[0]
        for rank in (0, 1):
            await _generate(client, url, _text(40 + rank), routed_dp_rank=rank)
        stats = await _get(client, url + "/_sim/stats")
        assert all(r["kv_evictable_tokens"] > 0 for r in stats["dp_ranks"])
        async with client.post(url + "/flush_cache") as resp:
            assert resp.status == 200
        stats = await _get(client, url + "/_sim/stats")
        assert all(r["kv_evictable_tokens"] == 0 for r in stats["dp_ranks"])

        # a request running on rank 1 is found by abort_all
        long = {"sampling_params": {"max_new_tokens": 100_000}, "routed_dp_rank": 1}
        task = asyncio.ensure_future(_generate(client, url, "hello", **long))

        async def running() -> bool:
            return bool((await _get(client, url + "/_sim/stats"))["dp_ranks"][1]["running"])

        await _eventually(running)
        async with client.post(url + "/abort_request", json={"abort_all": True}) as resp:
            assert resp.status == 200
        status, body = await task
        assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"

        load = {"lora_name": "a", "lora_path": "/adapters/a"}
        async with client.post(url + "/load_lora_adapter", json=load) as resp:
            assert resp.status == 200
        for rank in (0, 1):
            status, body = await _generate(client, url, "hi", lora_path="a", routed_dp_rank=rank)
            assert status == 200 and body["meta_info"]["dp_rank"] == rank


# ---------------------------------------------------------------------- KV events
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


async def _replay_settled(
    ctx: zmq.asyncio.Context, port: int, cache: RadixCache
) -> list[list[Any]]:
    """A rank's replayed batches once their stored tokens are all its cache holds (the
    last batch may go out after the answer; a safety net of 10 s, not a timing check)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        batches = await _replay(ctx, port)
        if _stored_tokens(batches) == cache.tree_tokens:
            return batches
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"replay on {port} never matched the rank's cache")
        await asyncio.sleep(0.02)


def _stored_tokens(batches: list[list[Any]]) -> int:
    return sum(
        len(event["token_ids"])
        for batch in batches
        for event in batch[1]
        if event["type"] == "BlockStored"
    )


async def test_kv_events_per_rank_on_consecutive_ports(
    dp_fleet: SimulatedFleet, client: aiohttp.ClientSession
) -> None:
    url = dp_fleet.urls[0]
    desc = (await _get(client, url + "/server_info"))["kv_events"]
    base, replay_base = desc["endpoint_port_base"], desc["replay_endpoint_port_base"]
    ctx = zmq.asyncio.Context()
    try:
        subs = []
        for rank in (0, 1):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            sub.connect(f"tcp://127.0.0.1:{base + rank}")
            subs.append(sub)
        for rank in (0, 1):  # slow joiner: publish until the subscription is live
            for doc in range(100):
                await _generate(client, url, _text(100 * rank + doc), routed_dp_rank=rank)
                if await subs[rank].poll(50):
                    break
            _, _, payload = await subs[rank].recv_multipart()
            assert msgpack.unpackb(payload)[2] == rank
        for rank in (0, 1):  # each rank's events are its own cache's, on its own port
            worker = dp_fleet.workers[0]
            assert isinstance(worker, SimulatedWorker)
            cache = worker.dp.ranks[rank].engine.cache
            batches = await _replay_settled(ctx, replay_base + rank, cache)
            assert all(batch[2] == rank for batch in batches)
    finally:
        ctx.destroy(linger=0)


async def test_fleet_ports_leave_room_for_every_rank() -> None:
    base = free_port_range(4)
    config = SimConfig(
        speed=50.0,
        dp_size=2,
        kv_events_config=f'{{"publisher":"zmq","endpoint":"tcp://127.0.0.1:{base}","bind":true}}',
    )
    async with await SimulatedFleet.start(2, config) as fleet:
        ports = []
        for worker in fleet.workers:
            assert isinstance(worker, SimulatedWorker)
            ports += [rank.kv_events.port for rank in worker.dp.ranks if rank.kv_events]
        assert ports == [base, base + 1, base + 2, base + 3]
