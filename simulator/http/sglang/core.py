"""What SGLang's routes share: the worker model and its KV event publisher, and the parsing
and submission of a generation request.

:class:`SGLangCore` builds the :class:`WorkerModel`, with the KV event recorder as its cache
listener when ``kv_events_config`` enables a publisher, and starts and stops the publisher
with the server. :meth:`SGLangCore._submit` applies SGLang's context-length checks (a
``ValueError`` carries SGLang's message; each route turns it into its own error shape) and
queues the request with the driver. Request ids: ``rid`` from the body, else
``uuid4().hex``; a rid already in flight is refused by the model (``ValueError``). A
request's cache namespace is its LoRA adapter (``model: "base:adapter"``, else
``lora_path``), ``extra_key`` and ``cache_salt``: requests in different namespaces never
share a prefix. The adapter must be loaded, or loaded once (then it is reloaded, costing
``lora_load_s``), else the request fails as in SGLang (:mod:`simulator.model.lora`).

With ``dp_size`` N the server has N ranks (:mod:`.dp`): a model, a driver and a KV event
publisher each; ``engine``, ``kv_events`` and ``driver`` are rank 0's, ``dp`` holds them
all. A request goes to the rank it names or to the next in turn; its rid must be unique
across ranks. LoRA adapters are the server's (SGLang's tokenizer keeps the registry and
``max_loaded_loras``; loads and unloads reach every rank), ``max_loras_per_batch`` is per
rank (each scheduler has its own adapter slots).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from simulator.config import KVEventsConfig, SimConfig
from simulator.http import api, metrics
from simulator.http.api import ApiError
from simulator.http.base import HttpWorker
from simulator.http.sglang.dp import DPRank, DPRanks, start_publishers
from simulator.model.driver import DrivenModel, ModelDriver, RequestHandle
from simulator.model.lora import LoraAdapters, LoraRef, LoraUpdate, parse_lora_spec
from simulator.model.radix_worker import WorkerModel
from simulator.model.requests import SimRequest

if TYPE_CHECKING:
    from simulator.http.kv_publisher import KVEventPublisher

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_MAX_INT = 2**63


@dataclass
class GenRequest:
    """One generation request, parsed from any of the generation routes."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    explicit_max: bool
    ignore_eos: bool
    namespace: str
    stream: bool
    adapter: str | None = None  # the LoRA adapter's name (SGLang's lora_path)
    dp_rank: int | None = None  # the DP rank the request names (routed_dp_rank)


class SGLangCore(HttpWorker):
    """The SGLang personality's model and request plumbing (see module docstring); the route
    families extend it and :class:`simulator.http.sglang.SimulatedWorker` combines them."""

    def __init__(
        self, config: SimConfig, host: str = "127.0.0.1", port: int = 0, index: int = 0
    ) -> None:
        super().__init__(config, host, port, index)
        self.context_length = config.context_length or self.profile.context_length
        ranks = []
        for r in range(config.dp_size):
            kv_events = self._kv_publisher(config, index * config.dp_size + r, r)
            listener = kv_events.recorder if kv_events is not None else None
            engine = WorkerModel.from_config(config, listener=listener, tokenizer=self.tokenizer)
            ranks.append(DPRank(r, engine, kv_events))
        self.dp = DPRanks(ranks)
        # HiCache: every rank's copies timed into one set of histograms (/metrics)
        self.transfer_metrics = metrics.TransferMetrics()
        for rank in ranks:
            if rank.engine.tiered is not None:
                rank.engine.tiered.on_transfer = self.transfer_metrics.observe
        self.engine = ranks[0].engine
        self.kv_events = ranks[0].kv_events
        self._rank_drivers: list[ModelDriver] = []  # ranks 1.. (rank 0's is self.driver)
        self.loras = LoraAdapters(
            config.lora_enabled,
            [parse_lora_spec(spec) for spec in config.lora_paths],
            config.max_loras_per_batch,
            config.max_loaded_loras,
        )

    def _driven_model(self) -> DrivenModel:
        return self.engine

    # ------------------------------------------------------------------ lifecycle and KV events
    async def start(self) -> None:
        """Listen on ``host:port`` (0: an ephemeral port, then ``self.port`` is set)."""
        publishers = [rank.kv_events for rank in self.dp.ranks if rank.kv_events is not None]
        if publishers:
            start_publishers(publishers)
        speed = self.config.speed
        self._rank_drivers = [
            ModelDriver(rank.engine, speed, self._observe) for rank in self.dp.ranks[1:]
        ]
        for driver in self._rank_drivers:
            driver.start()
        await super().start()

    async def stop(self, kill: bool = True) -> None:
        """Stop serving. ``kill``: like a killed process, open connections are cut at once."""
        self._stopping = True
        for driver in self._rank_drivers:
            await driver.stop()
        await super().stop(kill)
        for rank in self.dp.ranks:
            if rank.kv_events is not None:
                await rank.kv_events.close()

    def _drivers(self) -> list[ModelDriver]:
        """Every rank's driver, rank 0's first (none before start)."""
        return [] if self._driver is None else [self._driver, *self._rank_drivers]

    def _driver_of(self, rank: DPRank) -> ModelDriver:
        return self.driver if rank.rank == 0 else self._rank_drivers[rank.rank - 1]

    def _abort(self, rid: str) -> bool:
        """Abort ``rid`` on whichever rank holds it."""
        for driver in self._drivers():
            if driver.abort(rid):
                self.stats.aborts += 1
                self.request_metrics.observe_aborted()
                return True
        return False

    @staticmethod
    def _kv_publisher(config: SimConfig, offset: int, dp_rank: int) -> KVEventPublisher | None:
        """The KV event publisher when ``kv_events_config`` enables one (ports + offset)."""
        if config.kv_events_config is None:
            return None
        from simulator.http.kv_publisher import KVEventPublisher  # optional extra

        kv_config = KVEventsConfig.from_json(config.kv_events_config)
        if not kv_config.enabled:
            return None
        return KVEventPublisher(
            kv_config,
            config.page_size,
            offset=offset,
            legacy_array=config.kv_events_legacy_array,
            dp_rank=dp_rank,
        )

    # ------------------------------------------------------------------ request plumbing
    def _submit(self, gen: GenRequest, stream_outputs: bool) -> RequestHandle:
        """Validate (the DP rank, the context length, the rid) and queue on a rank;
        ValueError carries SGLang's text."""
        routed = self.dp.check(gen.dp_rank)
        prompt_len = len(gen.prompt_ids)
        if prompt_len >= self.context_length:
            raise ValueError(api.context_too_long(prompt_len, self.context_length))
        max_new = gen.max_new_tokens
        eos_at: int | None = None
        if gen.explicit_max:
            if max_new + prompt_len >= self.context_length:
                raise ValueError(api.total_too_long(prompt_len, max_new, self.context_length))
        else:
            max_new = max(self.context_length - prompt_len - 1, 0)
            eos_at = min(self.config.natural_output_tokens, max_new) or None
        for ref in self.loras.resolve([gen.adapter] if gen.adapter else []):
            self.load_adapter(ref)  # SGLang's implicit reload of an evicted adapter
        req = SimRequest(
            adapter=gen.adapter,
            rid=gen.rid,
            prompt_ids=gen.prompt_ids,
            max_new_tokens=max_new,
            ignore_eos=gen.ignore_eos,
            eos_at=eos_at,
            namespace=gen.namespace,
            stream=stream_outputs,
        )
        if len(self.dp) == 1:
            return self.driver.submit(req)
        if any(driver.get(gen.rid) is not None for driver in self._drivers()):
            raise ValueError(f"Duplicate request ID detected: {gen.rid}")
        rank = self.dp.dispatch(routed)
        handle = self._driver_of(rank).submit(req)
        handle.dp_rank = rank.rank
        return handle

    def _rid(self, body: dict[str, Any]) -> str:
        rid = body.get("rid")
        if rid is None:
            return uuid.uuid4().hex
        if not isinstance(rid, str):
            raise api.wrong_type("rid", "string", rid)
        return rid

    def load_adapter(self, ref: LoraRef, waited: bool = False) -> LoraUpdate:
        """Register ``ref``; its requests wait ``lora_load_s`` of modelled time for the
        weights, unless the caller already waited that long (an explicit
        ``/load_lora_adapter`` answers once the weights are in); adapters evicted to make
        room leave the model."""
        result = self.loras.load(ref)
        if result.success:
            for rank in self.dp.ranks:
                now = self._driver_of(rank).now() if self._driver is not None else 0.0
                ready = now if waited else now + self.config.lora_load_s
                rank.engine.adapter_loading(ref.name, ready)
            for name in result.evicted:
                self.adapter_unloaded(name)
        return result

    def adapter_unloaded(self, name: str) -> None:
        """``name`` was unloaded (or evicted): every rank forgets its weights."""
        for rank in self.dp.ranks:
            rank.engine.adapter_unloaded(name)

    def _adapter(self, body: dict[str, Any]) -> str | None:
        """The request's adapter, SGLang's way (``serving_base._resolve_lora_path``): the
        adapter of ``model: "base:adapter"`` first (a model equal to the served name, or
        nothing after the colon, names none), else ``lora_path`` (a batch's list: its
        first adapter)."""
        model = body.get("model")
        if isinstance(model, str) and ":" in model and model != self.model:
            prefix = f"{self.model}:"
            rest = model[len(prefix) :] if model.startswith(prefix) else model.split(":", 1)[1]
            if rest.strip():
                return rest.strip()
        lora = body.get("lora_path")
        if isinstance(lora, list):
            lora = next((a for a in lora if a), None)
        return lora if isinstance(lora, str) and lora else None

    def _namespace(self, body: dict[str, Any]) -> str:
        lora = self._adapter(body)
        extra, salt = body.get("extra_key"), body.get("cache_salt")
        parts = [str(lora or ""), str(extra or ""), str(salt or "")]
        return "\x1f".join(parts) if any(parts) else ""

    @staticmethod
    def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
        value = body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise api.wrong_type(name, "integer", value)
        if not 0 <= value < _MAX_INT:
            raise ApiError(400, api.error_object(f"{name} must be >= 0", "BadRequest", 400))
        return int(value)

    @staticmethod
    def _token_ids(name: str, value: Any) -> list[int]:
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value
        ):
            raise api.wrong_type(name, "list of token ids", value)
        return value
