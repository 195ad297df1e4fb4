"""Active health probes and worker metadata discovery.

Contract:
- Every ``interval_s`` each worker's ``endpoint`` is probed (GET, ``timeout_s``): a 200 is a
  pass, anything else (status, timeout, connection error) a failure.
- ``failure_threshold`` consecutive failures set ``HealthFlag.CHECK_FAILED``;
  ``success_threshold`` consecutive passes clear it. A newly added worker carries
  ``HealthFlag.UNCHECKED`` until its first pass (one pass suffices: nothing was known).
- After a pass, a worker whose metadata is unknown has its ``/server_info`` read (model,
  ``max_total_num_tokens``, page size) and ``on_metadata`` listeners are told.
- :meth:`HealthChecker.check_now` probes one worker at once (used when a worker is added).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import orjson

from gateway.config import HealthConfig
from gateway.registry import HealthFlag, Worker, WorkerMetadata, WorkerRegistry

log = logging.getLogger(__name__)

_INFO_PATHS = ("/server_info", "/get_server_info")


def parse_server_info(info: Mapping[str, Any]) -> WorkerMetadata:
    """Model, KV capacity and page size from a ``/server_info`` body (any release)."""
    model = info.get("served_model_name") or info.get("model_path")
    capacity = info.get("max_total_num_tokens")
    if not isinstance(capacity, int):
        states = info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], Mapping):
            capacity = states[0].get("max_total_num_tokens")
    page = info.get("page_size")
    return WorkerMetadata(
        model=model if isinstance(model, str) else None,
        capacity_tokens=capacity if isinstance(capacity, int) and capacity > 0 else None,
        page_size=page if isinstance(page, int) and page > 0 else None,
    )


class HealthChecker:
    def __init__(
        self, config: HealthConfig, registry: WorkerRegistry, session: aiohttp.ClientSession
    ) -> None:
        self._config = config
        self._registry = registry
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self.on_metadata: list[Callable[[Worker], None]] = []
        self.on_flip: list[Callable[[Worker, bool], None]] = []  # telemetry hooks

    async def run(self) -> None:
        """Probe every worker each interval, forever (cancelled at shutdown)."""
        while True:
            workers = list(self._registry)
            if workers:
                await asyncio.gather(*(self.check_now(w) for w in workers))
            await asyncio.sleep(self._config.interval_s)

    async def check_now(self, worker: Worker) -> bool:
        ok = await self._probe(worker)
        self.record(worker, ok)
        if ok and worker.metadata.model is None:
            await self.refresh_metadata(worker)
        return ok

    async def _probe(self, worker: Worker) -> bool:
        try:
            async with self._session.get(
                worker.url + self._config.endpoint, timeout=self._timeout
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def record(self, worker: Worker, ok: bool) -> None:
        """Count one probe result; flip the flag after enough consecutive ones."""
        cfg = self._config
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            if HealthFlag.UNCHECKED in worker.flags:
                worker.flags.discard(HealthFlag.UNCHECKED)
                self._flipped(worker, True)
            if (
                HealthFlag.CHECK_FAILED in worker.flags
                and worker.health_successes >= cfg.success_threshold
            ):
                worker.flags.discard(HealthFlag.CHECK_FAILED)
                self._flipped(worker, True)
        else:
            worker.health_successes = 0
            worker.health_failures += 1
            if (
                HealthFlag.CHECK_FAILED not in worker.flags
                and worker.health_failures >= cfg.failure_threshold
            ):
                worker.flags.add(HealthFlag.CHECK_FAILED)
                self._flipped(worker, False)

    def _flipped(self, worker: Worker, passing: bool) -> None:
        if passing:
            log.info("worker %s passes its health check", worker.url)
        else:
            log.warning(
                "worker %s failed %d health checks in a row", worker.url, worker.health_failures
            )
        for hook in self.on_flip:
            hook(worker, passing)

    async def refresh_metadata(self, worker: Worker) -> None:
        for path in _INFO_PATHS:
            with contextlib.suppress(
                aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError
            ):
                async with self._session.get(worker.url + path, timeout=self._timeout) as resp:
                    if resp.status != 200:
                        continue
                    info = orjson.loads(await resp.read())
                if isinstance(info, dict):
                    worker.metadata = parse_server_info(info)
                    for listener in self.on_metadata:
                        listener(worker)
                    return
