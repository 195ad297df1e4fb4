"""SGLang's health, information, load and metrics routes.

``/health`` and ``/health_generate`` run a one-token generation as SGLang does, so a check
waits behind a busy batch (503 after ``health_check_timeout_s``, with the ``fail_health``
fault, or while stopping); ``/ping`` and ``/ready`` answer at once. ``/server_info`` and
``/model_info`` (and their ``/get_`` forms), ``/v1/models`` and ``/v1/models/{id}`` describe
the configuration in SGLang's names. ``/v1/loads`` (``include``, ``dp_rank``,
``format=prometheus``) and the 0.5.5 list-shaped ``/get_load`` serve the model's load
snapshot, ``/metrics`` its metrics snapshot: both lag like the real ones (see
:mod:`simulator.model.radix_worker`). Latencies are in modelled seconds. With DP ranks
(:mod:`.dp`): health checks take turns among the ranks, ``internal_states``, the loads
and the scheduler gauges have one entry per rank, the top-level figures are rank 0's.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from simulator.config import SGLANG_VERSION
from simulator.http import api, metrics
from simulator.http.base import json_response
from simulator.http.sglang.core import SGLangCore
from simulator.http.sglang.dp import DPRank
from simulator.model.lora import parse_lora_spec
from simulator.model.requests import SimRequest


class InfoRoutes(SGLangCore):
    """The health, information, load and metrics handlers (see module docstring)."""

    # ------------------------------------------------------------------ health
    async def _health(self, request: web.BaseRequest) -> web.StreamResponse:
        """Like SGLang: a 1-token generation of ``input_ids=[0]``; healthy once any output
        arrives from the model after the check started (so it waits behind a busy batch)."""
        if self.faults.fail_health or self._stopping:
            return web.Response(status=503)
        loop = asyncio.get_running_loop()
        started = loop.time()
        driver = self._driver_of(self.dp.health_rank())
        seen: asyncio.Future[None] = loop.create_future()
        driver.activity.append(seen)
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        handle = driver.submit(
            SimRequest(rid=rid, prompt_ids=[0], max_new_tokens=1, stream=False),
            log_metrics=False,
        )
        try:
            await asyncio.wait_for(seen, self.config.health_check_timeout_s)
        except TimeoutError:
            return web.Response(status=503)
        finally:
            if not handle.done:
                driver.abort(rid)
        rest = self.profile.health_check_min_s - (loop.time() - started)
        if rest > 0:
            await asyncio.sleep(rest)
        return web.Response(status=200)

    async def _ping(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(status=503 if self.faults.fail_health or self._stopping else 200)

    # ------------------------------------------------------------------ server and model info
    def server_args(self) -> dict[str, Any]:
        """Resolved server arguments, SGLang's names (the subset a gateway may read)."""
        cfg, profile, engine = self.config, self.profile, self.engine
        return {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
            "chat_template": cfg.chat_template,
            "served_model_name": self.model,
            "host": self.host,
            "port": self.port,
            "dtype": "bfloat16",
            "kv_cache_dtype": "auto",
            "page_size": cfg.page_size,
            "chunked_prefill_size": profile.chunked_prefill_size,
            "max_prefill_tokens": profile.max_prefill_tokens,
            "max_running_requests": engine.max_running_requests,
            "max_total_tokens": None,
            "max_queued_requests": None,
            "context_length": self.context_length,
            "mem_fraction_static": 0.85,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": cfg.dp_size,
            "ep_size": 1,
            "schedule_policy": cfg.schedule_policy,
            "schedule_conservativeness": 1.0,
            "radix_eviction_policy": "lru",
            "disable_radix_cache": False,
            "enable_mixed_chunk": profile.mixed_chunk,
            "enable_cache_report": cfg.enable_cache_report,
            "enable_metrics": cfg.enable_metrics,
            "decode_log_interval": 40,
            "stream_interval": 1,
            "kv_events_config": cfg.kv_events_config,
            "api_key": None,
            "random_seed": cfg.seed,
            "disaggregation_mode": "null",
            "enable_lora": cfg.lora_enabled,
            "lora_paths": [
                {"lora_name": r.name, "lora_path": r.path, "pinned": r.pinned}
                for r in map(parse_lora_spec, cfg.lora_paths)
            ]
            or None,
            "max_loras_per_batch": cfg.max_loras_per_batch,
            "max_loaded_loras": cfg.max_loaded_loras,
            "weight_version": api.WEIGHT_VERSION,
            "sim_profile": profile.name,
            "sim_speed": cfg.speed,
            **self._hicache_args(),
        }

    def _hicache_args(self) -> dict[str, Any]:
        """SGLang's HiCache arguments, when the host tier is on (the simulator's link as
        ``sim_hicache_link``); nothing without it."""
        hicache = self.engine.hicache
        if hicache is None:
            return {}
        return {
            "enable_hierarchical_cache": True,
            "hicache_ratio": hicache.ratio,
            "hicache_size": hicache.size_gb,
            "hicache_write_policy": hicache.write_policy,
            "hicache_io_backend": hicache.io_backend,
            "hicache_mem_layout": "page_first",
            "hicache_host_memory_mode": "cache",
            "hicache_storage_backend": None,
            "sim_hicache_link": hicache.link.name,
        }

    async def _server_info(self, request: web.BaseRequest) -> web.StreamResponse:
        args = self.server_args()
        capacity = self.engine.cache.capacity
        kv_gb = round(capacity * self.profile.kv_bytes_per_token / 2**30, 2)
        internal_states = [
            {
                **args,
                "last_gen_throughput": round(rank.engine.load_snapshot.gen_throughput, 2),
                "memory_usage": {
                    "weight": self.profile.weight_gb,
                    "kvcache": kv_gb,
                    "startup_available": self.profile.gpu_memory_gb,
                    "token_capacity": capacity,
                    "token_capacity_swa": None,
                    "graph": {"cuda_graph": self.profile.graph_gb},
                },
                "effective_max_running_requests_per_dp": rank.engine.max_running_requests,
            }
            for rank in self.dp.ranks
        ]
        return json_response(
            {
                **args,
                "status": "ready",
                "max_total_num_tokens": capacity,
                "max_req_input_len": self.engine.max_req_input_len,
                "startup_time": self._startup_timings(),
                "hicache_object_layout": {
                    "enabled": False,
                    "backend": None,
                    "page_size": self.config.page_size,
                    "hicache_object_layout": {"pools": []},
                    "reason": "Hierarchical cache is disabled",
                },
                "internal_states": internal_states,
                "sim_lora_counters": {
                    "loads": self.loras.loads,
                    "reloads": self.loras.reloads,
                    "evictions": self.loras.evictions,
                },
                "version": SGLANG_VERSION,
                "frontend": "python",
                "launch_command": " ".join(shlex.quote(a) for a in sys.argv),
                "kv_events": self.kv_events.descriptor(len(self.dp)) if self.kv_events else None,
            }
        )

    def _startup_timings(self) -> dict[str, Any]:
        """0.5.23's ``startup_time``: seconds per start-up phase (a dict, not a timestamp).
        ``tokenizer_e2e`` carries this start's sub-second wall time, so a restarted worker
        reports another value (the gateway compares it to notice restarts)."""
        graph = dict.fromkeys(
            ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend"),
            0.0,
        )
        return {
            "load_weight": 0.0,
            "kv_cache_allocation": 0.0,
            "scheduler_e2e": 0.0,
            "cuda_graph": graph,
            "tokenizer_e2e": round(self._started % 1.0, 6),
        }

    async def _model_info(self, request: web.BaseRequest) -> web.StreamResponse:
        cfg = self.config
        return json_response(
            {
                "model_path": cfg.model_path,
                "served_model_name": self.model,
                "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
                "is_generation": True,
                "weight_version": api.WEIGHT_VERSION,
                "preferred_sampling_params": None,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.model,
            "parent": None,
            "max_model_len": self.context_length,
        }

    def _adapter_cards(self) -> list[dict[str, Any]]:
        """Loaded LoRA adapters: ``id`` the name, ``root`` the path, ``parent`` the served
        model, no ``max_model_len`` (0.5.23's ``available_models``)."""
        now = int(time.time())
        return [
            {
                "id": ref.name,
                "object": "model",
                "created": now,
                "owned_by": "sglang",
                "root": ref.path,
                "parent": self.model,
                "max_model_len": None,
            }
            for ref in self.loras.loaded()
        ]

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse:
        cards = [self._card(), *self._adapter_cards()] if self.loras.enabled else [self._card()]
        return json_response({"object": "list", "data": cards})

    def _model_card(self, name: str) -> web.StreamResponse:
        if name == self.model:
            return json_response(self._card())
        error = {
            "message": f"The model '{name}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return json_response({"error": error}, 404)

    # ------------------------------------------------------------------ load and metrics
    async def _loads(self, request: web.BaseRequest) -> web.StreamResponse:
        query = request.query
        include: set[str] | None = None
        if query.get("include"):
            include = {s.strip() for s in query["include"].split(",")}
            valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
            if not include <= valid:
                message = (
                    f"Invalid include sections: {include - valid}. Valid options: {sorted(valid)}"
                )
                raise api.openai_error(400, message)
        loads = [self._load_entry(include, rank) for rank in self.dp.ranks]
        if "dp_rank" in query:
            try:
                wanted = int(query["dp_rank"])
            except ValueError:
                raise api.validation_error(
                    [
                        {
                            "type": "int_parsing",
                            "loc": ("query", "dp_rank"),
                            "msg": "Input should be a valid integer",
                            "input": query["dp_rank"],
                        }
                    ]
                ) from None
            loads = [entry for entry in loads if entry["dp_rank"] == wanted]
        if query.get("format") == "prometheus":
            return web.Response(
                body=_loads_prometheus(loads).encode(), content_type="text/plain", charset="utf-8"
            )
        return json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": SGLANG_VERSION,
                "accelerator": self.profile.accelerator,
                "num_accelerators": 1,
                "loads": loads,
            }
        )

    def _load_entry(self, include: set[str] | None, rank: DPRank) -> dict[str, Any]:
        snap = rank.engine.load_snapshot
        counters = rank.engine.counters
        entry: dict[str, Any] = {
            "timestamp": time.time(),
            "dp_rank": rank.rank,
            "num_running_reqs": snap.num_running_reqs,
            "num_waiting_reqs": snap.num_waiting_reqs,
            "num_waiting_uncached_tokens": snap.num_waiting_uncached_tokens,
            "num_used_tokens": snap.num_used_tokens,
            "num_total_tokens": snap.num_used_tokens + snap.num_waiting_tokens,
            "num_active_tokens": snap.num_active_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": snap.max_total_num_tokens,
            "max_running_requests": rank.engine.max_running_requests,
            "token_usage": round(snap.token_usage, 4),
            "gen_throughput": round(snap.gen_throughput, 2),
            "cache_hit_rate": round(snap.cache_hit_rate, 4),
            "utilization": round(snap.utilization, 4),
            "total_prefill_uncached_tokens": counters.prefill_uncached_tokens,
            "total_prefill_busy_us": int(counters.prefill_busy_s * 1e6),
            "decode_moments": None,
        }
        if include is not None and "all" not in include and include == {"core"}:
            return entry
        sections = {
            "memory": (
                "memory",
                {
                    "weight_gb": self.profile.weight_gb,
                    "kv_cache_gb": round(
                        snap.max_total_num_tokens * self.profile.kv_bytes_per_token / 2**30, 3
                    ),
                    "graph_gb": self.profile.graph_gb,
                    "token_capacity": snap.max_total_num_tokens,
                },
            ),
            "disaggregation": (
                "disagg",
                {
                    "mode": "null",
                    "prefill_bootstrap_queue_reqs": 0,
                    "prefill_inflight_queue_reqs": 0,
                    "decode_prealloc_queue_reqs": 0,
                    "decode_transfer_queue_reqs": 0,
                    "decode_retracted_queue_reqs": 0,
                    "kv_transfer_speed_gb_s": 0.0,
                    "kv_transfer_latency_ms": 0.0,
                },
            ),
            "queues": (
                "queues",
                {
                    "waiting": snap.num_waiting_reqs,
                    "grammar": 0,
                    "paused": 0,
                    "retracted": snap.num_retracted_reqs,
                    "prealloc_ready": 0,
                },
            ),
        }
        for key, (token, section) in sections.items():
            if include is None or "all" in include or token in include:
                entry[key] = section
        return entry

    async def _get_load(self, request: web.BaseRequest) -> web.StreamResponse:
        snaps = [rank.engine.load_snapshot for rank in self.dp.ranks]
        return json_response(
            [
                {
                    "rid": None,
                    "http_worker_ipc": None,
                    "dp_rank": r,
                    "num_reqs": snap.num_running_reqs + snap.num_waiting_reqs,
                    "num_waiting_reqs": snap.num_waiting_reqs,
                    "num_tokens": snap.num_used_tokens + snap.num_waiting_tokens,
                }
                for r, snap in enumerate(snaps)
            ]
        )

    async def _metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        body = metrics.render(
            self.model,
            [rank.engine.metrics_snapshot for rank in self.dp.ranks],
            self.request_metrics,
            self.config.page_size,
            self.context_length,
            self._hicache_view(),
        )
        return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})

    def _hicache_view(self) -> metrics.HiCacheView | None:
        caches = [rank.engine.tiered for rank in self.dp.ranks]
        tiers = [c for c in caches if c is not None]
        if not tiers:
            return None
        counters = [rank.engine.counters for rank in self.dp.ranks]
        return metrics.HiCacheView(tiers, counters, self.transfer_metrics)


def _loads_prometheus(loads: list[dict[str, Any]]) -> str:
    """``/v1/loads?format=prometheus``: ``sglang_<key>{dp_rank="r"}`` gauges."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        load = dict(load)
        rank = load.pop("dp_rank")
        for key, value in load.items():
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub_key, sub_value in value.items():
                    if isinstance(sub_value, int | float) and not isinstance(sub_value, bool):
                        samples.setdefault(f"sglang_{prefix}_{sub_key}", []).append(
                            (rank, sub_value)
                        )
            elif isinstance(value, int | float) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return "\n".join(lines) + "\n"
