"""Configuration of a simulated worker (one per fleet; every worker gets the same)."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from simulator.faults import Faults
from simulator.model.disagg import check_disaggregation
from simulator.model.hicache import HiCacheSettings, check_hicache, host_pool_tokens
from simulator.model.lora import parse_lora_spec
from simulator.model.profiles import DEFAULT_PROFILE, Profile, get_profile
from simulator.model.transfer import DEFAULT_HOST_LINK, DEFAULT_TRANSFER_PROFILE, get_host_link

SGLANG_VERSION = "0.5.23"
ENGINES = ("sglang", "llamacpp")


@dataclass
class SimConfig:
    """Every knob of a simulated worker; all optional.

    ``capacity_tokens`` and ``context_length`` default to the values of the gateway team's
    contract; ``None`` takes the profile's. ``speed`` scales modelled time: 10 runs the
    model ten times faster than real time (reported latencies stay in modelled seconds).
    """

    # the personality: "sglang" (radix cache, SGLang's API) or "llamacpp" (llama.cpp's
    # server: ``slots`` slots of context_length / slots tokens each, no shared KV)
    engine: str = "sglang"
    slots: int = 2  # llama.cpp's n_parallel (llamacpp only)
    capacity_tokens: int | None = 420_000
    speed: float = 1.0
    profile: str = DEFAULT_PROFILE
    page_size: int = 1
    enable_metrics: bool = True
    enable_cache_report: bool = True
    seed: int = 0
    model_path: str = "sim-model"
    served_model_name: str | None = None
    legacy_get_load: bool = False
    max_running_requests: int | None = None
    context_length: int | None = 131_072
    schedule_policy: str = "fcfs"
    api_key: str | None = None
    # the length at which the "model" emits EOS when the request sets no token limit
    natural_output_tokens: int = 128
    health_check_timeout_s: float = 20.0
    faults: Faults = field(default_factory=Faults)
    # SGLang's --kv-events-config JSON (None: no events); worker i adds i to its ports
    kv_events_config: str | None = None
    # publish the <=0.5.18 tagged-array event encoding instead of 0.5.23's tagged maps
    kv_events_legacy_array: bool = False
    # a real model's tokenizer directory (tokenizer.json, tokenizer_config.json), used
    # through transformers as SGLang uses it; None: the arithmetic pseudo-English one
    tokenizer_path: str | None = None
    chat_template: str | None = None  # a template file overriding the directory's
    # LoRA (SGLang's --enable-lora, --lora-paths, --max-loras-per-batch,
    # --max-loaded-loras): adapters are names (no weights are read); given paths turn
    # LoRA on as in SGLang. Each spec: NAME=PATH, PATH (its own name) or
    # {"lora_name", "lora_path", "pinned"} JSON.
    enable_lora: bool | None = None
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    # modelled seconds to load one adapter's weights (an explicit load or SGLang's
    # implicit reload of an evicted one); not a measured figure: a rank-16 adapter of an
    # 8B model is ~80 MB, a disk read and a host-to-device copy
    lora_load_s: float = 0.2
    # SGLang's --dp-size: data-parallel ranks behind one HTTP server, each a whole
    # replica (its own radix cache of capacity_tokens, queues and scheduler)
    dp_size: int = 1
    # prefill/decode disaggregation (docs/PD.md): SGLang's --disaggregation-mode,
    # --disaggregation-bootstrap-port (a prefill's bootstrap server; worker i of a fleet on
    # port + i; 0: ephemeral) and --disaggregation-transfer-backend; the simulator's link
    # (simulator.model.transfer) and SGLang's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT and
    # SGLANG_DISAGGREGATION_WAITING_TIMEOUT, in modelled seconds
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    transfer_profile: str = DEFAULT_TRANSFER_PROFILE
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    # HiCache (simulator.model.hicache): SGLang's --enable-hierarchical-cache,
    # --hicache-ratio (None: SGLang's default 2.0), --hicache-size (GB, overrides the
    # ratio), --hicache-write-policy, --hicache-io-backend; the simulator's GPU <-> host
    # link (simulator.model.transfer.HOST_LINK_PROFILES)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float | None = None
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_link: str = DEFAULT_HOST_LINK

    def resolved_profile(self) -> Profile:
        return get_profile(self.profile)

    def resolved_hicache(self) -> HiCacheSettings | None:
        """The host tier of one worker (one DP rank), or None without HiCache."""
        if not self.enable_hierarchical_cache:
            return None
        profile = self.resolved_profile()
        capacity = self.capacity_tokens or profile.capacity_tokens
        capacity -= capacity % self.page_size
        ratio = 2.0 if self.hicache_ratio is None else self.hicache_ratio
        return HiCacheSettings(
            host_tokens=host_pool_tokens(
                capacity, self.page_size, ratio, self.hicache_size, profile.kv_bytes_per_token
            ),
            write_policy=self.hicache_write_policy,
            link=get_host_link(self.hicache_link),
            kv_bytes_per_token=profile.kv_bytes_per_token,
            io_backend=self.hicache_io_backend,
            ratio=ratio,
            size_gb=self.hicache_size,
        )

    @property
    def model_name(self) -> str:
        """What ``/v1/models`` reports: ``served_model_name``, else ``model_path``."""
        return self.served_model_name or self.model_path

    @property
    def lora_enabled(self) -> bool:
        """``--enable-lora``, or implied by ``--lora-paths`` (SGLang's
        ``check_lora_server_args``; an explicit false ignores the paths)."""
        return bool(self.lora_paths) if self.enable_lora is None else self.enable_lora

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.engine == "llamacpp":
            self._validate_llamacpp()
        if self.speed <= 0:
            raise ValueError("speed must be positive")
        if self.page_size <= 0:
            raise ValueError("page_size must be positive")
        if self.capacity_tokens is not None and self.capacity_tokens <= self.page_size:
            raise ValueError("capacity_tokens must exceed one page")
        if ":" in self.model_name:
            raise ValueError("served_model_name must not contain ':' (reserved for LoRA)")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError("schedule_policy must be 'fcfs' or 'lpm'")
        if self.dp_size < 1:
            raise ValueError("dp_size must be at least 1")
        self.resolved_profile()
        self.faults.validate()
        if self.kv_events_config is not None:
            KVEventsConfig.from_json(self.kv_events_config)
        if self.chat_template is not None and self.tokenizer_path is None:
            raise ValueError("chat_template needs tokenizer_path")
        self._validate_lora()
        if self.enable_hierarchical_cache:
            self._validate_hicache()
        check_disaggregation(
            self.disaggregation_mode,
            self.disaggregation_transfer_backend,
            self.disaggregation_bootstrap_port,
            self.transfer_profile,
            (self.bootstrap_timeout_s, self.waiting_timeout_s),
            self.engine != "sglang" or self.dp_size != 1,
        )

    def _validate_lora(self) -> None:
        """SGLang's asserts in ``check_lora_server_args`` (0.5.23), same wording."""
        if self.max_loras_per_batch <= 0:
            raise ValueError("max_loras_per_batch must be positive")
        if self.lora_load_s < 0:
            raise ValueError("lora_load_s must be >= 0")
        for spec in self.lora_paths:
            parse_lora_spec(spec)
        if self.lora_enabled and self.max_loaded_loras is not None:
            if self.max_loaded_loras < self.max_loras_per_batch:
                raise ValueError(
                    "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                    f"max_loaded_loras={self.max_loaded_loras}, "
                    f"max_loras_per_batch={self.max_loras_per_batch}"
                )
            if len(self.lora_paths) > self.max_loaded_loras:
                raise ValueError(
                    "The number of LoRA paths should not exceed max_loaded_loras. "
                    f"max_loaded_loras={self.max_loaded_loras}, lora_paths={len(self.lora_paths)}"
                )

    def _validate_hicache(self) -> None:
        check_hicache(
            self.hicache_write_policy,
            self.hicache_io_backend,
            self.hicache_ratio,
            self.hicache_size,
        )
        get_host_link(self.hicache_link)
        if self.engine != "sglang":
            raise ValueError("enable_hierarchical_cache is SGLang's; llama.cpp has no host tier")
        if self.disaggregation_mode == "decode":
            raise ValueError(
                "enable_hierarchical_cache is not simulated on a decode server (it keeps no "
                "radix cache here)"
            )

    def _validate_llamacpp(self) -> None:
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        context = self.context_length or self.resolved_profile().context_length
        if context // self.slots < 2:
            raise ValueError(
                f"context_length {context} leaves less than 2 tokens per slot "
                f"for {self.slots} slots"
            )
        if self.kv_events_config is not None:
            raise ValueError("kv_events_config is SGLang's; llama.cpp publishes no KV events")
        if self.dp_size != 1:
            raise ValueError("dp_size is SGLang's; a llama.cpp server has one set of slots")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """SGLang's ``--kv-events-config`` (``KVEventsConfig``), the fields the simulator uses.

    ``bind`` (SGLang 0.5.23): the PUB socket binds the endpoint when true, connects to it
    when false; unset, it binds a wildcard host (``*``, ``0.0.0.0``, ``::``), an
    ``ipc://``/``inproc://`` address or an endpoint spelled with ``*`` anywhere, and
    *connects* otherwise, so ``tcp://127.0.0.1:5557`` alone is a connecting publisher
    (checked against the real server: ``tests/sglang``). The replay ROUTER always binds.
    An endpoint port of ``*`` or ``0`` binds an ephemeral port (a simulator extension for
    tests; SGLang would not advertise it); the descriptor in ``/server_info`` reports the
    port actually bound.
    """

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""
    bind: bool | None = None

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the JSON string; unknown keys are ignored as pydantic would keep them."""
        raw = orjson.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("kv-events-config must be a JSON object")
        cfg = cls(
            publisher=str(raw.get("publisher", "null")),
            endpoint=str(raw.get("endpoint", "tcp://*:5557")),
            replay_endpoint=raw.get("replay_endpoint"),
            buffer_steps=int(raw.get("buffer_steps", 10_000)),
            hwm=int(raw.get("hwm", 100_000)),
            topic=str(raw.get("topic", "")),
            bind=None if raw.get("bind") is None else bool(raw["bind"]),
        )
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"unknown kv events publisher {cfg.publisher!r}")
        if cfg.buffer_steps < 1:
            raise ValueError("buffer_steps must be at least 1")
        return cfg

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"

    @property
    def binds(self) -> bool:
        """Whether the PUB socket binds (else it connects): ``bind``, or SGLang's rule."""
        if self.bind is not None:
            return self.bind
        endpoint = self.endpoint
        return (
            "*" in endpoint
            or "::" in endpoint
            or "0.0.0.0" in endpoint
            or endpoint.startswith(("ipc://", "inproc://"))
        )
