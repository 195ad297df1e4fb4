"""Engine load polling: each worker's own queue and KV figures → ``policies.base.EngineLoad``.

Contract: every ``poll_interval_s`` each worker is asked its kind's load paths in order
of preference (``gateway.workers.kinds``): for SGLang ``/v1/loads`` (≥ 0.5.9),
``/get_load`` (≤ 0.5.18; gone in 0.5.23), then ``/metrics`` (needs ``--enable-metrics``);
llama.cpp ``/metrics`` then ``/slots``; vLLM ``/metrics``; a generic OpenAI server none.
The first endpoint that answers 200 with a shape we understand is remembered per worker
(and kind); a 404 or an unknown shape moves to the next.
Connection errors leave the last figures in place (their age grows; policies see it).
Multiple data-parallel ranks are summed (requests, tokens) or maxed (token usage) into the
worker's load; a worker routed to per rank (``Worker.ranks``) also has each rank's own
entry set on that rank, and its capacity is a rank's (SGLang sizes the pool per rank).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from gateway.config import LoadConfig
from gateway.tasks import gather_contained
from gateway.workers.kinds import kind_named
from gateway.workers.registry import Worker, WorkerRegistry
from gateway.workers.replies import LoadReading
from policies.base import EngineLoad


class LoadPoller:
    def __init__(
        self,
        config: LoadConfig,
        registry: WorkerRegistry,
        session: aiohttp.ClientSession,
        timeout_s: float,
    ) -> None:
        self._config = config
        self._registry = registry
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        # worker id → (kind, index into that kind's load paths)
        self._endpoint: dict[str, tuple[str, int]] = {}
        self.on_capacity: list[Callable[[Worker], None]] = []

    async def run(self) -> None:
        while True:
            workers = list(self._registry)
            if workers:
                await gather_contained([self.poll(w) for w in workers], "load poll")
            await asyncio.sleep(self._config.poll_interval_s)

    def forget(self, worker: Worker) -> None:
        self._endpoint.pop(worker.id, None)

    async def poll(self, worker: Worker) -> None:
        kind = kind_named(worker.kind)
        paths = kind.load_paths
        remembered, start = self._endpoint.get(worker.id, (kind.name, 0))
        if remembered != kind.name:
            start = 0  # its kind was discovered since
        for index in range(start, len(paths)):
            result = await self._read(worker, paths[index])
            if result is _UNREACHABLE:
                return
            if isinstance(result, EngineLoad):
                self._endpoint[worker.id] = (kind.name, index)
                worker.engine_load = result
                worker.load_read_at = self._registry.clock()
                return
        self._endpoint[worker.id] = (kind.name, len(paths))  # nothing usable: stop asking

    async def _read(self, worker: Worker, path: str) -> EngineLoad | object | None:
        try:
            async with self._session.get(
                worker.url + path, timeout=self._timeout, allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    return None
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return _UNREACHABLE
        kind = kind_named(worker.kind)
        parsed = kind.parse_load(path, raw)
        if parsed is None:
            return None
        load, capacity = parsed
        if worker.ranks:
            capacity = self._rank_loads(worker, kind.parse_rank_loads(path, raw)) or capacity
        if capacity and worker.metadata.capacity_tokens is None:
            worker.metadata.capacity_tokens = capacity
            for listener in self.on_capacity:
                listener(worker)
        return load

    def _rank_loads(self, worker: Worker, readings: dict[int, LoadReading]) -> int | None:
        """Each DP rank's own load from a per-rank answer (a rank it omits keeps its
        last); returns the largest rank capacity told (capacity is per rank there)."""
        now = self._registry.clock()
        capacity = None
        for rank in worker.ranks:
            reading = readings.get(rank.dp_rank) if rank.dp_rank is not None else None
            if reading is not None:
                rank.engine_load, rank.load_read_at = reading[0], now
                if reading[1]:
                    capacity = max(capacity or 0, reading[1])
        return capacity


_UNREACHABLE = object()
