"""Worker administration: sglang-router compatible endpoints and the legacy ones."""

from __future__ import annotations

import pytest
from aiohttp import ClientSession

from loadtests.harness.inprocess import run_gateway

pytest.importorskip("simulator.fleet")  # lands with the simulated worker
from simulator.fleet import SimulatedFleet

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_add_use_and_remove_a_worker(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls[:1]) as gw:
        new_url = fleet.urls[1]
        async with client.post(gw.url + "/workers", json={"url": new_url}) as resp:
            assert resp.status == 201
            added = await resp.json()
        assert added["url"] == new_url and added["healthy"] is True
        assert added["model"] == fleet.workers[1].model
        async with client.post(gw.url + "/workers", json={"url": new_url}) as resp:
            assert resp.status == 200  # already there
        async with client.get(gw.url + "/workers") as resp:
            listed = await resp.json()
        assert {w["url"] for w in listed["workers"]} == set(fleet.urls[:2])
        served = set()
        for _ in range(4):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                served.add(resp.headers["x-gateway-worker"])
        assert new_url in served
        async with client.get(f"{gw.url}/workers/{added['id']}") as resp:
            assert resp.status == 200
            assert (await resp.json())["in_flight"] == 0
        async with client.delete(f"{gw.url}/workers/{added['id']}") as resp:
            assert resp.status == 200
        async with client.get(f"{gw.url}/workers/{added['id']}") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == 404
        for _ in range(3):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.headers["x-gateway-worker"] == fleet.urls[0]


async def test_legacy_endpoints(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway([]) as gw:
        async with client.post(gw.url + "/add_worker", params={"url": fleet.urls[2]}) as resp:
            assert resp.status == 201
        async with client.get(gw.url + "/list_workers") as resp:
            assert (await resp.json())["urls"] == [fleet.urls[2]]
        async with client.post(
            gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}
        ) as resp:
            assert resp.status == 200
        async with client.post(gw.url + "/remove_worker", params={"url": fleet.urls[2]}) as resp:
            assert resp.status == 200
        async with client.get(gw.url + "/list_workers") as resp:
            assert (await resp.json())["urls"] == []
        async with client.post(gw.url + "/remove_worker", params={"url": fleet.urls[2]}) as resp:
            assert resp.status == 404


async def test_invalid_worker_urls_are_400(client: ClientSession) -> None:
    async with run_gateway([]) as gw:
        for body in ({"url": "ftp://h:1"}, {"url": "http://h"}, {"url": 3}, {"nope": 1}):
            async with client.post(gw.url + "/workers", json=body) as resp:
                assert resp.status == 400, body
                error = (await resp.json())["error"]
                assert error["type"] == "invalid_request_error" and error["message"]
        async with client.post(gw.url + "/add_worker", params={"url": "localhost"}) as resp:
            assert resp.status == 400
        async with client.post(gw.url + "/workers", data=b"{oops") as resp:
            assert resp.status == 400
        async with client.get(gw.url + "/workers") as resp:
            assert (await resp.json())["total"] == 0
