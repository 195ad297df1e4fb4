"""Two gateways in-process, one simulated fleet, shared state on a real Redis.

Happy paths use the Redis on 127.0.0.1:6379 with a random key prefix per test (deleted
afterwards); failure tests start a private ``redis-server`` and kill it by PID.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import ClientSession

from gateway.peers.adapters import SHARED_STATE
from gateway.routing.lease import Lease
from loadtests.harness.inprocess import GatewayHandle, run_gateway
from loadtests.harness.redis import PrivateRedis, delete_prefix, redis_answers
from simulator.fleet import SimulatedFleet

pytestmark = pytest.mark.redis

REDIS_URL = "redis://127.0.0.1:6379/0"
SYSTEM = "You are a meticulous assistant who answers in haiku. " * 30


def _chat(question: str, system: str = SYSTEM) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }


def _shared(url: str, prefix: str) -> dict[str, Any]:
    return {
        "policy__name": "cache_aware",
        "redis__url": url,
        "redis__prefix": prefix,
        "redis__tick_s": 0.05,
        "redis__load_ttl_s": 0.5,
    }


async def _eventually(check: Callable[[], bool], within_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def _worker_for(client: ClientSession, gw: GatewayHandle, body: dict[str, Any]) -> str:
    async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-gateway-worker"]


async def _metric(client: ClientSession, gw: GatewayHandle, name: str) -> float:
    async with client.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def _synced(*gws: GatewayHandle) -> None:
    for gw in gws:
        await asyncio.wait_for(gw.app[SHARED_STATE].synced.wait(), 3.0)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    if not await redis_answers(REDIS_URL):
        pytest.skip("no Redis on 127.0.0.1:6379")
    name = f"itest-{uuid.uuid4().hex[:10]}"
    yield name
    await delete_prefix(REDIS_URL, name)


async def test_prefix_routed_by_a_is_routed_to_the_same_worker_by_b(
    fleet: SimulatedFleet, client: ClientSession, prefix: str
) -> None:
    async with (
        run_gateway(fleet.urls, **_shared(REDIS_URL, prefix)) as a,
        run_gateway(fleet.urls, **_shared(REDIS_URL, prefix)) as b,
    ):
        await _synced(a, b)
        for round_ in range(3):
            system = f"Tenant {round_}. " + SYSTEM
            first = await _worker_for(client, a, _chat("q0", system))
            await asyncio.sleep(1.0)  # "within a second"
            for i in range(1, 5):
                gw = (a, b)[i % 2]
                assert await _worker_for(client, gw, _chat(f"q{i}", system)) == first
        assert a.app[SHARED_STATE].applied_records > 0
        assert b.app[SHARED_STATE].applied_records > 0


async def test_load_from_a_is_visible_to_b_policy(fleet: SimulatedFleet, prefix: str) -> None:
    async with (
        run_gateway(fleet.urls, **_shared(REDIS_URL, prefix)) as a,
        run_gateway(fleet.urls, **_shared(REDIS_URL, prefix)) as b,
    ):
        await _synced(a, b)
        wa = next(iter(a.registry))
        wb = b.registry.get(wa.id)
        assert wb is not None
        leases = [Lease(wa, 500) for _ in range(3)]
        await _eventually(lambda: wb.view(0.0).in_flight == 3)
        assert wb.view(0.0).queued_prefill_tokens == 1500
        assert wb.in_flight == 0  # B's own count is untouched
        for lease in leases:
            lease.release()
        await _eventually(lambda: wb.view(0.0).in_flight == 0)


async def test_worker_set_changes_reach_every_gateway(
    fleet: SimulatedFleet, client: ClientSession, prefix: str
) -> None:
    first_two, third = fleet.urls[:2], fleet.urls[2]
    async with (
        run_gateway(first_two, **_shared(REDIS_URL, prefix)) as a,
        run_gateway(first_two, **_shared(REDIS_URL, prefix)) as b,
    ):
        await _synced(a, b)
        async with client.post(a.url + "/workers", json={"url": third}) as resp:
            assert resp.status == 201
            wid = (await resp.json())["id"]
        await _eventually(lambda: b.registry.get(wid) is not None, 1.0)
        async with client.post(f"{b.url}/workers/{wid}/drain") as resp:
            assert resp.status == 202
        await _eventually(lambda: (w := a.registry.get(wid)) is not None and w.draining, 1.0)
        gone = b.registry.find(first_two[0])
        assert gone is not None
        async with client.delete(f"{b.url}/workers/{gone.id}") as resp:
            assert resp.status == 200
        await _eventually(lambda: a.registry.get(gone.id) is None, 1.0)
    # a restarted gateway loads the shared set, whatever its own --worker-urls say
    async with run_gateway(fleet.urls[:1], **_shared(REDIS_URL, prefix)) as c:
        await _synced(c)
        assert {w.url for w in c.registry} == {first_two[1], third}
        drained = c.registry.get(wid)
        assert drained is not None and drained.draining


async def test_restarted_gateway_catches_up(
    fleet: SimulatedFleet, client: ClientSession, prefix: str
) -> None:
    systems = [f"Project {i}. " + SYSTEM for i in range(4)]
    async with run_gateway(fleet.urls, **_shared(REDIS_URL, prefix)) as a:
        await _synced(a)
        placed = [await _worker_for(client, a, _chat("hello", s)) for s in systems]
        await _eventually(lambda: a.app[SHARED_STATE].published_records >= len(systems))
    async with run_gateway(fleet.urls, **_shared(REDIS_URL, prefix)) as b:
        await _synced(b)
        again = [await _worker_for(client, b, _chat("again", s)) for s in systems]
    assert again == placed


async def test_redis_killed_under_load_fails_no_request(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    if not PrivateRedis.available():
        pytest.skip("redis-server not installed")
    async with PrivateRedis() as server:
        settings = {**_shared(server.url, "kill"), "redis__timeout_s": 0.2}
        settings["redis__backoff_max_s"] = 0.3
        async with (
            run_gateway(fleet.urls, **settings) as a,
            run_gateway(fleet.urls, **settings) as b,
        ):
            await _synced(a, b)
            statuses: list[int] = []

            async def load(n: int) -> None:
                for i in range(n):
                    gw = (a, b)[i % 2]
                    body = _chat(f"question {i}", f"Load tenant {i % 5}. " + SYSTEM)
                    async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
                        await resp.read()
                        statuses.append(resp.status)

            task = asyncio.get_running_loop().create_task(load(80))
            await asyncio.sleep(0.3)
            server.kill()
            await _eventually(lambda: a.app[SHARED_STATE].degraded, 3.0)
            assert await _metric(client, a, "gateway_shared_state_degraded") == 1.0
            await asyncio.sleep(0.5)
            await server.start()
            await task
            assert statuses and set(statuses) == {200}
            await _eventually(lambda: not a.app[SHARED_STATE].degraded, 5.0)
            await _eventually(lambda: not b.app[SHARED_STATE].degraded, 5.0)
            assert await _metric(client, a, "gateway_shared_state_degraded") == 0.0
            # Redis came back empty: the worker set was re-seeded, sharing works again
            system = "After the restart. " + SYSTEM
            first = await _worker_for(client, a, _chat("x", system))
            await asyncio.sleep(0.5)
            assert await _worker_for(client, b, _chat("y", system)) == first
            assert len(b.registry) == len(fleet.urls)
