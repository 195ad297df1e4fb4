"""Typed gateway configuration: defaults with their reasons, loading, validation.

One module over 600 lines on purpose: one dataclass per YAML section, each default with
its reason, and the validation that names each key, kept side by side as
``config/gateway.yaml`` documents them (most lines are defaults and their reasons). The
syntaxes other modules share live beside it: worker specs (``workerspec``), the worker
allow-list (``allowlist``) and API key files (``keyfiles``).

Contract: a :class:`GatewayConfig` is built once at the edge (``load_config``) from a YAML
file and CLI flags (flags override the file) and is immutable afterwards. Every problem is
reported as :class:`ConfigError` naming the key (and the flag, when one exists) and what is
wrong; nothing downstream re-validates. The YAML layout mirrors the dataclasses: one
section per dataclass, one key per field (``config/gateway.yaml`` documents them all).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.config.allowlist import DEFAULT_ALLOWED, parse_entries
from gateway.config.keyfiles import read_key_file
from gateway.config.policyspec import parse_policy_spec
from gateway.config.workerspec import AUTO, KIND_NAMES, parse_worker_spec

TOKENIZER_SCHEMES = ("hf:", "python:")  # kv_events.tokenizer (gateway.exact.tokenizer)
KV_EVENTS_MODES = ("auto", "true", "false")  # kv_events.enabled
# String keys whose values include "true"/"false", so a YAML boolean is read as that word.
BOOLEAN_STRINGS = frozenset({"kv_events.enabled"})
LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "critical")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key and the problem."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # Loopback by default: exposing the gateway must be a deliberate choice.
    host: str = "127.0.0.1"
    port: int = 30000  # sglang-router's default, so clients need no change
    # Gateway processes on this host and port (SO_REUSEPORT; gateway/multiprocess.py),
    # sharing the prefix index, load and workers through Redis: more than 1 needs
    # redis.url. Each is a whole gateway with its own redis.gateway_id (<id>-<i>).
    processes: int = 1
    # When set, every API and admin request needs `Authorization: Bearer <key>`
    # (health, readiness and metrics stay open for probes and scrapes).
    api_key: str | None = None
    # Bodies are read whole before routing; 64 MiB holds a long prompt with base64 images.
    max_payload_size: int = 64 * 1024 * 1024
    # Checked in order; the first present names the request (sglang-router's list).
    request_id_headers: tuple[str, ...] = (
        "x-request-id",
        "x-correlation-id",
        "x-trace-id",
        "request-id",
    )
    log_level: str = "info"  # no per-request line is ever logged at INFO
    # One JSON object per log line (gateway.telemetry.logs) instead of plain text.
    log_json: bool = False
    # Whole-request bound for one worker attempt (sglang-router's default, 30 min):
    # long generations are legitimate; hung workers are caught by health checks.
    request_timeout_s: float = 1800.0
    # A worker that does not accept a connection within this is treated as down.
    connect_timeout_s: float = 5.0
    # Fire-and-forget `/abort_request` after a client disconnect is bounded by this.
    abort_timeout_s: float = 2.0
    # Connections kept alive per worker; sized for the concurrency one worker sustains.
    connections_per_worker: int = 256
    # --- keys, limits and timeouts (docs/SECURITY.md) -------------------------------
    # More client keys: a list, the environment variable named here (keys separated by
    # commas or spaces) and a file (one key per line). Any key from any source enables
    # keys; api_key (--api-key) is one more.
    api_keys: tuple[str, ...] = ()
    api_keys_env: str = "GATEWAY_API_KEYS"
    api_keys_file: str | None = None
    # Admin key(s) for /workers*, /add_worker, /remove_worker, /list_workers, /admin,
    # /debug/*, /dashboard*: 401 without a key, 403 with a client key. None: the admin
    # routes take the client keys (sglang-router's single key).
    admin_api_key: str | None = None
    admin_api_keys_file: str | None = None
    # The key the gateway presents to every worker as `Authorization: Bearer <key>`
    # (SGLang's --api-key) on proxied requests and on its own probes, load polls, model
    # lists and aborts; null: the environment variable named by worker_api_key_env, if
    # set. With client keys on, the client's Authorization / x-api-key never reach a
    # worker; with neither, the client's headers pass through (docs/SECURITY.md).
    worker_api_key: str | None = field(default=None, repr=False)
    worker_api_key_env: str = "GATEWAY_WORKER_API_KEY"
    # Put /health, /readiness, /liveness and /metrics behind the client keys too.
    protect_probes: bool = False
    # Hosts, addresses and CIDR blocks the admin API may register workers at (SSRF
    # guard; "*" allows any). Loopback and private ranges: a fleet on one host or one
    # private network. Link-local (cloud metadata) and public addresses are refused.
    worker_allowlist: tuple[str, ...] = DEFAULT_ALLOWED
    # Token bucket per client key (per client address without keys): requests per
    # second and burst; over it, 429 with Retry-After. 0: no rate limit.
    rate_limit_per_s: float = 0.0
    rate_limit_burst: int = 20
    # Open client connections at most; beyond, 503 with Retry-After and close. 0: no cap.
    max_connections: int = 10000
    # Every request head must be complete within this (slowloris): from the accept for a
    # connection's first request, from its first byte for later ones. 0: none.
    header_timeout_s: float = 10.0
    # Idle kept-alive client connections are closed after this (aiohttp's is an hour).
    keepalive_timeout_s: float = 75.0
    # Longest request line or header line in bytes; longer gets 400.
    max_header_size: int = 8190
    # A request body must be read whole within this; slower gets 408.
    client_body_timeout_s: float = 60.0
    # The worker's response head must arrive within this of sending, else the attempt
    # is retried on another worker and the worker penalised. A non-streaming head comes
    # at the end of its generation: keep it above the longest one. 0: request_timeout_s.
    first_byte_timeout_s: float = 0.0
    # Longest silence in a worker's body (between streamed chunks, or before the first
    # event once the head came): the stream ends with a 504 error event. 0: none.
    stream_idle_timeout_s: float = 120.0
    # A client that takes no byte of a streamed write for this is gone: the stream ends,
    # the worker is told to abort (slow readers must not hold a worker's slot). 0: none.
    client_write_timeout_s: float = 60.0
    # Largest non-streamed worker answer read whole (relayed as one body); larger: 502.
    max_response_size: int = 256 * 1024 * 1024
    # Largest single SSE event held while its end is awaited (SGLang's /generate text is
    # cumulative); larger ends the stream with a 502 error event.
    max_event_size: int = 8 * 1024 * 1024
    # On SIGTERM: stop accepting, let in-flight requests finish within this, then exit 0.
    shutdown_grace_s: float = 30.0


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    name: str = "min_ttft"  # estimated time to first token: hit rate and tail latency
    # sglang-router's cache_aware flags and CLI defaults; handed to any policy whose
    # constructor accepts them.
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # Extra constructor parameters for the chosen policy (`--policy-arg KEY=VALUE`).
    params: Mapping[str, Any] = field(default_factory=dict)
    # Seed for the policies' rng; None draws one at start. Set it for reproducible runs.
    seed: int | None = None
    # Shadow policies (`--shadow-policy NAME[:KEY=VALUE,...]`, repeatable): each scores
    # every request on the same views without routing by it; their picks go into the
    # decision record and the shadow metrics (agreement, matched tokens, estimated TTFT).
    shadows: tuple[str, ...] = ()
    # A/B split: sessions (a stable hash of the routing key, else of the prompt's first
    # block) whose hash falls in `ab_fraction` are routed by `ab_policy` (arm B), the rest
    # by `name` (arm A); per-arm figures with confidence intervals at /debug/ab.
    ab_policy: str | None = None
    ab_fraction: float = 0.0
    # Candidate shortlist of a large fleet (gateway/routing/decide.py, Shortlist): above
    # this many candidates, cache_aware and min_ttft see only the best prefix matchers,
    # the `shortlist_least_loaded` least loaded (in flight; queued prefill) and the most
    # loaded (min_ttft also its private holder and starving workers; its fleet-wide
    # figures still come from every candidate); 0 = never. Other policies see every
    # candidate. Top-level only.
    shortlist_above: int = 64
    shortlist_least_loaded: int = 16


@dataclass(frozen=True, slots=True)
class PrefixIndexConfig:
    # How often idle index entries are swept (sglang-router's default, 60 s).
    eviction_interval_s: float = 60.0
    # Bound on indexed prompt characters per worker (sglang-router's default, 64 Mi);
    # the per-worker KV capacity reported by the worker bounds it further.
    max_tree_size: int = 67108864
    # Entries untouched this long are dropped at each sweep: an engine keeps idle prefixes
    # until memory pressure, so only stale entries (e.g. a restarted worker's) should go.
    max_idle_s: float = 3600.0
    # Longest a request is held for a busy slot holding its prefix on a worker whose slots
    # share no KV (llama.cpp); 0 = never hold (gateway/routing/slot_gate.py).
    slot_wait_s: float = 2.0
    # Longest a request is held, on an SGLang worker, while a request sharing its prefix
    # is in prefill there, so that it goes after that prompt is cached and hits (fcfs
    # prefills same-step siblings together, each computing the prefix); 0 = never hold
    # (gateway/routing/prefill_gate.py). Once the worker's prefill cost is calibrated, at
    # most about the prefill time the wait saves; only while the worker's queued prefill
    # is within one batch and the wait saves at least half of what the sibling computes.
    # Live: GRPO rollouts' cached fraction .30 -> .89 with lower TTFT; neutral on a
    # shared-prefix burst and on multi-turn (BENCHMARKS.md, "Prefill gate").
    prefill_wait_s: float = 2.0
    # Per worker, the chains (ordered block lists of prompts) dispatched there lately and
    # when each was last used, so a drain can re-home them (gateway/routing/rehome.py):
    # at most this many (a conversation's turns are one), and no more blocks than twice
    # the worker's capacity. 0: none kept (drains cannot re-home).
    recent_chains: int = 1024


@dataclass(frozen=True, slots=True)
class DrainConfig:
    """Drains that keep conversations warm (POST /workers/{id}/drain; README, Drains)."""

    # Give the drained worker's recent prefixes new homes by load, recorded in the index
    # so each conversation's next turn goes there (?rehome=false on the call: not).
    rehome: bool = True
    # Only chains used within this many seconds are re-homed, and only what of each was
    # reused: all of it once its conversation came back min_uses times (a later turn
    # extended it), else the prefix it shared with an earlier prompt there.
    recent_s: float = 600.0
    min_uses: int = 2
    # ... and all of every chain when at least this share of the worker's recent chains
    # came back (a chat fleet: those on their first turn will come back too; above 1:
    # never).
    returning_share: float = 0.5
    # Pre-warm the hottest re-homed chains on their new homes within prewarm's budget
    # (?prewarm=false: not). Needs prewarm.prompt_store_bytes > 0 (off by default).
    prewarm: bool = True
    # Pre-warming stops this long after the drain began (or when the worker is removed):
    # only before the drained worker leaves.
    deadline_s: float = 120.0


@dataclass(frozen=True, slots=True)
class SlowStartConfig:
    """New workers ramp their share (Envoy's slow start; gateway/workers/slow_start.py)."""

    # A worker added at run time is kept among a decision's candidates with probability
    # max(min_factor, (elapsed / window_s) ** (1 / aggression)) over this window, unless
    # it alone holds the request's longest prefix. 0: no ramp.
    window_s: float = 0.0
    aggression: float = 1.0
    min_factor: float = 0.1
    # Pre-warm a joining worker with this many of the fleet's most shared prefixes
    # (system prompts, tool lists), within prewarm's budget; needs the prompt store.
    prewarm_prefixes: int = 4


@dataclass(frozen=True, slots=True)
class PrewarmConfig:
    """Pre-warming: prefill-only copies of stored prompts (docs/SECURITY.md)."""

    # Opt-in store of the most recent request body of each chain in prefix_index's chain
    # log, bounded in bytes (least recently stored dropped first). 0: no prompt is kept
    # and nothing is pre-warmed. Bodies are held in memory only, never logged or shown.
    prompt_store_bytes: int = 0
    # Fleet-wide budget of pre-warmed prompt tokens (those the new home is believed not
    # to hold): this many per second on average, in bursts of burst_tokens (a larger
    # prompt is never pre-warmed).
    tokens_per_s: float = 8000.0
    burst_tokens: int = 65536
    # Only chains used within this many seconds are pre-warmed.
    recent_s: float = 300.0
    # Pre-warms in flight at once per worker.
    max_in_flight: int = 2
    # Bound on one pre-warm request.
    timeout_s: float = 60.0


# Headers the ecosystem sends as a session / affinity key, lower case, the first present
# wins (each checked in its source; config/gateway.yaml and README name the files):
ROUTING_KEY_HEADERS: tuple[str, ...] = (
    "x-session-id",  # llm-d's session-affinity default; OpenCode's (read by Dynamo)
    "x-smg-routing-key",  # SGLang Model Gateway (sglang-router's successor)
    "x-dynamo-session-id",  # Dynamo's own; aiperf sends it on request
    "x-session-affinity",  # aiperf's default since PR 1312; OpenCode's (read by llm-d)
    "x-claude-code-session-id",  # Claude Code (read by Dynamo and llm-d)
    "thread-id",  # Codex's thread (read by Dynamo)
    "session-id",  # Codex >= 0.131 (read by llm-d)
    "x-deepseek-harness-session-id",  # DeepSeek's harness (read by Dynamo)
)


@dataclass(frozen=True, slots=True)
class RequestConfig:
    # The prior of characters per token, until the workers' usage.prompt_tokens teach the
    # real ratio per model and per worker (gateway.routing.tokens); 4 is typical of
    # English text with large BPE vocabularies (small or domain ones are denser).
    chars_per_token: float = 4.0
    # Prefix blocks of 64 characters, about 16 tokens: fine enough for chat turns,
    # coarse enough that a 512k-character prompt hashes in well under 2 ms.
    block_chars: int = 64
    # Headers carrying a session / routing key (lower case), checked in order.
    routing_key_headers: tuple[str, ...] = ROUTING_KEY_HEADERS
    routing_key_from_user: bool = True  # the OpenAI `user` field is a routing key too


LORA_UNLOADED = ("load", "reject")


@dataclass(frozen=True, slots=True)
class PDConfig:
    """Prefill/decode disaggregation (docs/PD.md), sglang-router's flags."""

    enabled: bool = False  # --pd-disaggregation
    # --prefill URL [BOOTSTRAP_PORT]: "URL", "URL PORT" or "URL none" (none: the port the
    # worker's /server_info tells, else null and the servers' own default)
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()  # --decode URL
    prefill_policy: str | None = None  # --prefill-policy; None: policy.name
    decode_policy: str = "least_load"  # --decode-policy: by running batch and KV use


@dataclass(frozen=True, slots=True)
class LoraConfig:
    # A request naming a LoRA adapter (model "base:adapter", or lora_path) goes only to
    # workers that have it loaded (their /v1/models cards with a parent); false: adapters
    # are ignored in candidate choice (adapter-blind, as before).
    affinity: bool = True
    # When no healthy worker has the adapter loaded: "load" asks the chosen worker
    # (LoRA-enabled, serving the base model) to POST /load_lora_adapter first, with the
    # path the adapter was last seen loaded from (SGLang answers 400 for an adapter it
    # never loaded); an adapter never seen anywhere, or "reject", gets 404 model_not_found.
    unloaded: str = "load"
    # Bound on one /load_lora_adapter call the gateway makes.
    load_timeout_s: float = 60.0
    # ["NAME=PATH", ...] (SGLang's --lora-paths syntax): what the gateway loads each
    # adapter from, whatever a worker reports (the operator's word; adapters named here
    # need not have been seen on a worker).
    paths: tuple[str, ...] = ()
    # Adapters not in `paths`: load them from the path a worker's /v1/models card (or load
    # answer) reported. A worker can name any path there, and the gateway then sends it to
    # the other workers' /load_lora_adapter: false where workers are not trusted with that.
    # A name two workers report with different paths is never loaded from either.
    paths_from_workers: bool = True
    # Load calls the gateway makes, fleet-wide: at most load_rate_per_s on average, in
    # bursts of load_burst (each load may evict an adapter others use); beyond, 503 with
    # Retry-After. 0: unbounded. 8/s: the LoRA bench's 32 adapters over 24 slots on 4
    # workers needs ~2/s, and 2/s answered 1 % of its requests 503 (BENCHMARKS.md).
    load_rate_per_s: float = 8.0
    load_burst: int = 16
    # Under a policy that weighs load time (min_ttft), offer workers lacking an adapter
    # beside its busy holders, so a hot adapter may be copied to a second worker. Off: in
    # the offline replay it raised p90 TTFT at 3x the LoRA bench's rate (the copy's load
    # and the adapters it evicts cost more than the queue it saved; BENCHMARKS.md).
    replicate: bool = False


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = 5.0  # a dead worker is flagged within interval x failure_threshold
    timeout_s: float = 2.0  # SGLang's /health runs a 1-token generation: allow ≥ 1 s
    failure_threshold: int = 3  # consecutive failed probes before flagging (sglang-router's)
    success_threshold: int = 2  # consecutive passed probes before clearing (sglang-router's)
    # `/health` generates one token; `/ping` is a cheap flag check on SGLang 0.5.23.
    endpoint: str = "/health"


@dataclass(frozen=True, slots=True)
class LoadConfig:
    # Engine load polled from /v1/loads (else /get_load, then /metrics); 0 disables.
    # 1 s keeps queue figures fresh at negligible cost (one small GET per worker).
    poll_interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    # A refused or failed connection means nothing serves there: eject at once.
    consecutive_connect_errors: int = 1
    consecutive_5xx: int = 5  # Envoy's default for gateway failures
    base_ejection_s: float = 10.0  # ejection lasts base x times ejected ...
    max_ejection_s: float = 300.0  # ... up to this; the count resets after this much calm
    # At most this share of workers ejected at once (at least one is always allowed).
    max_ejected_share: float = 0.5
    # Below this share of healthy workers, route to every non-draining worker (panic):
    # better to try all than to refuse all when health signals themselves are failing.
    panic_threshold: float = 0.5


@dataclass(frozen=True, slots=True)
class RetryConfig:
    # Further attempts after the first, each on a different worker, and only before any
    # byte reached the client.
    max_retries: int = 3


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    # Requests proxied at once; 0 (or -1, sglang-router's spelling) means unlimited.
    max_concurrent_requests: int = 0
    queue_size: int = 100  # waiting requests beyond the limit; more get 429
    queue_timeout_s: float = 60.0  # a waiting request gets 503 after this


@dataclass(frozen=True, slots=True)
class DecisionsConfig:
    # Routing decisions kept in memory for /debug and telemetry (bounded ring).
    ring_size: int = 1024


@dataclass(frozen=True, slots=True)
class TelemetryConfig:
    # Prometheus metrics at /metrics; off makes the request path free of metric updates.
    metrics: bool = True
    # Request spans: none, console or otlp (needs the OTLP exporter package).
    tracing_exporter: str = "none"
    tracing_sampling_ratio: float = 1.0  # share of requests traced, 0..1
    tracing_service_name: str = "prefix-gateway"
    # None: the exporter's default (or the OTEL_EXPORTER_OTLP_* environment variables).
    otlp_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Exact mode from SGLang KV events (gateway.exact.manager, docs/KV_EVENTS.md)."""

    # Exact mode: follow the KV events of workers whose /server_info advertises them.
    # "auto" (default): wherever a worker advertises events and a tokenizer is configured
    # for its model (and its packages import); every other worker stays approximate, with
    # the reason shown per worker (/workers, dashboard, one log line). "true": as auto,
    # but a missing or unloadable tokenizer is a start-up error. "false": never.
    enabled: str = "auto"
    # How prompts become the worker's token ids: "hf:<dir>" (tokenizer.json + chat template
    # from a local directory, never downloaded) or "python:<module>:<factory>" (a tokenizer
    # object built by that callable, e.g. the simulator's for tests). The default for every
    # model; a tokenizer the workers do not use would make every exact match wrong.
    tokenizer: str = ""
    # A chat template file overriding the default tokenizer's own (like SGLang's
    # --chat-template); "" keeps tokenizer_config.json's / chat_template.jinja.
    chat_template: str = ""
    # Per model: {model name: "hf:<dir>" | "python:..."}, matched against every name a
    # worker serves under (served_model_name, model path); models absent here use
    # `tokenizer`.
    tokenizers: Mapping[str, str] = field(default_factory=dict)
    # Per model: a chat template file for its "hf:<dir>" tokenizer in `tokenizers` (as
    # `chat_template` is for `tokenizer`). `models.<name>.tokenizer` and `.chat_template`
    # are folded into these two tables when the config is built (config_from_dict).
    chat_templates: Mapping[str, str] = field(default_factory=dict)
    # A worker whose model has no tokenizer above: use the one its /server_info names
    # (tokenizer_path, and chat_template if set), when that is an absolute local
    # directory with a tokenizer.json (a gateway beside its workers, or shared model
    # storage); read locally, never downloaded.
    tokenizer_from_workers: bool = True
    # Exact mode's tokenizing is bounded per request (a body over 4 KiB is tokenized in
    # a thread, off the event loop, but costs CPU all the same): a body larger than this
    # many bytes is not tokenized (routed by the approximate index, like an unfollowed
    # worker); 0 tokenizes none. ~0.6 s of BPE for 1 MiB of text.
    max_tokenize_bytes: int = 1 << 20
    # CPU bound of one chat-template render (a template may be quadratic or worse in the
    # conversation: Gemma 4's takes 95 s for 4,000 short messages); beyond it the request
    # gets no exact hit.
    max_render_s: float = 0.1
    # A request dispatched to an exact-mode worker not followed by any event within this
    # makes the worker `degraded` (routing falls back to the approximate index).
    stale_timeout_s: float = 5.0
    # Bound on one replay request to fill a sequence gap.
    replay_timeout_s: float = 1.0
    # Re-read of /server_info: new workers, restarts (a new startup_time).
    discovery_interval_s: float = 2.0
    # Keep blocks predicted at dispatch beside the exact ones until an event confirms them.
    hybrid: bool = True
    # Predicted-entry TTL = ttl_factor x the observed dispatch -> event delay, clamped.
    ttl_factor: float = 3.0
    ttl_min_s: float = 0.2
    ttl_max_s: float = 10.0


@dataclass(frozen=True, slots=True)
class RedisConfig:
    # Shared state across gateways (docs/SHARED_STATE.md); None keeps everything in
    # memory. redis://[[user]:password@]host:port/db, rediss:// (TLS) or unix:///path.
    url: str | None = None
    # Key isolation: gateways share state iff they use the same URL and prefix.
    prefix: str = "prefix-gateway"
    # Environment variable holding the password when the URL carries none.
    password_env: str = "GATEWAY_REDIS_PASSWORD"
    gateway_id: str | None = None  # this gateway's name in Redis; None: random per process
    # Publish/read period: replication lag is about a tick plus a round trip.
    tick_s: float = 0.1
    # A gateway that stops publishing leaves the shared load after this.
    load_ttl_s: float = 1.0
    stream_maxlen: int = 100_000  # stream entries kept (each up to 512 recordings)
    snapshot_interval_s: float = 30.0  # whole-index snapshot for catch-up after trimming
    queue_size: int = 20_000  # pending recordings; beyond it new ones are dropped, counted
    timeout_s: float = 0.5  # per round trip; slower counts as down (degraded mode)
    backoff_max_s: float = 5.0  # reconnect back-off cap (from 0.1 s, doubling)


@dataclass(frozen=True, slots=True)
class ModelPolicyConfig:
    """A model's own policy (``models.<name>.policy``): the top-level section's name,
    parameters and cache_aware flags, with the same defaults (not the top-level values).
    Shadows, A/B arms and the seed stay top-level."""

    name: str = "min_ttft"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    params: Mapping[str, Any] = field(default_factory=dict)

    def as_policy(self) -> PolicyConfig:
        """The equivalent top-level section (what the policy factory takes)."""
        return PolicyConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Settings of the requests for one model (``models.<name>``), keyed by a name its
    workers serve under (served_model_name, model path: what ``Worker.serves`` matches).
    Every key is optional; what is unset is the top-level one."""

    # Its own policy set (gateway.routing.decide.RoutingCore.policies_for); None: `policy`.
    policy: ModelPolicyConfig | None = None
    # server.request_timeout_s and server.first_byte_timeout_s for its requests; None:
    # the server's. first_byte_timeout_s 0: none for this model.
    request_timeout_s: float | None = None
    first_byte_timeout_s: float | None = None
    # Exact mode's tokenizer and chat template for this model: folded into
    # kv_events.tokenizers / kv_events.chat_templates (one table decides: exact.choice).
    tokenizer: str = ""
    chat_template: str = ""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    workers: tuple[str, ...] = ()  # worker URLs registered at start, each may end in #kind
    # Kind of a worker whose URL names none: sglang, llamacpp, vllm, openai, or auto
    # (discovered from what it answers; gateway.workers.kinds).
    worker_kind: str = "auto"
    # Route to each data-parallel rank of an SGLang worker with dp_size > 1 (its own radix
    # cache and load; the body gets the rank); false: the worker is one target and SGLang
    # spreads requests over its ranks itself.
    dp_aware: bool = True
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # Per model (a name its workers serve under): policy, timeouts, tokenizer.
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    prefix_index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    drain: DrainConfig = field(default_factory=DrainConfig)
    slow_start: SlowStartConfig = field(default_factory=SlowStartConfig)
    prewarm: PrewarmConfig = field(default_factory=PrewarmConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    request: RequestConfig = field(default_factory=RequestConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    pd: PDConfig = field(default_factory=PDConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    decisions: DecisionsConfig = field(default_factory=DecisionsConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)


# --- URL validation (shared with the admin API) -------------------------------------


def validate_worker_url(url: object) -> str:
    """Return the URL normalised (no trailing slash) or raise ValueError saying why."""
    if not isinstance(url, str) or not url:
        raise ValueError("a worker URL must be a non-empty string")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"worker URL {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"worker URL {url!r} has no host")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"worker URL {url!r} has an invalid port") from None
    if port is None:
        raise ValueError(f"worker URL {url!r} needs an explicit port")
    try:
        parts.hostname.encode("idna")
    except UnicodeError:
        raise ValueError(f"worker URL {url!r} has an invalid host name") from None
    if parts.query or parts.fragment:
        raise ValueError(f"worker URL {url!r} must not carry a query or fragment")
    if parts.username is not None or parts.password is not None:
        # it would reach the Host header and every client's x-gateway-worker; workers
        # take a key (server.worker_api_key), not credentials in the URL
        raise ValueError("a worker URL must not carry credentials (user:password@)")
    return url.strip().rstrip("/")


# --- building from plain data -------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ConfigError names ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if dataclasses.is_dataclass(tp):  # a section inside a mapping (models.<name>.policy)
        return _build(tp, {} if value is None else value, f"{key}.")  # type: ignore[arg-type]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool) and key in BOOLEAN_STRINGS:  # `enabled: true` in YAML
            return "true" if value else "false"
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, Sequence):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, str) for i, v in enumerate(value))
    if origin in (Mapping, dict) or tp is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):  # models: {name: section}
            return {str(k): _coerce(f"{key}.{k}", v, args[1]) for k, v in value.items()}
        return {str(k): v for k, v in value.items()}
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")  # pragma: no cover


def _build(cls: type[Any], data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(
                f"{prefix}{key}: unknown key; known keys here: {', '.join(sorted(names))}"
            )
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name] or {}, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            kwargs[f.name] = _coerce(prefix + f.name, data[f.name], tp)
    return cls(**kwargs)


def _check(ok: bool, key: str, problem: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}, got {value!r}")


def validate(cfg: GatewayConfig) -> None:
    """Cross-field and range checks; raises ConfigError naming the key."""
    _validate_server(cfg.server)
    _validate_timeouts(cfg)
    _validate_workers(cfg)
    _validate_policy(cfg.policy)
    _validate_models(cfg)
    _validate_kv_events(cfg.kv_events)
    _validate_sections(cfg)
    _validate_outlier(cfg.outlier)
    _validate_redis(cfg.redis)
    _validate_pd(cfg)
    _validate_processes(cfg)
    _validate_membership(cfg)


def _validate_membership(cfg: GatewayConfig) -> None:
    d, s, p = cfg.drain, cfg.slow_start, cfg.prewarm
    for key, value in (
        ("drain.recent_s", d.recent_s),
        ("drain.deadline_s", d.deadline_s),
        ("slow_start.aggression", s.aggression),
        ("prewarm.tokens_per_s", p.tokens_per_s),
        ("prewarm.recent_s", p.recent_s),
        ("prewarm.timeout_s", p.timeout_s),
    ):
        _check(value > 0, key, "must be > 0", value)
    for key, value in (
        ("prefix_index.recent_chains", cfg.prefix_index.recent_chains),
        ("drain.min_uses", d.min_uses),
        ("slow_start.window_s", s.window_s),
        ("slow_start.prewarm_prefixes", s.prewarm_prefixes),
        ("prewarm.prompt_store_bytes", p.prompt_store_bytes),
    ):
        _check(value >= 0, key, "must be ≥ 0 (0: off)", value)
    _check(0 <= s.min_factor <= 1, "slow_start.min_factor", "must be in 0..1", s.min_factor)
    _check(
        d.returning_share >= 0, "drain.returning_share", "must be ≥ 0 (above 1: never)",
        d.returning_share,
    )  # fmt: skip
    _check(p.burst_tokens >= 1, "prewarm.burst_tokens", "must be ≥ 1", p.burst_tokens)
    _check(p.max_in_flight >= 1, "prewarm.max_in_flight", "must be ≥ 1", p.max_in_flight)


def _validate_server(s: ServerConfig) -> None:
    _check(1 <= s.port <= 65535, "server.port", "must be in 1..65535", s.port)
    _check(bool(s.host), "server.host", "must not be empty", s.host)
    _check(s.max_payload_size > 0, "server.max_payload_size", "must be > 0", s.max_payload_size)
    for key, size in (
        ("server.max_response_size", s.max_response_size),
        ("server.max_event_size", s.max_event_size),
    ):
        _check(size >= 1024, key, "must be ≥ 1024", size)
    _check(
        s.log_level.lower() in LOG_LEVELS,
        "server.log_level",
        f"must be one of {', '.join(LOG_LEVELS)}",
        s.log_level,
    )
    _check(
        len(s.request_id_headers) > 0,
        "server.request_id_headers",
        "must not be empty",
        s.request_id_headers,
    )
    _check(
        s.connections_per_worker >= 1,
        "server.connections_per_worker",
        "must be ≥ 1",
        s.connections_per_worker,
    )
    if s.api_key is not None:
        _check(bool(s.api_key), "server.api_key", "must not be empty when set", s.api_key)
    _validate_security(s)


def _validate_timeouts(cfg: GatewayConfig) -> None:
    s = cfg.server
    for key, value in (
        ("server.request_timeout_s", s.request_timeout_s),
        ("server.connect_timeout_s", s.connect_timeout_s),
        ("server.abort_timeout_s", s.abort_timeout_s),
        ("health.interval_s", cfg.health.interval_s),
        ("health.timeout_s", cfg.health.timeout_s),
        ("prefix_index.eviction_interval_s", cfg.prefix_index.eviction_interval_s),
        ("prefix_index.max_idle_s", cfg.prefix_index.max_idle_s),
        ("request.chars_per_token", cfg.request.chars_per_token),
        ("outlier.base_ejection_s", cfg.outlier.base_ejection_s),
        ("outlier.max_ejection_s", cfg.outlier.max_ejection_s),
        ("admission.queue_timeout_s", cfg.admission.queue_timeout_s),
        ("lora.load_timeout_s", cfg.lora.load_timeout_s),
    ):
        _check(value > 0, key, "must be > 0", value)


def _validate_workers(cfg: GatewayConfig) -> None:
    for i, spec in enumerate(cfg.workers):
        try:
            validate_worker_url(parse_worker_spec(spec)[0])
        except ValueError as exc:
            raise ConfigError(f"workers[{i}]: {exc}") from None
    _check(
        cfg.worker_kind in (AUTO, *KIND_NAMES),
        "worker_kind",
        f"must be one of {AUTO}, {', '.join(KIND_NAMES)}",
        cfg.worker_kind,
    )
    _check(
        cfg.prefix_index.slot_wait_s >= 0,
        "prefix_index.slot_wait_s",
        "must be ≥ 0",
        cfg.prefix_index.slot_wait_s,
    )
    _check(
        cfg.prefix_index.prefill_wait_s >= 0,
        "prefix_index.prefill_wait_s",
        "must be ≥ 0",
        cfg.prefix_index.prefill_wait_s,
    )


def _validate_sections(cfg: GatewayConfig) -> None:
    h = cfg.health
    _check(h.endpoint.startswith("/"), "health.endpoint", "must start with '/'", h.endpoint)
    _check(h.failure_threshold >= 1, "health.failure_threshold", "must be ≥ 1", h.failure_threshold)
    _check(h.success_threshold >= 1, "health.success_threshold", "must be ≥ 1", h.success_threshold)
    _check(
        cfg.load.poll_interval_s >= 0,
        "load.poll_interval_s",
        "must be ≥ 0 (0 disables)",
        cfg.load.poll_interval_s,
    )
    _check(
        cfg.prefix_index.max_tree_size > 0,
        "prefix_index.max_tree_size",
        "must be > 0",
        cfg.prefix_index.max_tree_size,
    )
    _check(
        cfg.request.block_chars >= 1, "request.block_chars", "must be ≥ 1", cfg.request.block_chars
    )
    _check(
        cfg.lora.load_rate_per_s >= 0,
        "lora.load_rate_per_s",
        "must be ≥ 0",
        cfg.lora.load_rate_per_s,
    )
    _check(cfg.lora.load_burst >= 1, "lora.load_burst", "must be ≥ 1", cfg.lora.load_burst)
    for entry in cfg.lora.paths:
        name, _, path = entry.partition("=")
        _check(bool(name) and bool(path), "lora.paths", "entries must be NAME=PATH", entry)
    _check(
        cfg.lora.unloaded in LORA_UNLOADED,
        "lora.unloaded",
        f"must be one of {', '.join(LORA_UNLOADED)}",
        cfg.lora.unloaded,
    )
    _check(cfg.retry.max_retries >= 0, "retry.max_retries", "must be ≥ 0", cfg.retry.max_retries)
    a = cfg.admission
    _check(
        a.max_concurrent_requests >= -1,
        "admission.max_concurrent_requests",
        "must be ≥ 0 (0 or -1: unlimited)",
        a.max_concurrent_requests,
    )
    _check(a.queue_size >= 0, "admission.queue_size", "must be ≥ 0", a.queue_size)
    t = cfg.telemetry
    _check(
        t.tracing_exporter in ("none", "console", "otlp"),
        "telemetry.tracing_exporter",
        "must be one of none, console, otlp",
        t.tracing_exporter,
    )
    _check(
        0.0 <= t.tracing_sampling_ratio <= 1.0,
        "telemetry.tracing_sampling_ratio",
        "must be in 0..1",
        t.tracing_sampling_ratio,
    )
    _check(
        cfg.decisions.ring_size >= 1, "decisions.ring_size", "must be ≥ 1", cfg.decisions.ring_size
    )


def _validate_security(s: ServerConfig) -> None:
    try:
        parse_entries(s.worker_allowlist)
    except ValueError as exc:
        raise ConfigError(f"server.worker_allowlist: {exc}") from None
    for key, path in (
        ("server.api_keys_file", s.api_keys_file),
        ("server.admin_api_keys_file", s.admin_api_keys_file),
    ):
        if path is not None:
            try:
                read_key_file(path)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc}") from None
    for key, secret in (
        ("server.admin_api_key", s.admin_api_key),
        ("server.worker_api_key", s.worker_api_key),
    ):
        if secret is not None:  # the value is never echoed
            _check(bool(secret.strip()), key, "must not be empty when set", "")
    for key, value in (
        ("server.rate_limit_per_s", s.rate_limit_per_s),
        ("server.header_timeout_s", s.header_timeout_s),
        ("server.first_byte_timeout_s", s.first_byte_timeout_s),
        ("server.stream_idle_timeout_s", s.stream_idle_timeout_s),
        ("server.client_write_timeout_s", s.client_write_timeout_s),
        ("server.max_connections", s.max_connections),
    ):
        _check(value >= 0, key, "must be ≥ 0 (0: off)", value)
    for key, value in (
        ("server.keepalive_timeout_s", s.keepalive_timeout_s),
        ("server.client_body_timeout_s", s.client_body_timeout_s),
        ("server.shutdown_grace_s", s.shutdown_grace_s),
    ):
        _check(value > 0, key, "must be > 0", value)
    _check(s.rate_limit_burst >= 1, "server.rate_limit_burst", "must be ≥ 1", s.rate_limit_burst)
    _check(s.max_header_size >= 256, "server.max_header_size", "must be ≥ 256", s.max_header_size)


def parse_prefill_spec(spec: str) -> tuple[str, int | None]:
    """``"URL"``, ``"URL PORT"`` or ``"URL none"`` → (URL, bootstrap port or None);
    ValueError saying why (sglang-router's rule: a port in 1..65535, or none)."""
    parts = spec.split()
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"expected URL [BOOTSTRAP_PORT], got {spec!r}")
    url = validate_worker_url(parts[0])
    if len(parts) == 1 or parts[1].lower() == "none":
        return url, None
    port = parts[1]
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"bootstrap port must be 1..65535 or none, got {port!r}")
    return url, int(port)


def _validate_pd(cfg: GatewayConfig) -> None:
    pd = cfg.pd
    if not pd.enabled:
        for key, value in (("pd.prefill", pd.prefill), ("pd.decode", pd.decode)):
            _check(not value, key, "needs pd.enabled (--pd-disaggregation)", list(value))
        return
    _check(bool(pd.prefill), "pd.prefill", "PD mode needs at least one prefill worker", [])
    _check(bool(pd.decode), "pd.decode", "PD mode needs at least one decode worker", [])
    _check(
        not cfg.workers,
        "workers",
        "in PD mode every worker is --prefill or --decode, not --worker-urls",
        list(cfg.workers),
    )
    _check(
        cfg.redis.url is None,
        "redis.url",
        "shared state does not carry worker roles yet: not with pd.enabled",
        cfg.redis.url,
    )
    seen: dict[str, str] = {}
    for key, specs in (("pd.prefill", pd.prefill), ("pd.decode", pd.decode)):
        for i, spec in enumerate(specs):
            try:
                if key == "pd.prefill":
                    url, _ = parse_prefill_spec(spec)
                else:
                    url = validate_worker_url(spec.strip())
            except ValueError as exc:
                raise ConfigError(f"{key}[{i}]: {exc}") from None
            _check(url not in seen, f"{key}[{i}]", f"already listed in {seen.get(url)}", url)
            seen[url] = key
    from policies.registry import policy_names

    names = policy_names()
    for key, name in (
        ("pd.prefill_policy", pd.prefill_policy),
        ("pd.decode_policy", pd.decode_policy),
    ):
        _check(
            name is None or name in names,
            key,
            f"unknown policy; choose one of {', '.join(names)}",
            name,
        )


def _validate_processes(cfg: GatewayConfig) -> None:
    n = cfg.server.processes
    _check(1 <= n <= 64, "server.processes", "must be in 1..64", n)
    if n == 1:
        return
    _check(
        not cfg.pd.enabled,
        "server.processes",
        "PD mode runs in one process (worker roles are not shared through Redis yet)",
        n,
    )
    _check(
        cfg.redis.url is not None,
        "server.processes",
        "processes share the prefix index, load and workers through Redis: "
        "set redis.url (--redis-url)",
        n,
    )


def _validate_policy(p: PolicyConfig, where: str = "policy") -> None:
    # Imported here: policies are pure and cheap, but config must not fix their table.
    from policies.registry import policy_names

    names = policy_names()
    _check(
        p.name in names,
        f"{where}.name",
        f"unknown policy; choose one of {', '.join(names)}",
        p.name,
    )
    _check(
        0.0 <= p.cache_threshold <= 1.0,
        f"{where}.cache_threshold",
        "must be in 0..1",
        p.cache_threshold,
    )
    _check(
        p.balance_abs_threshold >= 0,
        f"{where}.balance_abs_threshold",
        "must be ≥ 0",
        p.balance_abs_threshold,
    )
    _check(
        p.balance_rel_threshold >= 1.0,
        f"{where}.balance_rel_threshold",
        "must be ≥ 1",
        p.balance_rel_threshold,
    )
    for key, spec in [*((f"{where}.shadows[{i}]", s) for i, s in enumerate(p.shadows)),
                      *([(f"{where}.ab_policy", p.ab_policy)] if p.ab_policy else [])]:  # fmt: skip
        try:
            name, _ = parse_policy_spec(spec)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None
        _check(name in names, key, f"unknown policy; choose one of {', '.join(names)}", spec)
    _check(0.0 <= p.ab_fraction <= 1.0, f"{where}.ab_fraction", "must be in 0..1", p.ab_fraction)
    _check(p.shortlist_above >= 0, f"{where}.shortlist_above", "must be ≥ 0", p.shortlist_above)
    _check(
        p.shortlist_least_loaded >= 1,
        f"{where}.shortlist_least_loaded",
        "must be ≥ 1",
        p.shortlist_least_loaded,
    )
    _check(
        p.ab_fraction == 0.0 or p.ab_policy is not None,
        f"{where}.ab_fraction",
        f"needs {where}.ab_policy",
        p.ab_fraction,
    )


def _validate_redis(r: RedisConfig) -> None:
    # The URL may carry a password: never echo it in the message.
    if r.url is not None and urlsplit(r.url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError("redis.url: must start with redis://, rediss:// or unix://")
    _check(
        bool(r.prefix) and "{" not in r.prefix and "}" not in r.prefix,
        "redis.prefix",
        "must be non-empty and free of braces",
        r.prefix,
    )
    for key, value in (
        ("redis.tick_s", r.tick_s),
        ("redis.snapshot_interval_s", r.snapshot_interval_s),
        ("redis.timeout_s", r.timeout_s),
        ("redis.backoff_max_s", r.backoff_max_s),
    ):
        _check(value > 0, key, "must be > 0", value)
    _check(r.load_ttl_s > r.tick_s, "redis.load_ttl_s", "must exceed redis.tick_s", r.load_ttl_s)
    _check(r.stream_maxlen >= 1, "redis.stream_maxlen", "must be ≥ 1", r.stream_maxlen)
    _check(r.queue_size >= 1, "redis.queue_size", "must be ≥ 1", r.queue_size)


def _validate_outlier(o: OutlierConfig) -> None:
    _check(
        o.consecutive_connect_errors >= 1,
        "outlier.consecutive_connect_errors",
        "must be ≥ 1",
        o.consecutive_connect_errors,
    )
    _check(o.consecutive_5xx >= 1, "outlier.consecutive_5xx", "must be ≥ 1", o.consecutive_5xx)
    _check(
        o.max_ejection_s >= o.base_ejection_s,
        "outlier.max_ejection_s",
        "must be ≥ outlier.base_ejection_s",
        o.max_ejection_s,
    )
    _check(
        0.0 <= o.max_ejected_share <= 1.0,
        "outlier.max_ejected_share",
        "must be in 0..1",
        o.max_ejected_share,
    )
    _check(
        0.0 <= o.panic_threshold <= 1.0,
        "outlier.panic_threshold",
        "must be in 0..1",
        o.panic_threshold,
    )


def _validate_kv_events(k: KVEventsConfig) -> None:
    for key, value in (
        ("kv_events.stale_timeout_s", k.stale_timeout_s),
        ("kv_events.replay_timeout_s", k.replay_timeout_s),
        ("kv_events.discovery_interval_s", k.discovery_interval_s),
        ("kv_events.ttl_factor", k.ttl_factor),
        ("kv_events.max_render_s", k.max_render_s),
    ):
        _check(value > 0, key, "must be > 0", value)
    _check(
        k.max_tokenize_bytes >= 0,
        "kv_events.max_tokenize_bytes",
        "must be >= 0",
        k.max_tokenize_bytes,
    )
    _check(
        0 <= k.ttl_min_s <= k.ttl_max_s,
        "kv_events.ttl_min_s",
        "must be in 0..ttl_max_s",
        k.ttl_min_s,
    )
    _check(
        k.enabled in KV_EVENTS_MODES,
        "kv_events.enabled",
        f"must be one of {', '.join(KV_EVENTS_MODES)}",
        k.enabled,
    )
    specs = [("kv_events.tokenizer", k.tokenizer)]
    specs += [(f"kv_events.tokenizers.{m}", v) for m, v in k.tokenizers.items()]
    for key, spec in specs:
        _check_tokenizer(key, spec)
    _check(
        k.enabled != "true" or bool(k.tokenizer) or bool(k.tokenizers),
        "kv_events.tokenizer",
        "must name the workers' tokenizer when kv_events.enabled is true",
        k.tokenizer,
    )
    _check_template("kv_events.chat_template", k.chat_template, k.tokenizer, "kv_events.tokenizer")
    for m, template in k.chat_templates.items():
        key, tokenizer = f"kv_events.chat_templates.{m}", k.tokenizers.get(m, "")
        _check_template(key, template, tokenizer, f"kv_events.tokenizers.{m}")


def _check_tokenizer(key: str, spec: object) -> None:
    _check(
        isinstance(spec, str) and (spec == "" or spec.startswith(TOKENIZER_SCHEMES)),
        key,
        "must be 'hf:<directory>' or 'python:<module>:<factory>'",
        spec,
    )


def _check_template(key: str, template: object, tokenizer: str, tokenizer_key: str) -> None:
    """A chat template file for the ``hf:`` tokenizer ``tokenizer`` (named by
    ``tokenizer_key``)."""
    _check(isinstance(template, str), key, "expected a file name", template)
    assert isinstance(template, str)
    _check(not template or Path(template).is_file(), key, "must be a readable file", template)
    _check(
        not template or tokenizer.startswith("hf:"),
        key,
        f"applies to an hf:<directory> tokenizer ({tokenizer_key})",
        template,
    )


# --- models: per-model settings -----------------------------------------------------


def _validate_models(cfg: GatewayConfig) -> None:
    for name, m in cfg.models.items():
        where = f"models.{name}"
        _check(bool(name.strip()), where, "a model name must not be empty", name)
        if m.policy is not None:
            _validate_policy(m.policy.as_policy(), f"{where}.policy")
        _check(
            m.request_timeout_s is None or m.request_timeout_s > 0,
            f"{where}.request_timeout_s",
            "must be > 0 (null: server.request_timeout_s)",
            m.request_timeout_s,
        )
        _check(
            m.first_byte_timeout_s is None or m.first_byte_timeout_s >= 0,
            f"{where}.first_byte_timeout_s",
            "must be ≥ 0 (0: off; null: server.first_byte_timeout_s)",
            m.first_byte_timeout_s,
        )


def with_model_tokenizers(cfg: GatewayConfig) -> GatewayConfig:
    """``models.<name>.tokenizer`` / ``.chat_template`` folded into
    ``kv_events.tokenizers`` / ``kv_events.chat_templates`` (exact mode reads only those);
    ConfigError names the ``models`` key that is malformed or contradicts them."""
    k = cfg.kv_events
    tokenizers, templates = dict(k.tokenizers), dict(k.chat_templates)
    for name, m in cfg.models.items():
        where = f"models.{name}"
        _check_tokenizer(f"{where}.tokenizer", m.tokenizer)
        for key, value, table, other in (
            ("tokenizer", m.tokenizer, tokenizers, "kv_events.tokenizers"),
            ("chat_template", m.chat_template, templates, "kv_events.chat_templates"),
        ):
            _check(
                not value or table.get(name, value) == value,
                f"{where}.{key}",
                f"differs from {other}.{name} ({table.get(name)!r})",
                value,
            )
            if value:
                table[name] = value
        tokenizer_key = f"{where}.tokenizer" if m.tokenizer else f"kv_events.tokenizers.{name}"
        _check_template(
            f"{where}.chat_template", m.chat_template, tokenizers.get(name, ""), tokenizer_key
        )
    if tokenizers == k.tokenizers and templates == k.chat_templates:
        return cfg
    kv = dataclasses.replace(k, tokenizers=tokenizers, chat_templates=templates)
    return dataclasses.replace(cfg, kv_events=kv)


def config_from_dict(data: Mapping[str, Any]) -> GatewayConfig:
    """Build and validate a config from nested plain data (YAML, overrides merged)."""
    cfg: GatewayConfig = with_model_tokenizers(_build(GatewayConfig, data, ""))
    validate(cfg)
    return cfg


def policy_config_from_dict(data: Mapping[str, Any]) -> PolicyConfig:
    """Build and validate the ``policy`` section alone (a change at run time); unknown
    keys are refused, as in the file."""
    cfg: PolicyConfig = _build(PolicyConfig, data, "policy.")
    _validate_policy(cfg)
    return cfg


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The YAML file as nested plain data; ConfigError when unreadable or not a mapping."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config: {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping at the top level")
    return data


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Apply dotted-key ``overrides`` (``"health.interval_s": 1``) onto nested ``base``."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {} if child is None else child
                if not isinstance(child, dict):
                    raise ConfigError(f"{part}: expected a mapping, got {child!r}")
                node[part] = child
            node = child
        if leaf == "params" and isinstance(value, Mapping):
            current = node.get(leaf) or {}
            if not isinstance(current, Mapping):
                raise ConfigError(f"{dotted}: expected a mapping, got {current!r}")
            value = {**current, **value}
        node[leaf] = value
    return out
