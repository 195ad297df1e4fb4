"""Client disconnects in every phase: queued in admission, before the first byte, and
mid-stream. Afterwards the worker has seen the request go (abort or closed connection)
and every gateway counter is exactly back to zero: no leaked lease, slot or waiter."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import ClientSession

from gateway.http import app_keys
from loadtests.harness.inprocess import GatewayHandle, run_gateway, sim_faults, sim_stats
from simulator.fleet import SimulatedFleet

Eventually = Callable[..., Awaitable[None]]  # the ``eventually`` fixture (tests/conftest.py)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8}
ENDLESS = {**CHAT, "max_tokens": 20000, "ignore_eos": True}


def _all_zero(gw: GatewayHandle) -> bool:
    admission = gw.app[app_keys.ADMISSION]
    return (
        all(
            w.in_flight == 0 and w.queued_prefill_tokens == 0 and w.decoding_requests == 0
            for w in gw.registry
        )
        and admission.active == 0
        and admission.waiting == 0
    )


async def _give_up_after(client: ClientSession, url: str, payload: object, s: float) -> None:
    """Send a request and hang up after ``s`` seconds, whatever phase it is in."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
        async with client.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=s)) as r:
            await r.read()
        raise AssertionError("the request should have outlived the client's patience")


async def _worker_idle(client: ClientSession, url: str) -> bool:
    return int((await sim_stats(client, url))["in_flight"]) == 0


async def test_disconnect_while_queued_in_admission(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    async with run_gateway(
        fleet.urls[:1], admission__max_concurrent_requests=1, admission__queue_timeout_s=30.0
    ) as gw:
        admission = gw.app[app_keys.ADMISSION]
        url = gw.url + "/v1/chat/completions"
        holder = await client.post(url, json={**ENDLESS, "stream": True})
        assert holder.status == 200
        await holder.content.readany()
        queued = asyncio.create_task(_give_up_after(client, url, CHAT, 0.5))
        await eventually(lambda: admission.waiting == 1, 5, "the second request queued")
        await queued
        await eventually(lambda: admission.waiting == 0, 5, "the waiter left the queue")
        assert (await sim_stats(client, fleet.urls[0]))["requests"] == 1  # never forwarded
        holder.close()
        await eventually(lambda: _all_zero(gw), 5, "counters back to zero")
        async with client.post(url, json=CHAT) as resp:  # the slot is free again
            assert resp.status == 200
        assert _all_zero(gw)


async def test_disconnect_before_first_byte_streaming(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    async with run_gateway(fleet.urls[:1]) as gw:
        await sim_faults(client, fleet.urls[0], latency_s=2.0)
        await _give_up_after(
            client, gw.url + "/v1/chat/completions", {**ENDLESS, "stream": True}, 0.4
        )
        await eventually(lambda: _all_zero(gw), 5, "gateway counters back to zero")
        await eventually(lambda: _worker_idle(client, fleet.urls[0]), 10, "worker idle")


async def test_disconnect_before_first_byte_non_streaming(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    """A non-streaming answer's first byte comes at its end: hanging up mid-generation
    must abort it on the worker."""
    async with run_gateway(fleet.urls[:1]) as gw:
        await _give_up_after(client, gw.url + "/v1/chat/completions", ENDLESS, 0.4)
        await eventually(lambda: _all_zero(gw), 5, "gateway counters back to zero")

        async def aborted() -> bool:
            stats = await sim_stats(client, fleet.urls[0])
            return bool(stats["aborts"] >= 1 and stats["in_flight"] == 0)

        await eventually(aborted, 10, "the worker saw the abort")


async def test_disconnect_mid_stream_many_clients(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    async with run_gateway(fleet.urls) as gw:
        url = gw.url + "/v1/chat/completions"
        responses = [await client.post(url, json={**ENDLESS, "stream": True}) for _ in range(9)]
        for resp in responses:
            assert resp.status == 200
            await resp.content.readany()
        assert sum(w.in_flight for w in gw.registry) == 9
        for resp in responses:
            resp.close()
        await eventually(lambda: _all_zero(gw), 5, "gateway counters back to zero")

        async def all_aborted() -> bool:
            stats = [await sim_stats(client, u) for u in fleet.urls]
            return sum(s["aborts"] for s in stats) >= 9 and all(s["in_flight"] == 0 for s in stats)

        await eventually(all_aborted, 10, "every worker saw its aborts")
