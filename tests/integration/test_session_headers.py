"""Session keys behind a live gateway (issue 22): under consistent_hash, requests with
different prompts that carry one session id in any of the default headers (aiperf's
X-Session-Affinity, Dynamo's, SMG's, llm-d's, the coding agents') stay on one worker."""

from __future__ import annotations

import pytest
from aiohttp import ClientSession

from gateway.config import ROUTING_KEY_HEADERS
from loadtests.harness.inprocess import run_gateway

pytest.importorskip("simulator.fleet")
from simulator.fleet import SimulatedFleet


async def test_each_default_header_keeps_a_session_on_one_worker(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls, policy__name="consistent_hash") as gw:
        for header in ROUTING_KEY_HEADERS:
            workers = set()
            for i in range(4):
                body = {
                    "model": "m",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"{header}: unrelated prompt {i}"}],
                }
                headers = {header.title(): f"session-of-{header}"}
                async with client.post(
                    gw.url + "/v1/chat/completions", json=body, headers=headers
                ) as resp:
                    assert resp.status == 200
                    workers.add(resp.headers["x-gateway-worker"])
                    await resp.read()
            assert len(workers) == 1, (header, workers)
        records = gw.router.decisions.latest(4 * len(ROUTING_KEY_HEADERS))
        assert {r.reason for r in records} == {"affinity"}  # by the key (no key: "load")
