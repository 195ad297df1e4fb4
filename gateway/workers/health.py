"""Active health probes and worker metadata discovery.

Contract:
- Every ``interval_s`` each worker's ``endpoint`` is probed (GET, ``timeout_s``): a 200 is a
  pass, anything else (status, timeout, connection error) a failure.
- ``failure_threshold`` consecutive failures set ``HealthFlag.CHECK_FAILED``;
  ``success_threshold`` consecutive passes clear it. A newly added worker carries
  ``HealthFlag.UNCHECKED`` until its first pass (one pass suffices: nothing was known).
- The probe path, and where metadata is read, depend on the worker's kind
  (``gateway.workers.kinds``). After a pass, a worker whose metadata is unknown, or that
  is coming back from failed checks (restarted, perhaps otherwise), has it read
  (SGLang ``/server_info``: model, ``max_total_num_tokens``, page size, ``dp_size``: a
  worker with several DP ranks gets one routing target per rank; llama.cpp
  ``/props``: slots and context) and ``on_metadata`` listeners are told.
- A worker of unknown kind (``auto``) is identified once it answers anything: by the
  probe's ``Server: llama.cpp`` header, else by the first of SGLang ``/server_info``,
  llama.cpp ``/props``, ``/v1/models`` (``owned_by``) that parses; its metadata comes from
  that same answer. Until then it is treated as SGLang; it is probed again at once with
  its own kind's path if the first probe failed.
- After each pass, a worker whose ``/server_info`` says ``enable_lora`` has its loaded
  LoRA adapters re-read from ``/v1/models`` (cards with a ``parent``).
- :meth:`HealthChecker.check_now` probes one worker at once (used when a worker is added).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp
import orjson

from gateway.config import HealthConfig
from gateway.config.workerspec import LLAMACPP, OPENAI, SGLANG
from gateway.tasks import gather_contained
from gateway.workers.kinds import (
    WorkerKind,
    kind_from_models,
    kind_from_server_header,
    kind_named,
)
from gateway.workers.registry import REGULAR, HealthFlag, Worker, WorkerMetadata, WorkerRegistry
from gateway.workers.replies import parse_adapters

log = logging.getLogger(__name__)


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
                await gather_contained([self.check_now(w) for w in workers], "health probe")
            await asyncio.sleep(self._config.interval_s)

    async def check_now(self, worker: Worker) -> bool:
        ok, server = await self._probe(worker)
        if server is not None and not worker.kind_known:
            learned = await self.refresh_metadata(worker, server)  # discovers the kind
            if learned and not ok:
                ok, server = await self._probe(worker)  # with its own kind's path
        elif ok and (worker.metadata.model is None or HealthFlag.CHECK_FAILED in worker.flags):
            await self.refresh_metadata(worker)  # unknown, or back from failing: restarted,
            # maybe with other settings (fewer DP ranks: a pinned rank gone is a 400)
        if ok and worker.metadata.lora_enabled:
            await self.refresh_adapters(worker)
        self.record(worker, ok)
        return ok

    async def refresh_adapters(self, worker: Worker) -> None:
        """Re-read the LoRA adapters ``worker`` has loaded (``/v1/models`` cards with a
        ``parent``); kept as they were when it does not answer."""
        listed = parse_adapters(await self._get_json(worker, "/v1/models"))
        if listed is not None:
            self._registry.set_adapters(worker, *listed)

    async def _probe(self, worker: Worker) -> tuple[bool, str | None]:
        """(passed, the answer's ``Server`` header: "" if absent, None if no answer)."""
        path = kind_named(worker.kind).health_path(self._config.endpoint)
        try:
            async with self._session.get(
                worker.url + path, timeout=self._timeout, allow_redirects=False
            ) as resp:
                await resp.read()
                return resp.status == 200, resp.headers.get("Server", "")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False, None

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

    async def refresh_metadata(self, worker: Worker, server: str | None = None) -> bool:
        """Read the worker's metadata (and, for an unknown kind, discover it; see module);
        True when it was read."""
        if worker.kind_known:
            kinds = [kind_named(worker.kind)]
        else:
            hinted = kind_from_server_header(server)
            kinds = [kind_named(k) for k in ((hinted,) if hinted else (SGLANG, LLAMACPP, OPENAI))]
        for kind in kinds:
            for path in kind.info_paths:
                body = await self._get_json(worker, path)
                if body is None:
                    continue
                if not worker.kind_known and kind.name == OPENAI:
                    kind = kind_named(kind_from_models(body))  # vllm, llamacpp or openai
                metadata = kind.parse_info(path, body)
                if metadata is not None:
                    self._learned(worker, kind, metadata)
                    return True
        return False

    async def _get_json(self, worker: Worker, path: str) -> object | None:
        with contextlib.suppress(
            aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError
        ):
            async with self._session.get(
                worker.url + path, timeout=self._timeout, allow_redirects=False
            ) as resp:
                if resp.status == 200:
                    body: object = orjson.loads(await resp.read())
                    return body
        return None

    def _learned(self, worker: Worker, kind: WorkerKind, metadata: WorkerMetadata) -> None:
        if not worker.kind_known:
            log.info("worker %s is of kind %s (discovered)", worker.url, kind.name)
            worker.kind, worker.kind_known = kind.name, True
        worker.metadata = metadata
        told = metadata.disaggregation_mode
        if worker.role != REGULAR and told not in (None, worker.role):
            log.warning(
                "worker %s is configured as a %s worker but its /server_info says "
                "disaggregation_mode %s: its requests will fail",
                worker.url, worker.role, told,
            )  # fmt: skip
        self._registry.sync_ranks(worker)  # DP ranks: one routing target each
        for listener in self.on_metadata:
            listener(worker)
