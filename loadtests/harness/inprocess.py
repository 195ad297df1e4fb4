"""An in-process gateway for tests, benchmarks and demos (like ``aiohttp.test_utils``).

Contract: ``async with run_gateway(urls, **overrides) as gw`` builds the real application
(``gateway.app.build_app``) with ``TEST_DEFAULTS`` plus ``overrides`` (dotted config keys,
``__`` standing for ``.``), serves it on an ephemeral loopback port, waits until the given
workers passed their first probe (bounded), and stops it on exit. ``BackgroundGateway``
runs one in front of simulated workers on its own loop in a thread, for synchronous
clients (``with BackgroundGateway(**overrides) as gw: gw.url``). ``sim_faults`` and
``sim_stats`` speak the simulated worker's ``/_sim`` control API.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Self

import aiohttp
from aiohttp import web

from gateway.app import build_app
from gateway.config import GatewayConfig, config_from_dict, merge
from gateway.http import app_keys
from gateway.http.handlers import start_site
from gateway.routing.router import Router
from gateway.workers.registry import WorkerRegistry

# Fast probes and polls so health flips within a test; round robin for predictability.
# Exact mode's tokenizer in front of simulated workers: the simulator's own, named by config.
SIM_TOKENIZER = "python:simulator.model.tokenizer:default_tokenizer"

TEST_DEFAULTS: dict[str, Any] = {
    "kv_events.tokenizer": SIM_TOKENIZER,
    "policy.name": "round_robin",
    "policy.seed": 7,
    "health.interval_s": 0.2,
    "health.timeout_s": 1.0,
    "health.endpoint": "/ping",
    "load.poll_interval_s": 0.2,
    "server.request_timeout_s": 30.0,
    "server.connect_timeout_s": 2.0,
}


@dataclass
class GatewayHandle:
    url: str
    app: web.Application
    config: GatewayConfig

    @property
    def registry(self) -> WorkerRegistry:
        return self.app[app_keys.REGISTRY]

    @property
    def router(self) -> Router:
        return self.app[app_keys.ROUTER]


@contextlib.asynccontextmanager
async def run_gateway(
    urls: Sequence[str], *, ready_within_s: float = 3.0, **overrides: Any
) -> AsyncIterator[GatewayHandle]:
    settings = {
        **TEST_DEFAULTS,
        "workers": list(urls),
        **{k.replace("__", "."): v for k, v in overrides.items()},
    }
    config = config_from_dict(merge({}, settings))
    app = build_app(config)
    runner, port = await start_site(app, "127.0.0.1", 0)
    try:
        handle = GatewayHandle(f"http://127.0.0.1:{port}", app, config)
        deadline = asyncio.get_running_loop().time() + ready_within_s
        for _ in range(10_000):  # first probes: one interval at most
            if (
                handle.registry.healthy_count() >= len(urls)
                or asyncio.get_running_loop().time() >= deadline
            ):
                break
            await asyncio.sleep(0.02)
        yield handle
    finally:
        await runner.cleanup()


async def sim_faults(session: aiohttp.ClientSession, worker_url: str, **faults: Any) -> None:
    async with session.post(worker_url + "/_sim/faults", json=faults) as resp:
        if resp.status != 200:
            raise AssertionError(f"fault injection refused: {await resp.text()}")


async def sim_stats(session: aiohttp.ClientSession, worker_url: str) -> dict[str, Any]:
    async with session.get(worker_url + "/_sim/stats") as resp:
        resp.raise_for_status()
        stats: dict[str, Any] = await resp.json()
        return stats


class BackgroundGateway:
    """A gateway in front of ``workers`` simulated workers (at ``speed``), on an event loop
    of its own in a daemon thread: for synchronous clients (``http.client``,
    schemathesis). ``url`` is set once entered; ``overrides`` as for ``run_gateway``."""

    def __init__(self, workers: int = 1, speed: float = 200.0, **overrides: Any) -> None:
        self.url = ""
        self._workers, self._speed, self._overrides = workers, speed, overrides
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        from simulator.fleet import SimConfig, SimulatedFleet  # the simulator: tests only

        self._stop = asyncio.Event()
        async with (
            await SimulatedFleet.start(self._workers, SimConfig(speed=self._speed)) as fleet,
            run_gateway(fleet.urls, **self._overrides) as gw,
        ):
            self.url = gw.url
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(20), "the gateway did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)
        self._loop.close()
