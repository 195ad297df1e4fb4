"""A simulated prefill/decode pair on loopback (issue 18, docs/PD.md).

The tests play sglang-router's part: the same body, with ``bootstrap_host`` (the
prefill's host), ``bootstrap_port`` (its bootstrap port, read from ``/server_info``) and
a random 63-bit ``bootstrap_room``, sent to both servers at once; the decode's answer is
the client's. Behaviour only: no timing assertions (the servers run at speed 50).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.config import SimConfig
from simulator.http.sglang import SimulatedWorker

SPEED = 50.0
TEXT = " ".join(f"w{i}" for i in range(300))


@dataclass
class Pair:
    prefill: SimulatedWorker
    decode: SimulatedWorker
    client: aiohttp.ClientSession
    bootstrap_port: int

    def fields(self, room: int | None = None) -> dict[str, Any]:
        return {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": random.getrandbits(63) if room is None else room,
        }

    async def post(self, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.client.post(url + path, json=body) as resp:
            raw = await resp.read()
            if resp.content_type == "text/event-stream":
                return resp.status, raw.decode()
            return resp.status, orjson.loads(raw)

    async def both(
        self, path: str, body: dict[str, Any]
    ) -> tuple[tuple[int, Any], tuple[int, Any]]:
        """Send ``body`` plus fresh bootstrap fields to both, concurrently: (prefill, decode)."""
        body = {**body, **self.fields()}
        prefill, decode = await asyncio.gather(
            self.post(self.prefill.url, path, body), self.post(self.decode.url, path, body)
        )
        return prefill, decode

    async def metric(self, worker: SimulatedWorker, name: str) -> float:
        async with self.client.get(worker.url + "/metrics") as resp:
            text = await resp.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        raise AssertionError(f"{name} not exported")

    async def queue(self, worker: SimulatedWorker, key: str) -> int:
        """One queue length of ``/v1/loads``' disaggregation section."""
        return int((await self.disagg(worker))[key])

    async def disagg(self, worker: SimulatedWorker) -> dict[str, Any]:
        async with self.client.get(worker.url + "/v1/loads?include=disagg") as resp:
            section: dict[str, Any] = (await resp.json())["loads"][0]["disaggregation"]
            return section


PairFactory = Callable[..., Awaitable[Pair]]
Eventually = Callable[..., Awaitable[None]]


@pytest.fixture
async def make_pair() -> AsyncIterator[PairFactory]:
    started: list[SimulatedWorker] = []
    clients: list[aiohttp.ClientSession] = []

    async def make(
        prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
    ) -> Pair:
        p = SimulatedWorker(
            SimConfig(
                speed=SPEED,
                disaggregation_mode="prefill",
                disaggregation_bootstrap_port=0,
                **(prefill or {}),
            )
        )
        d = SimulatedWorker(SimConfig(speed=SPEED, disaggregation_mode="decode", **(decode or {})))
        for worker in (p, d):
            await worker.start()
            started.append(worker)
        client = aiohttp.ClientSession()
        clients.append(client)
        async with client.get(p.url + "/server_info") as resp:
            port = (await resp.json())["disaggregation_bootstrap_port"]
        return Pair(p, d, client, port)

    yield make
    for client in clients:
        await client.close()
    for worker in started:
        await worker.stop()


def _events(stream: str) -> list[Any]:
    return [
        orjson.loads(line[len("data: ") :])
        for line in stream.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


# ---------------------------------------------------------------------- what each role says
async def test_each_role_describes_itself(make_pair: PairFactory) -> None:
    pair = await make_pair()
    async with pair.client.get(pair.prefill.url + "/server_info") as resp:
        prefill = await resp.json()
    async with pair.client.get(pair.decode.url + "/server_info") as resp:
        decode = await resp.json()
    assert prefill["disaggregation_mode"] == "prefill"
    assert prefill["disaggregation_bootstrap_port"] == pair.bootstrap_port > 0
    assert prefill["disaggregation_transfer_backend"] == "mooncake"
    assert prefill["disable_radix_cache"] is False
    assert decode["disaggregation_mode"] == "decode"
    assert decode["disaggregation_bootstrap_port"] == 8998
    assert decode["disable_radix_cache"] is True
    assert prefill["internal_states"][0]["disaggregation_mode"] == "prefill"
    for worker, mode in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        async with pair.client.get(worker.url + "/model_info") as resp:
            assert (await resp.json())["disaggregation_mode"] == mode
        assert (await pair.disagg(worker))["mode"] == mode
        async with pair.client.get(worker.url + "/health") as resp:
            assert resp.status == 200  # each role checks itself alone
        async with pair.client.get(worker.url + "/metrics") as resp:
            assert f'engine_type="{mode}"' in await resp.text()
    bootstrap = f"http://127.0.0.1:{pair.bootstrap_port}"
    async with pair.client.get(bootstrap + "/health") as resp:
        assert (resp.status, await resp.text()) == (200, "OK")
    async with pair.client.get(bootstrap + "/route") as resp:
        assert resp.status == 400


# ---------------------------------------------------------------------- the happy path
async def test_generate_through_a_pair(make_pair: PairFactory) -> None:
    pair = await make_pair()
    body = {"text": TEXT, "sampling_params": {"max_new_tokens": 8}}
    (p_status, prefill), (d_status, decode) = await pair.both("/generate", body)
    assert (p_status, d_status) == (200, 200)
    assert prefill["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(prefill["output_ids"]) == 1 and prefill["meta_info"]["completion_tokens"] == 1
    assert decode["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert decode["meta_info"]["completion_tokens"] == len(decode["output_ids"]) == 8
    assert decode["output_ids"][0] == prefill["output_ids"][0]
    assert decode["meta_info"]["prompt_tokens"] == prefill["meta_info"]["prompt_tokens"]
    assert decode["meta_info"]["cached_tokens"] == prefill["meta_info"]["cached_tokens"] == 0

    # the same prefix again: the prefill's radix cache hits, and the decode reports that hit
    body = {"text": TEXT + " and more words", "sampling_params": {"max_new_tokens": 4}}
    (_, prefill), (_, decode) = await pair.both("/generate", body)
    cached = prefill["meta_info"]["cached_tokens"]
    assert cached > 0
    assert decode["meta_info"]["cached_tokens"] == cached
    (_, prefill), (_, decode) = await pair.both("/generate", body)
    assert prefill["meta_info"]["cached_tokens"] > cached
    assert decode["meta_info"]["cached_tokens"] == prefill["meta_info"]["cached_tokens"]

    loads = await pair.disagg(pair.prefill)
    assert loads["kv_transfer_latency_ms"] > 0 and loads["kv_transfer_speed_gb_s"] > 0
    assert await pair.metric(pair.prefill, "sglang:kv_transfer_latency_ms_count") == 3
    assert await pair.metric(pair.prefill, "sglang:num_prefill_inflight_queue_reqs") == 0
    assert await pair.metric(pair.decode, "sglang:num_decode_transfer_queue_reqs") == 0


async def test_the_decode_streams_a_chat_with_the_prefills_hit(make_pair: PairFactory) -> None:
    pair = await make_pair()
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": TEXT}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    await pair.both("/v1/chat/completions", body)  # warm the prefill's cache
    (p_status, prefill), (d_status, decode) = await pair.both("/v1/chat/completions", body)
    assert (p_status, d_status) == (200, 200)
    p_usage = _events(prefill)[-1]["usage"]
    d_events = _events(decode)
    d_usage = d_events[-1]["usage"]
    assert p_usage["completion_tokens"] == 1
    assert d_usage["completion_tokens"] == 6
    content = [e for e in d_events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(content) > 1  # streamed, not one block
    cached = p_usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and d_usage["prompt_tokens_details"]["cached_tokens"] == cached


async def test_a_batch_carries_one_room_per_item(make_pair: PairFactory) -> None:
    pair = await make_pair()
    body = {
        "input_ids": [[5, 6, 7, 8, 9], [10, 11, 12, 13]],
        "sampling_params": {"max_new_tokens": 3},
        "bootstrap_host": ["127.0.0.1", "127.0.0.1"],
        "bootstrap_port": [pair.bootstrap_port, pair.bootstrap_port],
        "bootstrap_room": [random.getrandbits(63), random.getrandbits(63)],
    }
    (p_status, prefill), (d_status, decode) = await asyncio.gather(
        pair.post(pair.prefill.url, "/generate", body),
        pair.post(pair.decode.url, "/generate", body),
    )
    assert (p_status, d_status) == (200, 200)
    assert [len(item["output_ids"]) for item in prefill] == [1, 1]
    assert [len(item["output_ids"]) for item in decode] == [3, 3]


async def test_a_request_without_a_room_is_refused_by_both_roles(make_pair: PairFactory) -> None:
    pair = await make_pair()
    for worker in (pair.prefill, pair.decode):
        status, body = await pair.post(
            worker.url, "/generate", {"text": "hi", "rid": "r1", "sampling_params": {}}
        )
        assert status == 400
        assert body["error"]["message"] == (
            "Invalid request: Disaggregated request received without bootstrap room id. "
            "req.rid='r1'"
        )
        status, body = await pair.post(
            worker.url,
            "/v1/chat/completions",
            {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert status == 400 and "without bootstrap room id" in body["message"]


async def test_the_fake_paths_need_no_prefill(make_pair: PairFactory) -> None:
    pair = await make_pair(decode={"disaggregation_transfer_backend": "fake"})
    status, body = await pair.post(
        pair.decode.url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
    )
    assert status == 200 and body["meta_info"]["completion_tokens"] == 4
    fake = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
    status, body = await pair.post(
        pair.prefill.url, "/generate", {"text": "hi", "sampling_params": {}, **fake}
    )
    assert status == 200 and body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


# ---------------------------------------------------------------------- failures
async def test_a_transfer_failure_fails_both_sides(make_pair: PairFactory) -> None:
    pair = await make_pair()
    async with pair.client.post(
        pair.prefill.url + "/_sim/faults", json={"transfer_fail_rate": 1.0}
    ) as resp:
        assert (await resp.json())["transfer_fail_rate"] == 1.0
    body = {"text": TEXT, "rid": "t1", "sampling_params": {"max_new_tokens": 4}}
    fields = pair.fields()
    room = fields["bootstrap_room"]
    (p_status, prefill), (d_status, decode) = await asyncio.gather(
        pair.post(pair.prefill.url, "/generate", {**body, **fields}),
        pair.post(pair.decode.url, "/generate", {**body, **fields}),
    )
    assert (p_status, d_status) == (500, 500)
    assert prefill["message"].startswith(
        f"Prefill transfer failed for request rank=0 req.rid='t1' req.bootstrap_room={room} "
        f"with exception KVTransferError(bootstrap_room={room}): Failed to send kv chunk of {room}"
    )
    assert decode["message"].startswith(
        f"Decode transfer failed for request rank=0 decode_req.req.rid='t1' "
        f"decode_req.req.bootstrap_room={room} with exception "
        f"KVTransferError(bootstrap_room={room}): Failed to send kv chunk of {room}"
    )
    for worker in (pair.prefill, pair.decode):
        assert await pair.metric(worker, "sglang:num_transfer_failed_reqs_total") == 1

    # streamed: the decode's 200 stream ends with SGLang's abort
    stream = {**body, "rid": "t2", "stream": True}
    (_, _), (d_status, decode_stream) = await pair.both("/generate", stream)
    assert d_status == 200
    reason = _events(decode_stream)[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500
    assert reason["message"].startswith("Decode transfer failed")


async def test_a_prefill_whose_decode_never_comes_times_out(make_pair: PairFactory) -> None:
    pair = await make_pair(prefill={"bootstrap_timeout_s": 2.0})
    body = {"text": TEXT, "rid": "p1", "sampling_params": {}, **pair.fields(room=77)}
    status, answer = await pair.post(pair.prefill.url, "/generate", body)
    assert status == 500
    assert answer["message"] == (
        "Prefill bootstrap failed for request rank=0 req.rid='p1' req.bootstrap_room=77 with "
        "exception KVTransferError(bootstrap_room=77): Request 77 timed out after 2.0s in "
        "KVPoll.Bootstrapping"
    )
    assert await pair.metric(pair.prefill, "sglang:num_bootstrap_failed_reqs_total") == 1


async def test_a_decode_whose_room_never_arrives_times_out(make_pair: PairFactory) -> None:
    pair = await make_pair(decode={"waiting_timeout_s": 2.0})
    body = {"text": TEXT, "rid": "d1", "sampling_params": {}, **pair.fields(room=88)}
    status, answer = await pair.post(pair.decode.url, "/generate", body)
    assert status == 500
    prefix = (
        "Decode transfer failed for request rank=0 decode_req.req.rid='d1' "
        "decode_req.req.bootstrap_room=88 with exception KVTransferError(bootstrap_room=88): "
        "Request 88 timed out after "
    )
    assert answer["message"].startswith(prefix)
    assert answer["message"].endswith("s in KVPoll.WaitingForInput")
    assert await pair.metric(pair.decode, "sglang:num_transfer_failed_reqs_total") == 1


async def test_queues_show_a_request_waiting_for_its_partner(
    make_pair: PairFactory, eventually: Eventually
) -> None:
    pair = await make_pair()
    body = {"text": TEXT, "sampling_params": {}, **pair.fields()}
    waiting = [
        asyncio.create_task(pair.post(worker.url, "/generate", body))
        for worker in (pair.prefill, pair.decode)
    ]
    # each side alone would wait; both sent, the pair completes (the queues drain)
    statuses = [status for status, _ in await asyncio.gather(*waiting)]
    assert statuses == [200, 200]
    alone = asyncio.create_task(pair.post(pair.prefill.url, "/generate", {**body, **pair.fields()}))

    async def queued() -> bool:
        return await pair.queue(pair.prefill, "prefill_bootstrap_queue_reqs") == 1

    await eventually(queued, 10.0, "a request in the bootstrap queue")
    assert await pair.metric(pair.prefill, "sglang:num_prefill_bootstrap_queue_reqs") == 1
    alone.cancel()


async def test_a_killed_prefill_fails_the_decodes_requests(
    make_pair: PairFactory, eventually: Eventually
) -> None:
    pair = await make_pair()
    body = {"text": TEXT, "rid": "k1", "sampling_params": {}, **pair.fields(room=5)}
    waiting = asyncio.create_task(pair.post(pair.decode.url, "/generate", body))

    async def registered() -> bool:
        return await pair.queue(pair.decode, "decode_transfer_queue_reqs") == 1

    await eventually(registered, 10.0, "a request in the transfer queue")
    await pair.prefill.stop()
    status, answer = await waiting
    assert status == 500
    assert answer["message"] == (
        "Decode transfer failed for request rank=0 decode_req.req.rid='k1' "
        "decode_req.req.bootstrap_room=5 with exception KVTransferError(bootstrap_room=5): "
        f"Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:{pair.bootstrap_port})"
    )

    # the prefill down from the start: the handshake fails after its tries
    body = {**body, "rid": "k2"}
    status, answer = await pair.post(pair.decode.url, "/generate", body)
    assert status == 500
    assert answer["message"].startswith("Decode handshake failed for request rank=0")
    assert answer["message"].endswith("Aborted by AbortReq.")
    assert await pair.metric(pair.decode, "sglang:num_bootstrap_failed_reqs_total") == 1


async def test_a_failing_bootstrap_server_fails_the_handshake(make_pair: PairFactory) -> None:
    pair = await make_pair()
    async with pair.client.post(pair.prefill.url + "/_sim/faults", json={"bootstrap_fail": True}):
        pass
    body = {"text": TEXT, "sampling_params": {}, **pair.fields()}
    status, answer = await pair.post(pair.decode.url, "/generate", body)
    assert status == 500 and answer["message"].startswith("Decode handshake failed")


async def test_an_aborted_prefill_request_fails_its_room(
    make_pair: PairFactory, eventually: Eventually
) -> None:
    pair = await make_pair()
    fields = pair.fields()
    body = {"text": TEXT, "rid": "a1", "sampling_params": {}, **fields}
    waiting = asyncio.create_task(pair.post(pair.prefill.url, "/generate", body))

    async def queued() -> bool:
        return await pair.queue(pair.prefill, "prefill_bootstrap_queue_reqs") == 1

    await eventually(queued, 10.0, "a request in the bootstrap queue")
    async with pair.client.post(pair.prefill.url + "/abort_request", json={"rid": "a1"}):
        pass
    await waiting
    status, answer = await pair.post(pair.decode.url, "/generate", {**body, "rid": "a2"})
    assert status == 500 and answer["message"].endswith("Aborted by AbortReq.")
