"""``python -m simulator`` / ``sglang-sim``: N simulated SGLang (or llama.cpp) workers in one
event loop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import textwrap
from collections.abc import Sequence

from simulator.config import SimConfig
from simulator.faults import Faults
from simulator.fleet import SimulatedFleet
from simulator.model.disagg import TRANSFER_BACKENDS
from simulator.model.hicache import IO_BACKENDS, WRITE_POLICIES
from simulator.model.profiles import DEFAULT_PROFILE, PROFILES
from simulator.model.transfer import (
    DEFAULT_HOST_LINK,
    DEFAULT_TRANSFER_PROFILE,
    HOST_LINK_PROFILES,
    TRANSFER_PROFILES,
)


def _listing(items: Sequence[tuple[str, str]]) -> str:
    """``name  description`` lines for the epilog, descriptions wrapped at column 19."""
    pad = " " * 19
    return "\n".join(
        f"  {name:16} " + textwrap.fill(text, 79, initial_indent=pad, subsequent_indent=pad)[19:]
        for name, text in items
    )


def build_parser() -> argparse.ArgumentParser:
    profiles = _listing([(p.name, p.description) for p in PROFILES.values()])
    transfers = _listing([(t.name, t.description) for t in TRANSFER_PROFILES.values()])
    host_links = _listing([(t.name, t.description) for t in HOST_LINK_PROFILES.values()])
    parser = argparse.ArgumentParser(
        prog="sglang-sim",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Serve N simulated SGLang 0.5.23 workers on ports P..P+N-1 from one uvloop event\n"
            "loop. Each has SGLang's HTTP API, a radix KV cache with LRU eviction, continuous\n"
            "batching and the latency model of a named profile. Prints one URL per line on\n"
            "stdout; stops on SIGINT/SIGTERM.\n\n"
            "--dp-size N gives each worker N data-parallel ranks as SGLang's --dp-size: N\n"
            "replicas (a radix cache of --capacity-tokens, queues and scheduler each) behind\n"
            "one HTTP server. A request goes to the rank its routed_dp_rank (or\n"
            "data_parallel_rank, or the X-Data-Parallel-Rank header) names, else round robin;\n"
            "/server_info, /v1/loads, /metrics, /_sim/stats and KV events (rank r on\n"
            "port+r) report each rank.\n\n"
            "--engine llamacpp serves llama.cpp's server instead: --slots slots of\n"
            "context-length/slots tokens each, one token sequence per slot (no KV shared\n"
            "between slots), one batch per step on one thread, llama.cpp's HTTP API (/props,\n"
            "/slots, llamacpp:* /metrics, timings.cache_n). The capacity, page-size,\n"
            "max-running-requests, schedule-policy, cache-report and legacy-get-load flags\n"
            "do not apply to it; --kv-events-config and --dp-size are refused.\n\n"
            "--disaggregation-mode prefill|decode makes the workers one side of SGLang's\n"
            "prefill/decode disaggregation (docs/PD.md): send the same request, with\n"
            "bootstrap_host/bootstrap_port/bootstrap_room, to a prefill and a decode worker;\n"
            "the prefill prefills with its radix cache, holds the KV while it moves (the\n"
            "--transfer-profile link) and answers with one token; the decode waits for the\n"
            "room's KV at the prefill's bootstrap port, then decodes and streams.\n\n"
            "--enable-hierarchical-cache adds SGLang's HiCache host tier under each radix\n"
            "cache: what the GPU evicts moves to host memory (when it was copied there:\n"
            "--hicache-write-policy), up to --hicache-ratio x the device pool or\n"
            "--hicache-size GB, LRU; a request's host hit is loaded back over the\n"
            "--hicache-link instead of prefilled, reported in meta_info.cached_tokens_details\n"
            "and KV events with medium CPU_PINNED."
        ),
        epilog=(
            f"profiles:\n{profiles}\n\n"
            "faults can also be changed at run time: POST /_sim/faults with a JSON subset of\n"
            '{"error_rate", "error_status", "latency_s", "hang", "drop_mid_stream_after",\n'
            '"fail_health", "transfer_fail_rate", "bootstrap_fail"}; GET /_sim/stats for\n'
            "counters.\n\n"
            f"transfer profiles (--transfer-profile):\n{transfers}\n\n"
            f"GPU <-> host links (--hicache-link):\n{host_links}\n\n"
            "example:\n  python -m simulator --workers 2 --base-port 31000 "
            "--capacity-tokens 200000 \\\n      --enable-metrics --enable-cache-report"
        ),
    )
    add = parser.add_argument
    add("--workers", type=int, default=1, help="number of workers (default 1)")
    add(
        "--engine",
        default="sglang",
        choices=["sglang", "llamacpp"],
        help="personality: SGLang (radix cache) or llama.cpp's server (slots); default sglang",
    )
    add(
        "--slots",
        type=int,
        default=2,
        help="llamacpp: slots per worker (n_parallel), each context-length/slots (default 2)",
    )
    add("--base-port", type=int, default=30000, help="port of worker 0 (default 30000)")
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    add(
        "--capacity-tokens",
        type=int,
        default=None,
        help="KV pool per worker in tokens (default: the profile's, 420000 for the default)",
    )
    add(
        "--speed",
        type=float,
        default=1.0,
        help="modelled seconds per wall second: 10 runs ten times faster (default 1)",
    )
    add("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="latency profile")
    add("--page-size", type=int, default=1, help="radix cache page size in tokens (default 1)")
    add(
        "--dp-size",
        "--data-parallel-size",
        type=int,
        default=1,
        help="data-parallel ranks per worker, each a whole replica (default 1)",
    )
    add("--enable-metrics", action="store_true", help="serve /metrics (SGLang: off by default)")
    add(
        "--enable-cache-report",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens on OpenAI routes",
    )
    add("--seed", type=int, default=0, help="seed of output text and fault draws (default 0)")
    add("--model-path", default="sim-model", help="reported model_path (default sim-model)")
    add("--served-model-name", default=None, help="reported model name (default: model path)")
    add(
        "--tokenizer-path",
        default=None,
        metavar="DIR",
        help="a real model's tokenizer (tokenizer.json, tokenizer_config.json; needs "
        "transformers): token ids, cached prefixes and KV events as SGLang with that model "
        "(default: the arithmetic pseudo-English tokenizer)",
    )
    add(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="override its chat template (a .jinja file, read as SGLang reads --chat-template)",
    )
    add(
        "--context-length",
        type=int,
        default=None,
        help="context length, all slots together for llamacpp (default: profile's)",
    )
    add("--max-running-requests", type=int, default=None, help="default: SGLang's formula")
    add("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"], help="default fcfs")
    add("--legacy-get-load", action="store_true", help="serve /get_load (0.5.5 list shape)")
    add("--api-key", default=None, help="require 'Authorization: Bearer KEY' like SGLang")
    add(
        "--natural-output-tokens",
        type=int,
        default=128,
        help="tokens before EOS when a request sets no limit (default 128)",
    )
    add(
        "--kv-events-config",
        default=None,
        help='KV events JSON as SGLang, e.g. \'{"publisher":"zmq","endpoint":"tcp://*:5557",'
        '"replay_endpoint":"tcp://*:6557"}\'; worker i rank r publishes on '
        "port+i*dp_size+r",
    )
    add(
        "--kv-events-legacy-array",
        action="store_true",
        help="publish the <=0.5.18 tagged-array event encoding (default: 0.5.23 maps)",
    )
    lora = parser.add_argument_group("LoRA adapters (SGLang's flags; names only, no weights)")
    lora.add_argument("--enable-lora", action="store_true", default=None, help="serve adapters")
    lora.add_argument(
        "--lora-paths",
        nargs="*",
        default=[],
        metavar="SPEC",
        help='adapters loaded at start: NAME=PATH, PATH, or {"lora_name","lora_path","pinned"}',
    )
    lora.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="distinct adapters in a running batch, the base model included (default 8)",
    )
    lora.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="adapters loaded at once; beyond it the least recently used is unloaded",
    )
    lora.add_argument(
        "--lora-load-s",
        type=float,
        default=0.2,
        help="modelled seconds to load one adapter (simulator's figure; default 0.2)",
    )
    pd = parser.add_argument_group("prefill/decode disaggregation (SGLang's flags; docs/PD.md)")
    pd.add_argument(
        "--disaggregation-mode",
        default="null",
        choices=["null", "prefill", "decode"],
        help="this worker's role (default null: not disaggregated)",
    )
    pd.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=8998,
        help="a prefill's bootstrap server port, worker i on port+i (0: ephemeral); a "
        "decode's assumed prefill port when a request's bootstrap_port is null (default 8998)",
    )
    pd.add_argument(
        "--disaggregation-transfer-backend",
        default="mooncake",
        choices=list(TRANSFER_BACKENDS),
        help="reported as SGLang's; 'fake' (decode only) serves requests without a prefill",
    )
    pd.add_argument(
        "--transfer-profile",
        default=DEFAULT_TRANSFER_PROFILE,
        choices=sorted(TRANSFER_PROFILES),
        help=f"the simulated KV link (default {DEFAULT_TRANSFER_PROFILE}; see below)",
    )
    for flag, env, what in (
        ("bootstrap", "BOOTSTRAP", "a prefill waits for a request's decode side"),
        ("waiting", "WAITING", "a decode waits for a room's KV"),
    ):
        variable = f"SGLANG_DISAGGREGATION_{env}_TIMEOUT"
        pd.add_argument(
            f"--{flag}-timeout-s",
            type=float,
            default=float(os.environ.get(variable, 300)),
            help=f"modelled seconds {what} (default: ${variable}, else 300)",
        )
    hi = parser.add_argument_group("HiCache host tier (SGLang's flags; simulator.model.hicache)")
    hi.add_argument(
        "--enable-hierarchical-cache",
        "--enable-hicache",
        action="store_true",
        help="keep a host-memory tier under the radix cache",
    )
    hi.add_argument(
        "--hicache-ratio",
        type=float,
        default=None,
        help="host pool as a multiple of the device pool (default 2.0, SGLang's)",
    )
    hi.add_argument(
        "--hicache-size",
        type=int,
        default=0,
        help="host pool in GB per worker (rank), overriding the ratio (default 0: unset)",
    )
    hi.add_argument(
        "--hicache-write-policy",
        default="write_through",
        choices=list(WRITE_POLICIES),
        help="when KV is copied to the host (default write_through)",
    )
    hi.add_argument(
        "--hicache-io-backend",
        default="kernel",
        choices=list(IO_BACKENDS),
        help="kernel (default) or direct: plain page copies, a third of the speed",
    )
    hi.add_argument(
        "--hicache-link",
        default=DEFAULT_HOST_LINK,
        choices=sorted(HOST_LINK_PROFILES),
        help=f"the simulated GPU <-> host link (default {DEFAULT_HOST_LINK}; see below)",
    )
    faults = parser.add_argument_group("faults (for tests)")
    faults.add_argument("--error-rate", type=float, default=0.0, help="fraction answered 5xx")
    faults.add_argument("--error-status", type=int, default=500, help="status of those errors")
    faults.add_argument("--latency-s", type=float, default=0.0, help="added wall latency")
    faults.add_argument("--hang", action="store_true", help="never answer inference requests")
    faults.add_argument(
        "--drop-mid-stream-after", type=int, default=None, help="cut streams after N chunks"
    )
    faults.add_argument("--fail-health", action="store_true", help="health endpoints answer 503")
    faults.add_argument(
        "--transfer-fail-rate",
        type=float,
        default=0.0,
        help="prefill: fraction of KV transfers failing",
    )
    faults.add_argument(
        "--bootstrap-fail", action="store_true", help="prefill: the bootstrap server answers 503"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        engine=args.engine,
        slots=args.slots,
        capacity_tokens=args.capacity_tokens,
        speed=args.speed,
        profile=args.profile,
        page_size=args.page_size,
        dp_size=args.dp_size,
        enable_metrics=args.enable_metrics,
        enable_cache_report=args.enable_cache_report,
        seed=args.seed,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        tokenizer_path=args.tokenizer_path,
        chat_template=args.chat_template,
        legacy_get_load=args.legacy_get_load,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        schedule_policy=args.schedule_policy,
        api_key=args.api_key,
        natural_output_tokens=args.natural_output_tokens,
        kv_events_config=args.kv_events_config,
        kv_events_legacy_array=args.kv_events_legacy_array,
        enable_lora=args.enable_lora,
        lora_paths=tuple(args.lora_paths),
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        lora_load_s=args.lora_load_s,
        disaggregation_mode=args.disaggregation_mode,
        disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
        disaggregation_transfer_backend=args.disaggregation_transfer_backend,
        transfer_profile=args.transfer_profile,
        bootstrap_timeout_s=args.bootstrap_timeout_s,
        waiting_timeout_s=args.waiting_timeout_s,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_ratio=args.hicache_ratio,
        hicache_size=args.hicache_size,
        hicache_write_policy=args.hicache_write_policy,
        hicache_io_backend=args.hicache_io_backend,
        hicache_link=args.hicache_link,
        faults=Faults(
            error_rate=args.error_rate,
            error_status=args.error_status,
            latency_s=args.latency_s,
            hang=args.hang,
            drop_mid_stream_after=args.drop_mid_stream_after,
            fail_health=args.fail_health,
            transfer_fail_rate=args.transfer_fail_rate,
            bootstrap_fail=args.bootstrap_fail,
        ),
    )


async def serve(config: SimConfig, workers: int, host: str, base_port: int) -> None:
    fleet = await SimulatedFleet.start(workers, config, host, base_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    for url in fleet.urls:
        print(url, flush=True)
    profile = config.resolved_profile()
    capacity = config.capacity_tokens or profile.capacity_tokens
    if config.engine == "llamacpp":
        context = config.context_length or profile.context_length
        kind = f"llama.cpp, {config.slots} slots of {context // config.slots} tokens"
    else:
        kind = f"SGLang, {capacity} KV tokens"
        if config.dp_size > 1:
            kind = f"SGLang, {config.dp_size} DP ranks of {capacity} KV tokens"
        hicache = config.resolved_hicache()
        if hicache is not None:
            kind += f" + {hicache.host_tokens} host tokens ({hicache.write_policy})"
    print(
        f"sglang-sim: {workers} worker(s) ({kind} each), profile {profile.name}, "
        f"speed x{config.speed}; Ctrl-C to stop",
        file=sys.stderr,
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        for worker in fleet.workers:
            await worker.stop(kill=False)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        raise SystemExit("--workers must be at least 1")
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as exc:
        raise SystemExit(f"sglang-sim: {exc}") from None
    coro = serve(config, args.workers, args.host, args.base_port)
    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
            asyncio.run(coro)
        else:
            uvloop.run(coro)
    except OSError as exc:
        raise SystemExit(f"sglang-sim: cannot listen: {exc}") from None


if __name__ == "__main__":
    main()
