"""SGLang's admin routes, ``/flush_cache`` and ``/abort_request``, and this personality's
``/_sim/stats`` figures.

``/flush_cache`` (GET or POST) drops the radix tree only while no request runs or waits;
with ``?timeout=s`` it retries for that long, then answers 400 with SGLang's text. With DP
ranks each rank flushes on its own once idle, and the answer is 200 only if every rank did
(SGLang answers with the reply of whichever rank answers first, so with a busy rank it may
say either). ``/abort_request`` aborts the body's ``rid`` or, with ``abort_all``, every
request but the health checks, on every rank; it answers 200 whatever it found.
``/_sim/stats``: the server's figures (summed over ranks) and, with DP ranks, ``dp_ranks``,
one entry of the same figures per rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import orjson
from aiohttp import web

from simulator.http import api
from simulator.http.sglang.core import SGLangCore
from simulator.model.radix_worker import WorkerModel

FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class AdminRoutes(SGLangCore):
    """The cache and abort handlers and :meth:`sim_stats` (see module docstring)."""

    async def _flush_cache(self, request: web.BaseRequest) -> web.StreamResponse:
        timeout = 0.0
        if "timeout" in request.query:
            with contextlib.suppress(ValueError):
                timeout = float(request.query["timeout"])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pending = list(self.dp.ranks)
        while pending := [rank for rank in pending if not rank.engine.flush_cache()]:
            if loop.time() >= deadline:
                # the scheduler logs why; the HTTP answer of 0.5.23 is only this (checked
                # on the real server with a request running)
                return web.Response(status=400, text="Flush cache failed.\n")
            await asyncio.sleep(0.01)
        return web.Response(status=200, text=FLUSH_OK)

    async def _abort_request(self, request: web.BaseRequest) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError as exc:
            raise api.json_invalid(exc.msg, exc.pos) from None
        if isinstance(body, dict):
            if body.get("abort_all"):
                for driver in self._drivers():
                    for rid in list(driver._handles):
                        if not rid.startswith("HEALTH_CHECK"):
                            self._abort(rid)
            elif isinstance(body.get("rid"), str) and body["rid"]:
                self._abort(body["rid"])
        return web.Response(status=200)

    def sim_stats(self) -> dict[str, Any]:
        figures = [self._rank_figures(rank.engine) for rank in self.dp.ranks]
        total = {key: sum(f[key] for f in figures) for key in figures[0]}
        stats = dataclasses.asdict(self.stats)
        stats.update(
            {
                "running": total.pop("running"),
                "waiting": total.pop("waiting"),
                "model_time": self.driver.now() if self._driver is not None else 0.0,
                **total,
                "faults": self.faults.as_dict(),
            }
        )
        if len(figures) > 1:
            stats["dp_ranks"] = [{"dp_rank": r, **f} for r, f in enumerate(figures)]
        return stats

    @staticmethod
    def _rank_figures(engine: WorkerModel) -> dict[str, int]:
        """One rank's live figures for ``/_sim/stats``."""
        cache = engine.cache
        counters = engine.counters
        return {
            "running": engine.num_running + engine.num_prefilling,
            "waiting": engine.num_waiting,
            "kv_used_tokens": cache.used,
            "kv_evictable_tokens": cache.evictable,
            "kv_available_tokens": cache.available,
            "kv_capacity_tokens": cache.capacity,
            "kv_evicted_tokens_total": cache.evicted_total,
            "prompt_tokens_total": counters.prompt_tokens,
            "cached_tokens_total": counters.cached_tokens,
            "generation_tokens_total": counters.generation_tokens,
            "finished_total": counters.finished,
            "retractions_total": counters.retractions,
            **AdminRoutes._tier_figures(engine),
        }

    @staticmethod
    def _tier_figures(engine: WorkerModel) -> dict[str, int]:
        """HiCache's host tier (nothing without it)."""
        tiered = engine.tiered
        if tiered is None:
            return {}
        hc = tiered.counters
        return {
            "host_used_tokens": tiered.host_used,
            "host_capacity_tokens": tiered.host_capacity,
            "cached_host_tokens_total": engine.counters.cached_host_tokens,
            "hicache_load_tokens_total": hc.load_tokens,
            "hicache_backup_tokens_total": hc.backup_tokens,
            "hicache_host_evicted_tokens_total": hc.host_evicted_tokens,
            "hicache_dropped_tokens_total": sum(hc.dropped_tokens.values()),
        }
