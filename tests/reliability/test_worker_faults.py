"""Worker faults the gateway must survive: killed mid-stream, hanging, bursts of 5xx and
429, a slow worker, flapping health, every worker down and back.

Margins are wide (seconds where the gateway needs milliseconds): the machine is shared.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import ClientSession

from loadtests.harness.inprocess import run_gateway, sim_faults, sim_stats
from simulator.fleet import SimulatedFleet

Eventually = Callable[..., Awaitable[None]]  # the ``eventually`` fixture (tests/conftest.py)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8}
ENDLESS = {**CHAT, "max_tokens": 20000, "ignore_eos": True, "stream": True}


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


async def test_worker_killed_mid_stream(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    """Error event then [DONE], no event duplicated or cut, the gateway stops sending
    within 1 s of the kill, and the next requests go elsewhere."""
    async with run_gateway(fleet.urls) as gw:
        async with client.post(gw.url + "/v1/chat/completions", json=ENDLESS) as resp:
            assert resp.status == 200
            before = await resp.content.readany()
            victim_url = resp.headers["x-gateway-worker"]
            await fleet.stop_worker(fleet.urls.index(victim_url))
            killed_at = time.monotonic()
            rest = await asyncio.wait_for(resp.read(), 10)
            ended_s = time.monotonic() - killed_at
        assert ended_s < 1.0, f"the gateway kept the stream open {ended_s:.2f} s after the kill"
        events = _events(before + rest)
        assert events[-1] == b"data: [DONE]"
        error = orjson.loads(events[-2][len(b"data: ") :])
        assert error["error"]["code"] == 502
        assert (before + rest).count(b"[DONE]") == 1
        bodies = [orjson.loads(e[len(b"data: ") :]) for e in events[:-2]]
        ids = [(b["id"], b["choices"][0].get("delta", {}).get("content")) for b in bodies]
        assert len(bodies) >= 1 and all(b["id"] == bodies[0]["id"] for b in bodies)
        assert len(ids) == len(bodies)  # every event whole, parsed once
        await eventually(lambda: all(w.in_flight == 0 for w in gw.registry), 5, "in-flight 0")
        for _ in range(6):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert resp.headers["x-gateway-worker"] != victim_url


async def test_hanging_worker_non_streaming_is_504_and_penalised(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    async with run_gateway(fleet.urls[:1], server__request_timeout_s=1.0) as gw:
        await sim_faults(client, fleet.urls[0], hang=True)
        started = time.monotonic()
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == 504
        assert time.monotonic() - started < 4.0
        worker = gw.registry.find(fleet.urls[0])
        assert worker is not None
        assert worker.consecutive_5xx >= 1 or worker.flags, "a timeout must count against it"
        await eventually(
            lambda: all(w.in_flight == 0 for w in gw.registry), 5, "gateway in-flight 0"
        )

        async def worker_idle() -> bool:
            return int((await sim_stats(client, fleet.urls[0]))["in_flight"]) == 0

        await eventually(worker_idle, 5, "the worker saw the request go")


async def test_hanging_worker_streaming_is_bounded(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    """A stream that hangs before its first event gets a 504 (nothing was sent yet)."""
    async with run_gateway(fleet.urls[:1], server__request_timeout_s=1.0) as gw:
        await sim_faults(client, fleet.urls[0], hang=True)
        started = time.monotonic()
        async with client.post(
            gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as resp:
            body = await resp.read()
        assert time.monotonic() - started < 4.0
        if resp.status == 200:  # a streaming error event is acceptable too
            assert b'"code":504' in body and body.endswith(b"data: [DONE]\n\n")
        else:
            assert resp.status == 504


async def test_hanging_worker_retried_elsewhere_by_connectable_ones(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    """With healthy workers left, a hang costs one client at most one timeout."""
    async with run_gateway(fleet.urls, server__first_byte_timeout_s=0.5) as gw:
        await sim_faults(client, fleet.urls[0], hang=True)
        statuses = []
        for _ in range(6):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                statuses.append(resp.status)
        assert statuses == [200] * 6, statuses


async def _burst(
    fleet: SimulatedFleet, client: ClientSession, status: int, rounds: int = 12
) -> None:
    async with run_gateway(fleet.urls) as gw:
        await sim_faults(client, fleet.urls[0], error_rate=1.0, error_status=status)
        await sim_faults(client, fleet.urls[1], error_rate=0.5, error_status=status)
        for i in range(rounds):
            payload = {**CHAT, "stream": bool(i % 2)}
            async with client.post(gw.url + "/v1/chat/completions", json=payload) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.read()
                assert b'"error"' not in body
        assert all(w.in_flight == 0 for w in gw.registry)


async def test_burst_of_5xx_is_retried_elsewhere(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    await _burst(fleet, client, 500)


async def test_burst_of_429_is_retried_elsewhere(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    await _burst(fleet, client, 429)


async def test_burst_of_503_under_concurrency(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls) as gw:
        await sim_faults(client, fleet.urls[2], error_rate=1.0, error_status=503)

        async def one() -> int:
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one() for _ in range(24)))
        assert set(statuses) == {200}


async def test_slow_worker_does_not_fail_requests(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls, policy__name="least_load") as gw:
        await sim_faults(client, fleet.urls[0], latency_s=0.5)

        async def one(i: int) -> tuple[int, str]:
            payload = {**CHAT, "stream": bool(i % 2)}
            async with client.post(gw.url + "/v1/chat/completions", json=payload) as resp:
                await resp.read()
                return resp.status, resp.headers["x-gateway-worker"]

        results = await asyncio.gather(*(one(i) for i in range(12)))
        assert {s for s, _ in results} == {200}
        assert all(w.in_flight == 0 for w in gw.registry)


async def test_flapping_health_never_fails_a_client(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(
        fleet.urls,
        health__interval_s=0.05,
        health__failure_threshold=1,
        health__success_threshold=1,
    ) as gw:
        flapping = fleet.urls[1]
        for i in range(16):
            await sim_faults(client, flapping, fail_health=bool(i % 2))
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
            await asyncio.sleep(0.03)
        await sim_faults(client, flapping, fail_health=False)
        assert all(w.in_flight == 0 for w in gw.registry)


async def test_every_worker_down_fast_503_then_recovery(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    async with run_gateway(
        fleet.urls, health__interval_s=0.1, health__failure_threshold=1, health__success_threshold=1
    ) as gw:
        for i in range(len(fleet.urls)):
            await fleet.stop_worker(i)
        await eventually(lambda: gw.registry.healthy_count() == 0, 5, "all flagged")
        for _ in range(3):
            started = time.monotonic()
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                body = await resp.json()
            assert time.monotonic() - started < 0.5
            assert resp.status == 503, body
            assert body["error"]["code"] == 503
            assert int(resp.headers["Retry-After"]) >= 1
        async with client.get(gw.url + "/readiness") as resp:
            assert resp.status == 503 and "Retry-After" in resp.headers
        for i in range(len(fleet.urls)):
            await fleet.restart_worker(i)
        await eventually(lambda: gw.registry.healthy_count() >= 1, 10, "a worker back")

        async def served() -> bool:
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                await resp.read()
                return resp.status == 200

        await eventually(served, 10, "requests served again")
