"""Failures: killed workers, mid-stream drops, 5xx retries, timeouts, client disconnects,
health flips and drain."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import ClientSession

from gateway.workers.registry import HealthFlag
from loadtests.harness.inprocess import run_gateway, sim_faults, sim_stats
from loadtests.harness.ports import free_port

pytest.importorskip("simulator.fleet")  # lands with the simulated worker
from simulator.fleet import SimulatedFleet

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8}
LONG = {**CHAT, "max_tokens": 400, "ignore_eos": True}


async def _eventually(check: object, within_s: float = 5.0) -> None:
    assert callable(check)
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def test_worker_killed_between_requests(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls) as gw:
        for _ in range(3):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
        dead = fleet.urls[1]
        await fleet.stop_worker(1)
        served = []
        for _ in range(9):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200, await resp.text()
                served.append(resp.headers["x-gateway-worker"])
        assert dead not in served
        dead_worker = gw.registry.find(dead)
        assert dead_worker is not None and not dead_worker.healthy


async def test_retry_on_5xx_goes_elsewhere(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls) as gw:
        await sim_faults(client, fleet.urls[0], error_rate=1.0, error_status=503)
        for _ in range(6):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert resp.headers["x-gateway-worker"] != fleet.urls[0]
        assert (await sim_stats(client, fleet.urls[0]))["requests"] >= 1


async def test_every_worker_failing_relays_the_error(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls, retry__max_retries=5) as gw:
        for url in fleet.urls:
            await sim_faults(client, url, error_rate=1.0, error_status=500)
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 500
        total = sum([(await sim_stats(client, u))["requests"] for u in fleet.urls])
        assert total == 3  # each worker tried once, never the same one twice


async def test_worker_drops_mid_stream(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls) as gw:
        for url in fleet.urls:
            await sim_faults(client, url, drop_mid_stream_after=3)
        async with client.post(
            gw.url + "/v1/chat/completions", json={**LONG, "stream": True}
        ) as resp:
            assert resp.status == 200
            raw = await resp.read()
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        error = orjson.loads(events[-2][len(b"data: ") :])
        assert error["error"]["code"] == 502
        assert raw.count(b"[DONE]") == 1 and raw.count(b'{"error":') == 1
        for event in events[:-2]:
            assert event.startswith(b"data: {")
            orjson.loads(event[len(b"data: ") :])  # whole events only
        assert all(w.in_flight == 0 for w in gw.registry)


async def test_worker_killed_mid_stream(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls) as gw:
        async with client.post(
            gw.url + "/v1/chat/completions", json={**LONG, "max_tokens": 20000, "stream": True}
        ) as resp:
            assert resp.status == 200
            first = await resp.content.readany()
            assert first.startswith(b"data: ")
            victim = fleet.urls.index(resp.headers["x-gateway-worker"])
            await fleet.stop_worker(victim)
            rest = await resp.read()
        assert rest.endswith(b"data: [DONE]\n\n")
        assert b'"error"' in rest
        await _eventually(lambda: all(w.in_flight == 0 for w in gw.registry))


async def test_client_disconnect_aborts_on_worker(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls[:1]) as gw:
        url = fleet.urls[0]
        async with client.post(
            gw.url + "/v1/chat/completions", json={**LONG, "max_tokens": 20000, "stream": True}
        ) as resp:
            assert resp.status == 200
            await resp.content.readany()
            worker = gw.registry.find(url)
            assert worker is not None and worker.in_flight == 1
            resp.close()  # the client goes away mid-stream
        await _eventually(lambda: worker.in_flight == 0)

        async def aborted() -> bool:
            stats = await sim_stats(client, url)
            return bool(stats["aborts"] >= 1 and stats["in_flight"] == 0)

        for _ in range(100):
            if await aborted():
                break
            await asyncio.sleep(0.05)
        assert await aborted()


async def test_client_disconnect_non_streaming(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls[:1]) as gw:
        url = fleet.urls[0]
        worker = gw.registry.find(url)
        assert worker is not None
        with_timeout = aiohttp.ClientTimeout(total=0.3)
        try:
            async with client.post(
                gw.url + "/v1/chat/completions",
                json={**LONG, "max_tokens": 20000},  # seconds of decoding
                timeout=with_timeout,
            ) as resp:
                await resp.read()
        except TimeoutError:
            pass
        else:
            raise AssertionError("the request should have outlived the client's timeout")
        await _eventually(lambda: worker.in_flight == 0)
        for _ in range(100):
            stats = await sim_stats(client, url)
            if stats["aborts"] >= 1 and stats["in_flight"] == 0:
                break
            await asyncio.sleep(0.05)
        assert stats["aborts"] >= 1 and stats["in_flight"] == 0


async def test_worker_timeout_is_504(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls[:1], server__request_timeout_s=0.5) as gw:
        await sim_faults(client, fleet.urls[0], hang=True)
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == 504


async def test_unreachable_worker_is_502(client: ClientSession) -> None:
    port = free_port()  # nothing listens on it (bound then closed)
    async with (
        run_gateway([f"http://127.0.0.1:{port}"], ready_within_s=0) as gw,
        client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp,
    ):
        assert resp.status == 502
        body = await resp.json()
        assert body["error"]["code"] == 502 and body["error"]["message"]


async def test_health_flips_after_thresholds(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(
        fleet.urls, health__interval_s=0.1, health__failure_threshold=3, health__success_threshold=2
    ) as gw:
        worker = gw.registry.find(fleet.urls[2])
        assert worker is not None and worker.healthy
        await sim_faults(client, fleet.urls[2], fail_health=True)
        await _eventually(lambda: HealthFlag.CHECK_FAILED in worker.flags)
        assert worker.health_failures >= 3
        async with client.get(gw.url + "/workers/" + worker.id) as resp:
            assert (await resp.json())["healthy"] is False
        for _ in range(4):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.headers["x-gateway-worker"] != fleet.urls[2]
        await sim_faults(client, fleet.urls[2], fail_health=False)
        await _eventually(lambda: worker.healthy)
        assert worker.health_successes >= 2


async def test_drain_lets_in_flight_finish(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls[:2]) as gw:
        async with client.post(
            gw.url + "/v1/chat/completions", json={**LONG, "max_tokens": 100, "stream": True}
        ) as resp:
            target = resp.headers["x-gateway-worker"]
            worker = gw.registry.find(target)
            assert worker is not None
            async with client.post(f"{gw.url}/workers/{worker.id}/drain") as drain:
                assert drain.status == 202
                assert "draining" in (await drain.json())["flags"]
            for _ in range(4):
                async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as other:
                    assert other.status == 200
                    assert other.headers["x-gateway-worker"] != target
            raw = await resp.read()
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
        assert worker.in_flight == 0
