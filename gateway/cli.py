"""Command line: flags (sglang-router compatible) → config → uvloop → serve.

Contract: ``main(argv)`` returns an exit code: 0 after a clean stop, 2 when the
configuration is refused (the message names the key, the flag and the problem). Flags
override the YAML file given with ``--config``. This is the only module that knows uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

from aiohttp import web

from gateway.app import build_app, make_model_policy_sets, make_policy_set
from gateway.config import (
    ConfigError,
    GatewayConfig,
    ServerConfig,
    config_from_dict,
    merge,
    read_yaml,
)
from gateway.config.policyspec import parse_params
from gateway.exact.choice import load_choice
from gateway.http import tuning
from gateway.http.handlers import start_site
from gateway.multiprocess import supervise
from gateway.telemetry.logs import setup_logging

log = logging.getLogger(__name__)

# --kv-events: the words a boolean flag takes, read as kv_events.enabled's true/false
_TRISTATE = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}

# flag → (dotted config key, argparse options). Defaults live in gateway/config/ only;
# a flag absent from the command line leaves the file's (or the default) value.
_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--host": ("server.host", {"help": "address to listen on (default 127.0.0.1)"}),
    "--port": ("server.port", {"type": int, "help": "port to listen on (default 30000)"}),
    "--processes": (
        "server.processes",
        {
            "type": int,
            "help": "gateway processes sharing the port (SO_REUSEPORT) and, through "
            "--redis-url (required above 1), the index, load and workers (1)",
        },
    ),
    "--worker-urls": (
        "workers",
        {"nargs": "+", "metavar": "URL", "help": "worker URLs to register at start"},
    ),
    "--worker-kind": (
        "worker_kind",
        {"help": "kind of a worker whose URL has no #kind (auto, sglang, llamacpp, ...)"},
    ),
    "--dp-aware": (
        "dp_aware",
        {"action": "store_true", "help": "route to each DP rank of SGLang workers (default)"},
    ),
    "--no-dp-aware": (
        "dp_aware",
        {"action": "store_false", "help": "treat a DP worker as one target (rank-blind)"},
    ),
    "--policy": ("policy.name", {"help": "routing policy (default min_ttft); unknown → refused"}),
    "--cache-threshold": (
        "policy.cache_threshold",
        {"type": float, "help": "cache_aware: minimum match rate for a prefix hit (0.3)"},
    ),
    "--balance-abs-threshold": (
        "policy.balance_abs_threshold",
        {"type": int, "help": "cache_aware: absolute load gap for imbalance (64)"},
    ),
    "--balance-rel-threshold": (
        "policy.balance_rel_threshold",
        {"type": float, "help": "cache_aware: relative load ratio for imbalance (1.5)"},
    ),
    "--eviction-interval-secs": (
        "prefix_index.eviction_interval_s",
        {"type": float, "help": "seconds between prefix index sweeps (60)"},
    ),
    "--max-tree-size": (
        "prefix_index.max_tree_size",
        {"type": int, "help": "indexed prompt characters per worker (67108864)"},
    ),
    "--max-idle-secs": (
        "prefix_index.max_idle_s",
        {"type": float, "help": "drop index entries idle this long (3600)"},
    ),
    "--slot-wait-secs": (
        "prefix_index.slot_wait_s",
        {"type": float, "help": "hold a request for a busy slot with its prefix (2; 0 off)"},
    ),
    "--prefill-wait-secs": (
        "prefix_index.prefill_wait_s",
        {"type": float, "help": "hold a sibling of a prompt in prefill on SGLang (2; 0 off)"},
    ),
    "--slow-start-window-secs": (
        "slow_start.window_s",
        {"type": float, "help": "a worker added at run time ramps its share this long (0 off)"},
    ),
    "--prompt-store-bytes": (
        "prewarm.prompt_store_bytes",
        {"type": int, "help": "keep recent prompts, this many bytes, to pre-warm (0: none)"},
    ),
    "--prewarm-tokens-per-sec": (
        "prewarm.tokens_per_s",
        {"type": float, "help": "fleet-wide pre-warm budget in prompt tokens/s (8000)"},
    ),
    "--kv-events": (
        "kv_events.enabled",
        {
            "type": lambda v: _TRISTATE.get(v.lower(), v.lower()),
            "metavar": "auto|true|false",
            "help": "exact mode from SGLang KV events: auto follows every worker that "
            "advertises events when a tokenizer is configured for its model, or its "
            "/server_info names a local one (auto)",
        },
    ),
    "--kv-events-tokenizer": (
        "kv_events.tokenizer",
        {
            "metavar": "SPEC",
            "help": "exact mode's tokenizer: hf:<dir> (tokenizer.json + chat template, "
            "local files) or python:<module>:<factory>",
        },
    ),
    "--tokenizer-path": (
        "kv_events.tokenizer",
        {
            "type": lambda v: f"hf:{v}",
            "metavar": "DIR",
            "help": "the model's tokenizer directory (tokenizer.json, tokenizer_config.json; "
            "never downloaded): same as --kv-events-tokenizer hf:DIR",
        },
    ),
    "--chat-template": (
        "kv_events.chat_template",
        {
            "metavar": "FILE",
            "help": "a Jinja chat template overriding the tokenizer directory's own "
            "(as the workers' --chat-template)",
        },
    ),
    "--shadow-policy": (
        "policy.shadows",
        {
            "action": "append",
            "metavar": "NAME[:K=V,...]",
            "help": "score every request with this policy too, without routing by it "
            "(repeatable; picks in the decision record and gateway_shadow_* metrics)",
        },
    ),
    "--ab-policy": (
        "policy.ab_policy",
        {"metavar": "NAME[:K=V,...]", "help": "arm B of an A/B split (see --ab-fraction)"},
    ),
    "--ab-fraction": (
        "policy.ab_fraction",
        {"type": float, "help": "share of sessions routed by --ab-policy, 0..1 (0)"},
    ),
    "--api-key": ("server.api_key", {"help": "require Authorization: Bearer KEY"}),
    "--api-keys-file": ("server.api_keys_file", {"help": "more client keys, one a line"}),
    "--admin-api-key": (
        "server.admin_api_key",
        {"help": "key for /workers, /debug, /dashboard (else they take the client keys)"},
    ),
    "--worker-api-key": (
        "server.worker_api_key",
        {
            "help": "key sent to every worker as Authorization: Bearer KEY (default: "
            "--api-key's; needs --admin-api-key)"
        },
    ),
    "--worker-allowlist": (
        "server.worker_allowlist",
        {"nargs": "+", "metavar": "HOST_OR_CIDR", "help": "where POST /workers may point"},
    ),
    "--rate-limit-per-sec": (
        "server.rate_limit_per_s",
        {"type": float, "help": "requests per second per client key; 0 off (0)"},
    ),
    "--max-connections": (
        "server.max_connections",
        {"type": int, "help": "open client connections at most; 0 no cap (10000)"},
    ),
    "--connect-timeout-secs": (
        "server.connect_timeout_s",
        {"type": float, "help": "connecting to a worker (5)"},
    ),
    "--first-byte-timeout-secs": (
        "server.first_byte_timeout_s",
        {"type": float, "help": "worker's response head, then retry elsewhere; 0 off (0)"},
    ),
    "--stream-idle-timeout-secs": (
        "server.stream_idle_timeout_s",
        {"type": float, "help": "silence between streamed chunks; 0 off (120)"},
    ),
    "--shutdown-grace-secs": (
        "server.shutdown_grace_s",
        {"type": float, "help": "on SIGTERM, time for in-flight requests (30)"},
    ),
    "--request-timeout-secs": (
        "server.request_timeout_s",
        {"type": float, "help": "bound on one worker attempt (1800)"},
    ),
    "--health-check-interval-secs": (
        "health.interval_s",
        {"type": float, "help": "seconds between active probes (5)"},
    ),
    "--health-check-timeout-secs": (
        "health.timeout_s",
        {"type": float, "help": "probe timeout (2)"},
    ),
    "--health-failure-threshold": (
        "health.failure_threshold",
        {"type": int, "help": "consecutive failed probes to flag a worker (3)"},
    ),
    "--health-success-threshold": (
        "health.success_threshold",
        {"type": int, "help": "consecutive passed probes to clear it (2)"},
    ),
    "--health-check-endpoint": (
        "health.endpoint",
        {"help": "probe path (/health); /ping is cheaper on SGLang 0.5.23"},
    ),
    "--retry-max-retries": (
        "retry.max_retries",
        {"type": int, "help": "further attempts on other workers (3)"},
    ),
    "--max-concurrent-requests": (
        "admission.max_concurrent_requests",
        {"type": int, "help": "requests proxied at once; 0 or -1 unlimited (0)"},
    ),
    "--queue-size": (
        "admission.queue_size",
        {"type": int, "help": "requests waiting for a slot; more get 429 (100)"},
    ),
    "--queue-timeout-secs": (
        "admission.queue_timeout_s",
        {"type": float, "help": "wait for a slot before 503 (60)"},
    ),
    "--max-payload-size": (
        "server.max_payload_size",
        {"type": int, "help": "largest request body in bytes; more get 413 (64 MiB)"},
    ),
    "--request-id-headers": (
        "server.request_id_headers",
        {"nargs": "+", "metavar": "HEADER", "help": "headers naming the request id, in order"},
    ),
    "--log-level": ("server.log_level", {"help": "debug, info, warning, error (info)"}),
    "--log-json": (
        "server.log_json",
        {"action": "store_true", "help": "log one JSON object per line (plain text)"},
    ),
    "--load-poll-interval-secs": (
        "load.poll_interval_s",
        {"type": float, "help": "seconds between engine load polls; 0 off (1)"},
    ),
    "--lora-unloaded": (
        "lora.unloaded",
        {"choices": ["load", "reject"], "help": "adapter loaded nowhere: load it, or 404 (load)"},
    ),
    "--no-lora-affinity": (
        "lora.affinity",
        {"action": "store_false", "help": "route adapter requests as if adapter-blind"},
    ),
    "--pd-disaggregation": (
        "pd.enabled",
        {"action": "store_true", "help": "prefill/decode disaggregation: --prefill/--decode pairs"},
    ),
    "--prefill": (
        "pd.prefill",
        {
            "action": "append",
            "nargs": "+",
            "metavar": ("URL", "BOOTSTRAP_PORT"),
            "help": "a prefill worker and its bootstrap port (a number or none; repeatable)",
        },
    ),
    "--decode": (
        "pd.decode",
        {"action": "append", "metavar": "URL", "help": "a decode worker (repeatable)"},
    ),
    "--prefill-policy": (
        "pd.prefill_policy",
        {"help": "PD: policy choosing the prefill worker (default: --policy)"},
    ),
    "--decode-policy": (
        "pd.decode_policy",
        {"help": "PD: policy choosing the decode worker (default least_load)"},
    ),
    "--redis-url": (
        "redis.url",
        {"help": "share state with other gateways: redis://HOST:PORT/DB or rediss://"},
    ),
    "--redis-prefix": (
        "redis.prefix",
        {"help": "key prefix: gateways with the same URL and prefix share (prefix-gateway)"},
    ),
}
_KEY_TO_FLAG = {key: flag for flag, (key, _) in _FLAGS.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix-gateway",
        description="Prefix-aware gateway for SGLang workers (sglang-router compatible flags).",
    )
    parser.add_argument("--config", metavar="PATH", help="YAML file (see config/gateway.yaml)")
    for flag, (key, options) in _FLAGS.items():
        if "action" not in options:  # store_true flags take no value
            options.setdefault("metavar", "VALUE")
        parser.add_argument(flag, dest=key, default=argparse.SUPPRESS, **options)
    parser.add_argument(
        "--policy-arg",
        dest="policy_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra policy parameter (repeatable); VALUE is read as YAML (number, bool, str)",
    )
    return parser


def _policy_params(pairs: Sequence[str]) -> dict[str, Any]:
    try:
        return parse_params(pairs)
    except ValueError as exc:
        raise ConfigError(f"policy.params (--policy-arg): {exc}") from None


def _name_flag(exc: ConfigError) -> str:
    message = str(exc)
    where, sep, problem = message.partition(":")
    flag = _KEY_TO_FLAG.get(where.split("[", 1)[0])
    return f"{where} ({flag}){sep}{problem}" if flag and sep else message


def parse_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    """Flags and file → validated config; ConfigError names the key and flag."""
    args = vars(build_parser().parse_args(argv))
    config_path = args.pop("config", None)
    policy_args = args.pop("policy_args", [])
    base = read_yaml(config_path) if config_path else {}
    overrides: dict[str, Any] = dict(args)
    if "pd.prefill" in overrides:  # --prefill URL [PORT], repeated: one "URL PORT" each
        overrides["pd.prefill"] = [" ".join(v) for v in overrides["pd.prefill"]]
    if policy_args:
        overrides["policy.params"] = _policy_params(policy_args)
    try:
        config = config_from_dict(merge(base, overrides))
        # refuse bad policy parameters, and a set that cannot decide, before starting
        tuning.rehearse(make_policy_set(config.policy))
        for model, policies in make_model_policy_sets(config).items():
            tuning.rehearse(policies, f"models.{model}.policy")
        if config.kv_events.enabled == "true":  # auto: a failure is a worker's reason
            load_choice(config.kv_events)
        return config
    except ConfigError as exc:
        raise ConfigError(_name_flag(exc)) from None


def configure_logging(server: ServerConfig, stream: IO[str] | None = None) -> logging.Handler:
    """The root logger's handler for ``server.log_level`` and ``server.log_json``."""
    name = "WARNING" if server.log_level.lower() == "warn" else server.log_level.upper()
    return setup_logging(name, json=server.log_json, stream=stream)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def serve(config: GatewayConfig, reread: Callable[[], GatewayConfig] | None = None) -> None:
    """Run the gateway until SIGINT or SIGTERM; on SIGHUP, ``reread`` the file and flags
    and apply their ``policy`` section (the rest is static: it needs a restart)."""
    app = build_app(config)
    runner, port = await start_site(app, config.server.host, config.server.port)
    log.info(
        "gateway listening on http://%s:%d with policy %s and %d workers",
        config.server.host,
        port,
        config.policy.name,
        len(config.workers),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if reread is not None:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGHUP, _reload, app, reread)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _reload(app: web.Application, reread: Callable[[], GatewayConfig]) -> None:
    """SIGHUP: the policy section of the re-read config, applied or refused with the
    reason (logged and counted either way, the running policy kept on refusal)."""
    control = app.get(tuning.POLICY_CONTROL)
    if control is None:
        return  # still starting: nothing routes yet
    try:
        config = reread()
    except ConfigError as exc:
        control.refused("SIGHUP", str(exc))
        return
    with contextlib.suppress(ConfigError):  # refused: logged and counted by the control
        control.apply(config.policy, "SIGHUP")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"prefix-gateway: invalid configuration: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.server)
    if config.server.processes > 1:  # a parent forking the gateways (before any loop)
        return supervise(config, lambda i, cfg: _run(cfg, argv, i))
    return _run(config, argv)


def _run(config: GatewayConfig, argv: Sequence[str] | None, index: int | None = None) -> int:
    """One gateway until SIGINT or SIGTERM: the process, or process ``index`` of several."""
    if index is not None:
        log.info(
            "gateway process %d of %d: pid %d, gateway id %s",
            index, config.server.processes, os.getpid(), config.redis.gateway_id,
        )  # fmt: skip
    with (
        asyncio.Runner(loop_factory=_loop_factory()) as runner,
        contextlib.suppress(KeyboardInterrupt),
    ):
        runner.run(serve(config, lambda: parse_config(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
