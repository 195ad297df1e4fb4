"""Issue 16's suspected items, each checked: peers' workers and the allow-list, the admin
fallback to client keys, failed key checks, credentials in worker URLs. (Bounded bodies,
Accept-Encoding and the event-stream media type are in the worker and client modules.)"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

from aiohttp import ClientSession

from gateway.config import RedisConfig
from gateway.config.allowlist import HostAllowList
from gateway.peers.adapters import build_shared_state
from gateway.routing.prefix_index import PrefixIndex
from gateway.workers.registry import Worker, WorkerRegistry
from loadtests.harness.inprocess import run_gateway

RESOLVED = {"metadata.internal": ["169.254.169.254"], "good.internal": ["10.1.2.3"]}


async def _resolve(host: str) -> Sequence[str]:
    return RESOLVED.get(host, [])


async def test_workers_added_by_peers_pass_the_allow_list() -> None:
    registry = WorkerRegistry(0.5)
    tasks: list[asyncio.Task[None]] = []

    def spawn(coro: Coroutine[Any, Any, None]) -> object:
        tasks.append(asyncio.get_running_loop().create_task(coro))
        return tasks[-1]

    probed: list[Worker] = []
    _, state = build_shared_state(
        RedisConfig(url="redis://127.0.0.1:1"),
        PrefixIndex(block_tokens=16.0, max_blocks_per_worker=100),
        registry,
        probed.append,
        env={},
        allow=HostAllowList(["127.0.0.0/8", "10.0.0.0/8"], resolve=_resolve),
        spawn=spawn,
    )
    wanted = {
        "http://127.0.0.1:18009": "active",
        "http://169.254.169.254:80": "active",
        "http://metadata.internal:80": "active",
        "http://good.internal:8000": "active",
        "http://[fe80::1]:80": "active",
    }
    state._fleet.apply_workers(wanted, frozenset())
    await asyncio.gather(*tasks)
    assert sorted(w.url for w in registry) == [
        "http://127.0.0.1:18009",
        "http://good.internal:8000",
    ]
    assert sorted(w.url for w in probed) == sorted(w.url for w in registry)


async def _post_worker(url: str, key: str, worker: str) -> tuple[int, bytes]:
    async with (
        ClientSession() as client,
        client.post(
            url + "/workers", json={"url": worker}, headers={"Authorization": f"Bearer {key}"}
        ) as resp,
    ):
        return resp.status, await resp.read()


async def test_without_an_admin_key_only_the_workers_key_administers() -> None:
    async with run_gateway([], server__api_key="shared", server__api_keys=["other"]) as gw:
        status, _ = await _post_worker(gw.url, "other", "http://127.0.0.1:9")
        assert status == 403  # would receive "shared" with the new worker's first probe
        status, _ = await _post_worker(gw.url, "shared", "http://127.0.0.1:9")
        assert status == 201
    async with run_gateway([], server__api_keys=["one", "two"]) as gw:  # no key goes out
        status, _ = await _post_worker(gw.url, "two", "http://127.0.0.1:9")
        assert status == 201


async def test_failed_key_checks_are_bounded_per_address() -> None:
    async with run_gateway([], server__api_key="right") as gw, ClientSession() as client:
        statuses = []
        for _ in range(30):
            async with client.get(
                gw.url + "/v1/models", headers={"Authorization": "Bearer wrong"}
            ) as resp:
                statuses.append(resp.status)
        assert statuses[:20] == [401] * 20 and set(statuses[20:]) == {429}
        async with client.get(gw.url + "/v1/models", headers={"x-api-key": "wrong"}) as resp:
            assert resp.status == 429 and float(resp.headers["Retry-After"]) > 0


async def test_worker_urls_with_credentials_are_refused() -> None:
    async with run_gateway([]) as gw:
        status, body = await _post_worker(gw.url, "", "http://user:s3cret@127.0.0.1:9")
    assert status == 400 and b"s3cret" not in body
