"""Worker kinds: what differs between engines beside the OpenAI API the gateway relays.

A worker's *kind* is one of ``sglang`` (the default), ``llamacpp``, ``vllm`` or ``openai``
(any other OpenAI-compatible server). It is given per worker (``url#kind`` in
``workers`` / ``--worker-urls``, or ``{"url", "kind"}`` on ``POST /workers``), else by
``worker_kind`` (``--worker-kind``), whose default ``auto`` discovers it (see
:func:`kind_from_probe` and ``gateway.workers.health``).

Contract of a kind (:class:`WorkerKind`), all of it free of I/O:
- ``health_path(configured)``: the path of the active health probe;
- ``info_paths`` / ``parse_info(path, body)``: where the worker describes itself and the
  metadata read from there (model, capacity in tokens, and ``max_sequences``: how many
  prompts it keeps cached, when that, not tokens, binds: llama.cpp's slots);
- ``load_paths`` / ``parse_load(path, raw)``: the engine's queue figures, tried in order
  (first path that parses is kept per worker), with the capacity in tokens if the answer
  carries it;
- ``abort_path``: a path to ``POST {"rid": ...}`` to stop a request, or ``None`` when the
  only way is closing the connection (which llama.cpp honours for streamed requests only);
  a kind without an abort path also gets the request body untouched (no ``rid`` added).
Reported cached tokens need no per-kind code: ``gateway.forward.relay`` reads the last
``"cached_tokens"`` (SGLang's ``meta_info``, OpenAI ``usage.prompt_tokens_details``: vLLM,
llama.cpp) or ``"cache_n"`` (llama.cpp's ``timings``, present in a stream's last chunk even
without ``stream_options.include_usage``); those keys mean the same on every kind.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from gateway.config.workerspec import LLAMACPP, OPENAI, SGLANG, VLLM
from gateway.workers.registry import WorkerMetadata
from gateway.workers.replies import (
    LoadReading,
    gauge_count,
    parse_server_info,
    parse_sglang_load,
    parse_sglang_rank_loads,
)
from policies.base import EngineLoad


class WorkerKind(Protocol):
    """One engine's probe, metadata, load and abort conventions (see the module)."""

    name: str
    info_paths: tuple[str, ...]
    load_paths: tuple[str, ...]
    abort_path: str | None

    def health_path(self, configured: str) -> str: ...
    def parse_info(self, path: str, body: Any) -> WorkerMetadata | None: ...
    def parse_load(self, path: str, raw: bytes) -> LoadReading | None: ...
    def parse_rank_loads(self, path: str, raw: bytes) -> dict[int, LoadReading]:
        """Per data-parallel rank, when the answer tells ranks apart ({}: it does not)."""
        ...


def kind_named(name: str) -> WorkerKind:
    """The adapter for a kind name (``auto`` or unknown: SGLang's, the default)."""
    return _KINDS.get(name, _KINDS[SGLANG])


# --- discovery -------------------------------------------------------------------------


def kind_from_server_header(value: str | None) -> str | None:
    """``Server: llama.cpp`` names llama.cpp; other servers (uvicorn…) say nothing."""
    return LLAMACPP if value and "llama.cpp" in value.lower() else None


def kind_from_models(body: Any) -> str:
    """The kind named by ``/v1/models``' ``owned_by`` (``vllm``, ``llamacpp``), else
    ``openai``; SGLang says ``sglang``."""
    for entry in _model_entries(body):
        owner = str(entry.get("owned_by", "")).lower()
        for kind in (VLLM, LLAMACPP, SGLANG):
            if owner == kind:
                return kind
    return OPENAI


def _model_entries(body: Any) -> list[Mapping[str, Any]]:
    data = body.get("data") if isinstance(body, dict) else None
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


def _figure_or_0(value: float | None) -> float:
    """A usage fraction as read: 0 when absent, NaN or negative (infinite: capped by the
    caller)."""
    return value if value is not None and value > 0 else 0.0  # NaN > 0 is false


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _prometheus(raw: bytes, prefix: str) -> dict[str, float]:
    """Sum of each ``prefix``-named sample (labels dropped, so ranks/models add up)."""
    out: dict[str, float] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith(prefix):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _models_metadata(body: Any) -> WorkerMetadata | None:
    entries = _model_entries(body)
    if not entries:
        return None
    ids = [i for i in (_str(e.get("id")) for e in entries) if i]
    return WorkerMetadata(model=ids[0] if ids else None, models=frozenset(ids))


# --- the kinds -------------------------------------------------------------------------


def dp_rank_key(version: str | None) -> str:
    """The request member that pins a DP rank on an SGLang worker of ``version``:
    ``routed_dp_rank`` from 0.5.10 (checked in the released packages' ``protocol.py`` and
    ``io_struct.py``), ``data_parallel_rank`` before (0.4.8 - 0.5.9), and for a version
    not told or not read (every release that has DP routing accepts that spelling; newer
    ones as a deprecated alias)."""
    m = _VERSION.match(version or "")
    if m is None:
        return "data_parallel_rank"
    release = (int(m[1]), int(m[2]), int(m[3]))
    return "routed_dp_rank" if release >= (0, 5, 10) else "data_parallel_rank"


_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


class SGLangKind:
    """SGLang: ``/server_info`` metadata, ``/v1/loads`` (or older) load, ``/abort_request``."""

    name: str = SGLANG
    info_paths: tuple[str, ...] = ("/server_info", "/get_server_info")
    load_paths: tuple[str, ...] = ("/v1/loads", "/get_load", "/metrics")
    abort_path: str | None = "/abort_request"

    def health_path(self, configured: str) -> str:
        return configured

    def parse_info(self, path: str, body: Any) -> WorkerMetadata | None:
        return parse_server_info(body) if isinstance(body, dict) else None

    def parse_load(self, path: str, raw: bytes) -> LoadReading | None:
        return parse_sglang_load(path, raw)

    def parse_rank_loads(self, path: str, raw: bytes) -> dict[int, LoadReading]:
        return parse_sglang_rank_loads(path, raw)


class LlamaCppKind:
    """llama.cpp's server: ``/props`` slots and context, ``/metrics`` or ``/slots`` load.

    With its RAM prompt cache off a worker keeps exactly ``total_slots`` prompts, one per
    slot: ``max_sequences = total_slots``; ``capacity_tokens = total_slots x n_ctx`` (per
    slot) is only the upper bound in tokens. No abort endpoint: closing the connection
    stops a streamed request (a plain one runs to ``max_tokens``).
    """

    name: str = LLAMACPP
    info_paths: tuple[str, ...] = ("/props",)
    load_paths: tuple[str, ...] = ("/metrics", "/slots")
    abort_path: str | None = None

    def health_path(self, configured: str) -> str:
        return "/health"

    def parse_info(self, path: str, body: Any) -> WorkerMetadata | None:
        if not isinstance(body, dict):
            return None
        slots = _int(body.get("total_slots"))
        if slots is None:
            return None
        settings = body.get("default_generation_settings")
        n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
        names = [n for n in (_str(body.get("model_alias")), _str(body.get("model_path"))) if n]
        return WorkerMetadata(
            model=names[0] if names else None,
            models=frozenset(names),
            capacity_tokens=slots * n_ctx if n_ctx else None,
            max_sequences=slots,
        )

    def parse_load(self, path: str, raw: bytes) -> LoadReading | None:
        if path == "/slots":
            return _llamacpp_slots_load(raw)
        gauges = _prometheus(raw, "llamacpp:")
        if "llamacpp:requests_processing" not in gauges:
            return None
        load = EngineLoad(
            running_requests=gauge_count(gauges, "llamacpp:requests_processing"),
            waiting_requests=gauge_count(gauges, "llamacpp:requests_deferred"),
        )
        return load, None

    def parse_rank_loads(self, path: str, raw: bytes) -> dict[int, LoadReading]:
        return {}


def _llamacpp_slots_load(raw: bytes) -> LoadReading | None:
    import orjson

    try:
        slots = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        return None
    busy = sum(1 for s in slots if s.get("is_processing") is True)
    return EngineLoad(running_requests=busy), None


class VllmKind:
    """vLLM: ``/metrics`` gauges (and KV size from ``vllm:cache_config_info``' labels)."""

    name: str = VLLM
    info_paths: tuple[str, ...] = ("/v1/models",)
    load_paths: tuple[str, ...] = ("/metrics",)
    abort_path: str | None = None

    def health_path(self, configured: str) -> str:
        return "/health"

    def parse_info(self, path: str, body: Any) -> WorkerMetadata | None:
        return _models_metadata(body)

    def parse_load(self, path: str, raw: bytes) -> LoadReading | None:
        gauges = _prometheus(raw, "vllm:")
        if "vllm:num_requests_running" not in gauges:
            return None
        usage = gauges.get("vllm:kv_cache_usage_perc", gauges.get("vllm:gpu_cache_usage_perc"))
        load = EngineLoad(
            running_requests=gauge_count(gauges, "vllm:num_requests_running"),
            waiting_requests=gauge_count(gauges, "vllm:num_requests_waiting"),
            token_usage=min(1.0, _figure_or_0(usage)),
        )
        return load, _vllm_capacity(raw)

    def parse_rank_loads(self, path: str, raw: bytes) -> dict[int, LoadReading]:
        return {}


def _vllm_capacity(raw: bytes) -> int | None:
    """``num_gpu_blocks x block_size`` from the ``vllm:cache_config_info`` labels."""
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(
                part.split("=", 1) for part in line.split("{", 1)[1].split("}", 1)[0].split(",")
                if "=" in part
            )  # fmt: skip
            blocks, size = (labels.get(k, "").strip('"') for k in ("num_gpu_blocks", "block_size"))
            if blocks.isdigit() and size.isdigit() and int(blocks) and int(size):
                return int(blocks) * int(size)
    return None


class OpenAIKind:
    """Any OpenAI-compatible server: ``/v1/models`` as probe and metadata, no load."""

    name: str = OPENAI
    info_paths: tuple[str, ...] = ("/v1/models",)
    load_paths: tuple[str, ...] = ()
    abort_path: str | None = None

    def health_path(self, configured: str) -> str:
        return "/v1/models"

    def parse_info(self, path: str, body: Any) -> WorkerMetadata | None:
        return _models_metadata(body)

    def parse_load(self, path: str, raw: bytes) -> LoadReading | None:
        return None

    def parse_rank_loads(self, path: str, raw: bytes) -> dict[int, LoadReading]:
        return {}


_KINDS: Mapping[str, WorkerKind] = MappingProxyType(
    {SGLANG: SGLangKind(), LLAMACPP: LlamaCppKind(), VLLM: VllmKind(), OPENAI: OpenAIKind()}
)
