"""Parsers of SGLang's replies: ``/server_info`` metadata and the load answers.

Contract: pure functions from a worker's reply (parsed JSON or raw bytes) to what the
gateway keeps (:class:`~gateway.workers.registry.WorkerMetadata`, an
:class:`~policies.base.EngineLoad` with the capacity if told); None (or defaults) for a
shape they do not understand, never an exception; a load figure that is no count (NaN,
infinite, negative, over 2**53) is none. The worker kinds (``kinds``) call them;
health probes and the load poller read through the kinds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.workers.registry import WorkerMetadata
from policies.base import EngineLoad

LoadReading = tuple[EngineLoad, int | None]  # load, capacity in tokens (None: not told)


def parse_server_info(info: Mapping[str, Any]) -> WorkerMetadata:
    """Model, KV capacity (per DP rank: SGLang's ``internal_states`` are per rank), page
    size, DP ranks and version from a ``/server_info`` body (any release)."""
    model = info.get("served_model_name") or info.get("model_path")
    capacity = info.get("max_total_num_tokens")
    if not isinstance(capacity, int):
        states = info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], Mapping):
            capacity = states[0].get("max_total_num_tokens")
    page = info.get("page_size")
    lora = info.get("enable_lora") is True
    names = (info.get("served_model_name"), info.get("model_path"))
    dp_size = info.get("dp_size")
    version = info.get("version")
    max_loras = info.get("max_loaded_loras")
    mode = info.get("disaggregation_mode")
    port = info.get("disaggregation_bootstrap_port")
    return WorkerMetadata(
        model=model if isinstance(model, str) else None,
        models=frozenset(n for n in names if isinstance(n, str) and n),
        capacity_tokens=capacity if isinstance(capacity, int) and capacity > 0 else None,
        page_size=page if isinstance(page, int) and page > 0 else None,
        lora_enabled=lora,
        max_loaded_loras=max_loras if type(max_loras) is int and max_loras > 0 else None,
        dp_size=dp_size if type(dp_size) is int and dp_size > 0 else 1,
        version=version if isinstance(version, str) and len(version) <= 64 else None,
        disaggregation_mode=mode if mode in ("prefill", "decode", "null") else None,
        bootstrap_port=port if type(port) is int and 1 <= port <= 65535 else None,
        host_capacity_tokens=host_tier_tokens(info, capacity if isinstance(capacity, int) else 0),
    )


# SGLang's HiCache defaults (server_args.py, 0.5.23): the host pool is twice the device's,
# and every block inserted is copied there (write_through).
_HICACHE_RATIO = 2.0
_WRITE_THROUGH = ("write_through", "write_through_selective")


def host_tier_tokens(info: Mapping[str, Any], device_tokens: int) -> int | None:
    """HiCache's host-only tier of one rank, in tokens, from ``/server_info``'s arguments
    (``enable_hierarchical_cache``, ``hicache_ratio``, ``hicache_size``,
    ``hicache_write_policy``), or None without one. The host pool is ``hicache_ratio``
    times the device pool, or ``hicache_size`` GB over the KV bytes per token (its
    ``memory_usage.kvcache`` GiB over ``max_total_num_tokens``, when told; else the
    ratio); as SGLang sizes it (``HostKVCache``). Under write-through (the default, and
    the selective one) the pool also holds a copy of the device's blocks, so the tier
    beyond the GPU is the pool less the device pool; under write-back, the whole pool."""
    if info.get("enable_hierarchical_cache") is not True or device_tokens <= 0:
        return None
    ratio = _finite(info.get("hicache_ratio"), _HICACHE_RATIO)
    pool = device_tokens * ratio
    size_gb = _finite(info.get("hicache_size"), 0.0)
    per_token = _kv_bytes_per_token(info, device_tokens)
    if size_gb > 0 and per_token:
        pool = size_gb * 1e9 / per_token
    if info.get("hicache_write_policy", "write_through") in _WRITE_THROUGH:
        pool -= device_tokens
    return int(min(pool, _MAX_FIGURE)) if pool >= 1 else None


def _finite(value: object, default: float) -> float:
    """``value`` if it is a number in [0, 2**53) (NaN, infinities and booleans are not),
    else ``default``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        if 0 <= number < _MAX_FIGURE:
            return number
    return default


def _kv_bytes_per_token(info: Mapping[str, Any], device_tokens: int) -> float | None:
    states = info.get("internal_states")
    if not (isinstance(states, list) and states and isinstance(states[0], Mapping)):
        return None
    usage = states[0].get("memory_usage")
    kv_gib = _finite(usage.get("kvcache") if isinstance(usage, Mapping) else None, 0.0)
    return kv_gib * 2**30 / device_tokens if kv_gib > 0 else None


def parse_adapters(body: Any) -> tuple[dict[str, str], dict[str, str]] | None:
    """The LoRA adapters a ``/v1/models`` body lists (cards with a ``parent``: SGLang,
    vLLM): (name → path: ``root``, else the name; name → the ``parent`` when a string);
    None if not a model list. Malformed cards are skipped; the registry bounds the rest."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    adapters: dict[str, str] = {}
    parents: dict[str, str] = {}
    for card in data:
        if not isinstance(card, dict) or not card.get("parent"):
            continue
        name, root, parent = card.get("id"), card.get("root"), card.get("parent")
        if isinstance(name, str) and name:
            adapters[name] = root if isinstance(root, str) and root else name
            if isinstance(parent, str):
                parents[name] = parent
    return adapters, parents


# A worker's count or usage beyond this (or negative, or not a number) is no reading:
# 0. Sums of such figures stay finite (two of 1e308 overflowed ``int()``).
_MAX_FIGURE = float(2**53)


def _figure(value: object) -> float | None:
    """``value`` as a load figure, or None (see ``_MAX_FIGURE``)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    return float(value) if 0 <= value <= _MAX_FIGURE else None  # NaN fails both


def gauge_count(gauges: Mapping[str, float], name: str) -> int:
    """A Prometheus gauge read as a request count: 0 when absent or no load figure (NaN,
    infinite, negative, over 2**53), so one bad sample never stops the readings."""
    return int(_figure(gauges.get(name)) or 0.0)


def _num(entry: Mapping[str, Any], key: str) -> float:
    return _figure(entry.get(key)) or 0.0


def _load_entries(body: Any, key: str | None) -> list[dict[str, Any]] | None:
    """The per-rank entries of a load answer: ``body[key]`` (``/v1/loads``) or ``body``
    itself (``/get_load``'s list); None if not a non-empty list."""
    loads = body if key is None else body.get(key) if isinstance(body, dict) else None
    if not isinstance(loads, list) or not loads:
        return None
    return [e for e in loads if isinstance(e, dict)]


def _v1_loads(entries: list[dict[str, Any]]) -> LoadReading:
    uncached = [
        int(_num(e, "num_waiting_uncached_tokens"))
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


def parse_v1_loads(body: Any) -> LoadReading | None:
    """``/v1/loads`` JSON → (load, max_total_num_tokens), or None if not that shape."""
    entries = _load_entries(body, "loads")
    return None if entries is None else _v1_loads(entries)


def parse_get_load(body: Any) -> EngineLoad | None:
    """``/get_load`` list form (0.5.5-0.5.18). The 0.4 ``{"load": n}`` form is too coarse."""
    entries = _load_entries(body, None)
    if not entries or "num_reqs" not in entries[0]:
        return None
    return _get_load(entries)


def _get_load(entries: list[dict[str, Any]]) -> EngineLoad:
    waiting = sum(_num(e, "num_waiting_reqs") for e in entries)
    return EngineLoad(
        running_requests=max(0, int(sum(_num(e, "num_reqs") for e in entries) - waiting)),
        waiting_requests=int(waiting),
    )


def parse_sglang_rank_loads(path: str, raw: bytes) -> dict[int, LoadReading]:
    """A ``/v1/loads`` or ``/get_load`` answer per ``dp_rank`` (rank → (load, that rank's
    capacity if told)); {} for another path or shape. Entries without an integer
    ``dp_rank`` are skipped."""
    if path not in ("/v1/loads", "/get_load"):
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    entries = _load_entries(body, "loads" if path == "/v1/loads" else None)
    out: dict[int, LoadReading] = {}
    for e in entries or ():
        rank = e.get("dp_rank")
        if type(rank) is not int or rank < 0:
            continue
        if path == "/v1/loads":
            out[rank] = _v1_loads([e])
        elif "num_reqs" in e:
            out[rank] = (_get_load([e]), None)
    return out


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
            value = _figure(float(value_text))
        except ValueError:
            continue
        if value is None:  # NaN, infinite, negative or absurd
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
