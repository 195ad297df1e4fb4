"""Every error the gateway answers itself is OpenAI-style JSON with the right status."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import ClientSession

from gateway.workers.registry import HealthFlag
from loadtests.harness.inprocess import run_gateway, sim_faults, sim_stats

pytest.importorskip("simulator.fleet")  # lands with the simulated worker
from simulator.fleet import SimulatedFleet

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.headers.get("x-request-id")
    body: dict[str, Any] = (await resp.json())["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["code"] == status and body["message"]
    return body


@pytest.mark.parametrize(
    ("path", "data", "param"),
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        ("/v1/chat/completions", b'{"model": "m"}', "messages"),
        ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            "stream",
        ),
        ("/v1/completions", b'{"model": "m"}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
        ("/generate", b'{"sampling_params": {}}', "text"),
    ],
)
async def test_bad_requests_are_400(
    fleet: SimulatedFleet, client: ClientSession, path: str, data: bytes, param: str | None
) -> None:
    async with run_gateway(fleet.urls[:1]) as gw:
        async with client.post(
            gw.url + path, data=data, headers={"content-type": "application/json"}
        ) as resp:
            body = await _error(resp, 400)
        assert body["type"] == "invalid_request_error"
        if param is not None:
            assert body["param"] == param
        assert (await sim_stats(client, fleet.urls[0]))["requests"] == 0


async def test_api_key(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls[:1], server__api_key="s3cret") as gw:
        url = gw.url + "/v1/chat/completions"
        async with client.post(url, json=CHAT) as resp:
            assert (await _error(resp, 401))["type"] == "authentication_error"
        async with client.post(url, json=CHAT, headers={"Authorization": "Bearer nope"}) as resp:
            await _error(resp, 401)
        async with client.post(url, json=CHAT, headers={"Authorization": "Basic s3cret"}) as resp:
            await _error(resp, 401)
        async with client.post(url, json=CHAT, headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 200
        async with client.get(gw.url + "/workers") as resp:
            await _error(resp, 401)
        async with client.get(gw.url + "/health") as resp:
            assert resp.status == 200  # probes need no key


async def test_404_405_413(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls[:1], server__max_payload_size=1000) as gw:
        async with client.get(gw.url + "/v1/nothing") as resp:
            await _error(resp, 404)
        async with client.get(gw.url + "/v1/chat/completions") as resp:
            await _error(resp, 405)
            assert "POST" in resp.headers.get("Allow", "")
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
        async with client.post(gw.url + "/v1/chat/completions", json=big) as resp:
            await _error(resp, 413)


async def test_admission_429_and_503(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(
        fleet.urls[:1],
        admission__max_concurrent_requests=1,
        admission__queue_size=1,
        admission__queue_timeout_s=0.6,
    ) as gw:
        url = gw.url + "/v1/chat/completions"
        await sim_faults(client, fleet.urls[0], latency_s=2.0)  # the slot stays held

        async def post(body: dict[str, Any]) -> tuple[int, str | None, dict[str, Any]]:
            async with client.post(url, json=body) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

        holder = asyncio.create_task(post(CHAT))
        await asyncio.sleep(0.05)
        waiter = asyncio.create_task(post(CHAT))  # queued, then times out: 503
        await asyncio.sleep(0.05)
        status, retry_after, body = await post(CHAT)  # queue full: 429
        assert status == 429 and retry_after and body["error"]["code"] == 429
        status, retry_after, body = await waiter
        assert status == 503 and retry_after and body["error"]["code"] == 503
        assert (await holder)[0] == 200


async def test_no_routable_worker_is_503(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls[:2]) as gw:
        for worker in gw.registry:
            worker.flags.add(HealthFlag.DRAINING)
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            await _error(resp, 503)
            assert resp.headers["Retry-After"]
