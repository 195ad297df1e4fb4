"""Engine load polling: each worker's own queue and KV figures → ``policies.base.EngineLoad``.

Contract: every ``poll_interval_s`` each worker is asked its kind's load paths in order
of preference (``gateway.worker_kinds``): for SGLang ``/v1/loads`` (≥ 0.5.9),
``/get_load`` (≤ 0.5.18; gone in 0.5.23), then ``/metrics`` (needs ``--enable-metrics``);
llama.cpp ``/metrics`` then ``/slots``; vLLM ``/metrics``; a generic OpenAI server none.
The first endpoint that answers 200 with a shape we understand is remembered per worker
(and kind); a 404 or an unknown shape moves to the next.
Connection errors leave the last figures in place (their age grows; policies see it).
Multiple data-parallel ranks are summed (requests, tokens) or maxed (token usage).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import orjson

from gateway.config import LoadConfig
from gateway.registry import Worker, WorkerRegistry
from gateway.worker_kinds import LoadReading, kind_named
from policies.base import EngineLoad


def _num(entry: Mapping[str, Any], key: str) -> float:
    value = entry.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def parse_v1_loads(body: Any) -> tuple[EngineLoad, int | None] | None:
    """``/v1/loads`` JSON → (load, max_total_num_tokens), or None if not that shape."""
    loads = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(loads, list) or not loads:
        return None
    entries = [e for e in loads if isinstance(e, dict)]
    uncached = [
        e["num_waiting_uncached_tokens"]
        for e in entries
        if isinstance(e.get("num_waiting_uncached_tokens"), int)
    ]
    capacity = sum(int(_num(e, "max_total_num_tokens")) for e in entries)
    load = EngineLoad(
        running_requests=int(sum(_num(e, "num_running_reqs") for e in entries)),
        waiting_requests=int(sum(_num(e, "num_waiting_reqs") for e in entries)),
        waiting_uncached_tokens=sum(uncached) if uncached else None,
        token_usage=max((_num(e, "token_usage") for e in entries), default=0.0),
    )
    return load, capacity or None


def parse_get_load(body: Any) -> EngineLoad | None:
    """``/get_load`` list form (0.5.5-0.5.18). The 0.4 ``{"load": n}`` form is too coarse."""
    if not isinstance(body, list) or not body:
        return None
    entries = [e for e in body if isinstance(e, dict)]
    if not entries or "num_reqs" not in entries[0]:
        return None
    waiting = sum(_num(e, "num_waiting_reqs") for e in entries)
    return EngineLoad(
        running_requests=max(0, int(sum(_num(e, "num_reqs") for e in entries) - waiting)),
        waiting_requests=int(waiting),
    )


def parse_metrics(text: str) -> EngineLoad | None:
    """SGLang scheduler gauges from Prometheus text, or None when absent."""
    running = waiting = 0.0
    usage = 0.0
    seen = False
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        value_text = rest.rsplit(" ", 1)[-1] if rest else ""
        try:
            value = float(value_text)
        except ValueError:
            continue
        if name == "sglang:num_running_reqs":
            running += value
            seen = True
        elif name == "sglang:num_queue_reqs":
            waiting += value
            seen = True
        elif name == "sglang:token_usage":
            usage = max(usage, value)
    if not seen:
        return None
    return EngineLoad(
        running_requests=int(running), waiting_requests=int(waiting), token_usage=usage
    )


def parse_sglang_load(path: str, raw: bytes) -> LoadReading | None:
    """An SGLang load answer (``/v1/loads``, ``/get_load`` or ``/metrics``) → (load,
    capacity in tokens if told), or None if not a shape we understand."""
    if path == "/metrics":
        metrics = parse_metrics(raw.decode("utf-8", "replace"))
        return None if metrics is None else (metrics, None)
    with contextlib.suppress(orjson.JSONDecodeError):
        body = orjson.loads(raw)
        if path == "/get_load":
            load = parse_get_load(body)
            return None if load is None else (load, None)
        return parse_v1_loads(body)
    return None


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
                await asyncio.gather(*(self.poll(w) for w in workers))
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
            async with self._session.get(worker.url + path, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return None
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return _UNREACHABLE
        parsed = kind_named(worker.kind).parse_load(path, raw)
        if parsed is None:
            return None
        load, capacity = parsed
        if capacity and worker.metadata.capacity_tokens is None:
            worker.metadata.capacity_tokens = capacity
            for listener in self.on_capacity:
                listener(worker)
        return load


_UNREACHABLE = object()
