"""Keys, admin key, probes, the worker allow-list (SSRF), rate limits, header limits and
the connection cap, through the real gateway; and no key in any log line."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import ClientSession

from gateway.workers.registry import HealthFlag
from loadtests.harness.inprocess import run_gateway, sim_faults
from simulator.fleet import SimulatedFleet

Eventually = Callable[..., Awaitable[None]]  # the ``eventually`` fixture (tests/conftest.py)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "secret prompt text"}]}
CLIENT, OTHER, ADMIN = "client-key-1", "client-key-2", "admin-key-1"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _status(client: ClientSession, method: str, url: str, **kw: object) -> int:
    async with client.request(method, url, **kw) as resp:  # type: ignore[arg-type]
        body = await resp.read()
        if resp.status >= 400:
            assert body.startswith(b'{"error"'), body[:200]
        return resp.status


async def test_client_and_admin_keys(
    fleet: SimulatedFleet, client: ClientSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# clients\n{OTHER}\n")
    caplog.set_level(logging.DEBUG)
    async with run_gateway(
        fleet.urls,
        server__api_key=CLIENT,
        server__api_keys_file=str(key_file),
        server__admin_api_key=ADMIN,
    ) as gw:
        api = gw.url + "/v1/chat/completions"
        assert await _status(client, "POST", api, json=CHAT) == 401
        assert await _status(client, "POST", api, json=CHAT, headers=_bearer("wrong")) == 401
        assert await _status(client, "POST", api, json=CHAT, headers=_bearer(CLIENT)) == 200
        assert await _status(client, "POST", api, json=CHAT, headers=_bearer(OTHER)) == 200
        for path in ("/workers", "/list_workers", "/debug/decisions", "/dashboard"):
            assert await _status(client, "GET", gw.url + path) == 401, path
            assert await _status(client, "GET", gw.url + path, headers=_bearer(CLIENT)) == 403
            assert await _status(client, "GET", gw.url + path, headers=_bearer(ADMIN)) == 200
        for path in ("/health", "/readiness", "/liveness", "/metrics"):
            assert await _status(client, "GET", gw.url + path) == 200, path
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for secret in (CLIENT, OTHER, ADMIN, "secret prompt text"):
        assert secret not in logged


async def test_keys_from_the_environment_and_protected_probes(
    fleet: SimulatedFleet, client: ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GW_TEST_KEYS", "env-key-a, env-key-b")
    async with run_gateway(
        fleet.urls, server__api_keys_env="GW_TEST_KEYS", server__protect_probes=True
    ) as gw:
        api = gw.url + "/v1/chat/completions"
        assert await _status(client, "POST", api, json=CHAT, headers=_bearer("env-key-b")) == 200
        assert await _status(client, "GET", gw.url + "/health") == 401
        assert await _status(client, "GET", gw.url + "/health", headers=_bearer("env-key-a")) == 200


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254:80",
        "http://[::ffff:169.254.169.254]:80",
        "http://8.8.8.8:53",
        "http://metadata.invalid:80",
        "http://a..b:80",
    ],
)
async def test_no_ssrf_through_the_admin_api(
    fleet: SimulatedFleet, client: ClientSession, url: str
) -> None:
    async with run_gateway(fleet.urls) as gw:
        status = await _status(client, "POST", gw.url + "/workers", json={"url": url})
        assert status in (400, 403)
        status = await _status(client, "POST", gw.url + "/add_worker", params={"url": url})
        assert status in (400, 403)
        assert len(gw.registry) == len(fleet.urls)  # nothing registered


async def test_allow_list_admits_listed_hosts(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls[:1], server__worker_allowlist=["127.0.0.1/32"]) as gw:
        assert (
            await _status(client, "POST", gw.url + "/workers", json={"url": fleet.urls[1]}) == 201
        )
        status = await _status(
            client, "POST", gw.url + "/workers", json={"url": "http://10.0.0.1:1"}
        )
        assert status == 403


async def test_rate_limit_per_key(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(
        fleet.urls,
        server__api_keys=[CLIENT, OTHER],
        server__rate_limit_per_s=0.2,  # a token per 5 s: robust on a slow machine
        server__rate_limit_burst=3,
    ) as gw:
        api = gw.url + "/v1/chat/completions"
        statuses = [
            await _status(client, "POST", api, json=CHAT, headers=_bearer(CLIENT)) for _ in range(5)
        ]
        assert statuses[:3] == [200, 200, 200] and 429 in statuses[3:]
        async with client.post(api, json=CHAT, headers=_bearer(CLIENT)) as resp:
            assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
        # another key has its own bucket; probes are never limited
        assert await _status(client, "POST", api, json=CHAT, headers=_bearer(OTHER)) == 200
        assert await _status(client, "GET", gw.url + "/health") == 200


async def test_header_size_limit(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls, server__max_header_size=1024) as gw:
        headers = {"X-Big": "a" * 4096}
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
            assert 400 <= r.status < 500


async def test_connection_cap_through_the_gateway(fleet: SimulatedFleet) -> None:
    async with run_gateway(fleet.urls, server__max_connections=2) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After" in answer
        writer.close()
        for _, w in held:
            w.close()


async def test_invalid_host_name_is_refused_even_when_any_host_is_allowed(
    fleet: SimulatedFleet, client: ClientSession, eventually: Eventually
) -> None:
    """Regression: a host name that IDNA cannot encode used to be registered, and then
    killed the health and load loops for every worker."""
    async with run_gateway(fleet.urls, server__worker_allowlist=["*"]) as gw:
        status = await _status(client, "POST", gw.url + "/workers", json={"url": "http://a..b:80"})
        assert status == 400
        await _status(
            client, "POST", gw.url + "/workers", json={"url": "http://" + "x" * 70 + ":1"}
        )
        await sim_faults(client, fleet.urls[0], fail_health=True)
        worker = gw.registry.find(fleet.urls[0])
        assert worker is not None
        await eventually(
            lambda: HealthFlag.CHECK_FAILED in worker.flags, 5, "the health loop still runs"
        )
