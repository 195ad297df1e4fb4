"""Routing policies on a real llama.cpp or SGLang fleet, judged by the engines' own counters.

One fleet (default 4 workers x 2 slots, RAM prompt cache off), one shared-prefix
workload (8 prefixes of 1,800 tokens, 6 requests each, shuffled, 2 closed-loop clients).
Each run replays the same request order with fresh text (a new ``text_salt``), so no
run inherits another's cache. Per run: the engine-reported cached fraction
(``Δprompt_tokens_cached_total / Δ(cached + prompt_tokens_total)`` over all workers),
client-side TTFT p50/p90 (first streamed event), wall time, failures, and the router
process's CPU milliseconds per request (``/proc``, its whole process over the run: on a
machine whose cores the engines share, the router's CPU is taken from them).

Targets: ``gateway:<policy>`` (the project's gateway as a subprocess),
``sglang-router:<policy>`` (sglang-router 0.3.2, the ``bench`` extra), and client-side
baselines with no router: ``direct:round_robin`` and ``direct:sticky`` (prefix i →
worker i mod K: the balanced affinity a router should reach). ``gateway:<policy>+capacity``
also tells the gateway each worker's real capacity (``--max-tree-size``, see
``workload.capacity_hint_args``); not needed since the gateway reads llama.cpp's
``/props`` itself, kept to compare.

``--fleet sim`` runs the same targets on the simulated fleet calibrated to these workers
(profile ``tiny-llamacpp`` at ``--sim-speed`` 1, fitted to docs/REAL_ENGINE.md's
measurements): by default simulated llama.cpp servers
(``--sim-engine llamacpp``: ``--slots`` slots of 4,096 tokens, one prompt per slot, no KV
shared between slots), whose cached fraction comes from their ``/metrics`` counters as on
the real fleet; ``--sim-engine sglang`` runs the earlier stand-in (SGLang workers with a
radix cache of ``slots`` prompts' tokens and ``slots`` running requests), whose cached
fraction now comes from its ``sglang:*`` counters too.

``--fleet sglang`` runs the targets on real SGLang 0.5.23 CPU servers
(:mod:`loadtests.engine.sglang_fleet`; default 2 servers of ``--max-total-tokens`` 8,192
KV tokens, page 16, the tiny Hugging Face model, whose tokenizer also makes each syllable
one token). Cached fraction = Δ``sglang:cached_tokens_total`` / Δ``sglang:prompt_tokens_total``
over the servers; the table adds the servers' own mean TTFT (Δsum / Δcount of
``sglang:time_to_first_token_seconds``). ``--fleet sim --sim-engine sglang
--max-total-tokens N`` is its simulated twin: simulated SGLang workers with the same KV
pool and page size (``--sim-profile tiny-sglang``, fitted to the real server by
:mod:`loadtests.engine.sglang_calibrate`), and SGLang's own ``max_running_requests``
formula unless ``--sim-max-running`` is given.

``--workload agentic`` replaces the shared prefixes by agentic sessions
(:func:`loadtests.engine.workload.agentic_requests`: default 6 agents x 4 steps, a
1,400-token system prompt each and a tool-call history growing by ~300 tokens a step; an
agent's steps in order, one at a time, by whichever of the ``--concurrency`` clients is
free);
``direct:sticky`` then sends agent ``a`` to worker ``a mod K``. ``--repeat N`` runs the
whole target list N times (run 1 of every target, then run 2, ...), each run with its own
text; rows are labelled ``target #k``. ``--log-dir DIR`` keeps, per run, the router's log,
the gateway's decision records (``GET /debug/decisions?limit=1000`` just before it stops)
and one JSON line per request (ok, status, error, TTFT, usage), plus the servers' logs.

    python -m loadtests.engine.bench [--targets gateway:round_robin,gateway:min_ttft]
        [--workload shared-prefix|agentic] [--repeat N] [--log-dir DIR]
        [--markdown results/real_engine.md] [--json results/real_engine.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from loadtests.engine.client import ChatResult
from loadtests.engine.llama_fleet import LlamaFleet
from loadtests.engine.runner import (
    Route,
    RunResult,
    reported_fraction,
    run_workload_totals,
    summarize,
)
from loadtests.engine.sglang_model import SERVED_MODEL_NAME as SGLANG_MODEL_NAME
from loadtests.engine.tiny_model import ensure_tiny_model
from loadtests.engine.workload import (
    AgenticSpec,
    PrefixRequest,
    SharedPrefixSpec,
    agentic_requests,
    capacity_hint_args,
    shared_prefix_requests,
)
from loadtests.harness.gateway_proc import ROUTER_MODULES, run_gateway
from loadtests.harness.procs import cpu_seconds
from loadtests.harness.sim_fleet import SimSettings, run_sim_fleet

# The simulator's profile for these workers: tiny-llamacpp is fitted to REAL_ENGINE.md's
# quiet-machine measurements of this model on one thread (simulator/model/profiles.py), so it
# runs at speed 1. (The earlier tiny-cpu profile needed a speed of 0.44.)
SIM_PROFILE = "tiny-llamacpp"
SIM_SPEED = 1.0
SGLANG_SIM_PROFILE = "tiny-sglang"  # the simulator's twin of --fleet sglang
SGLANG_PAGE_SIZE = 16
SGLANG_SETTLE_S = 1.0  # SGLang counts a request's tokens just after its stream ends
ROUTER_WORKERS_TIMEOUT_S = 30.0  # sglang-router: wait for its workers' registration
TEMPLATE_TOKENS = 16  # ChatML overhead of a two-message request, rounded up

_AGENTIC = AgenticSpec()  # the agentic workload's defaults

DEFAULT_TARGETS = (
    "direct:round_robin",
    "direct:sticky",
    "gateway:round_robin",
    "gateway:least_load",
    "gateway:consistent_hash",
    "gateway:cache_aware",
    "gateway:min_ttft",
    "sglang-router:cache_aware",
)


def direct_route(name: str, urls: Sequence[str]) -> Route:
    """Client-side baselines: ``round_robin`` over requests, or ``sticky`` by prefix."""
    if name == "sticky":
        return lambda r: urls[r.prefix_id % len(urls)]
    if name == "round_robin":
        return lambda r: urls[r.index % len(urls)]
    raise ValueError(f"unknown direct route {name!r}")


def run_target(
    target: str, urls: Sequence[str], requests: Sequence[PrefixRequest], concurrency: int,
    log_dir: Path, gateway_args: Sequence[str] = (), slots: int = 2,
    engine_counters: bool = True, settle_s: float = 0.0, label: str = "",
    wait_router_workers_s: float = ROUTER_WORKERS_TIMEOUT_S,
) -> RunResult:  # fmt: skip
    """Run one ``direct:<route>`` or ``<router>:<policy>`` target; errors become a row.

    ``gateway_args`` go to the project's gateway only; ``gateway:<policy>+capacity`` also
    tells it the workers' real capacity (``slots`` prompts, see ``capacity_hint_args``).
    The cached fraction comes from the workers' ``/metrics`` read ``settle_s`` after the
    last response (from ``usage`` without ``engine_counters``). ``label`` (default: the
    target and a counter) names this run's files in ``log_dir``: the router's log,
    ``<label>.requests.jsonl`` and, for the gateway, ``<label>.decisions.json``.
    sglang-router answers ``/health`` before it has registered its workers (in the
    background: ~1 s per real SGLang server), so the run waits up to
    ``wait_router_workers_s`` for its ``/workers`` to list every worker healthy (0: no
    wait, as before 2026-12-01, when its first requests got 503 ``no_available_workers``).
    """
    kind, _, name = target.partition(":")
    if kind == "gateway" and name.endswith("+capacity"):
        name = name.removesuffix("+capacity")
        gateway_args = [*gateway_args, *capacity_hint_args(requests, slots)]
    label = label or f"{kind}-{name}-{len(list(log_dir.iterdir()))}"
    records = log_dir / f"{label}.requests.jsonl"
    try:
        if kind == "direct":
            route = direct_route(name, urls)
            return _run(
                target, urls, route, requests, concurrency, engine_counters, settle_s, records
            )
        if kind not in ROUTER_MODULES:
            raise ValueError(f"unknown target kind {kind!r}")
        args = gateway_args if kind == "gateway" else ()
        with run_gateway(urls, name, log_dir / f"{label}.log", args, router=kind) as gw:
            if kind == "sglang-router" and wait_router_workers_s > 0:
                waited = wait_router_workers(gw.url, len(urls), wait_router_workers_s)
                print(f"# {label}: sglang-router listed its workers after {waited:.2f} s")
            cpu_before = cpu_seconds(gw.pid)
            row = _run(
                target, urls, lambda _: gw.url, requests, concurrency, engine_counters,
                settle_s, records,
            )  # fmt: skip
            row = replace(row, router_cpu_s=cpu_seconds(gw.pid) - cpu_before)
            if kind == "gateway":
                save_decisions(gw.url, log_dir / f"{label}.decisions.json")
            return row
    except (RuntimeError, ValueError, OSError) as exc:
        nan = float("nan")
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return RunResult(target, 0, 0, nan, nan, nan, nan, error=first_line)


def router_workers_ready(body: bytes, expected: int) -> bool:
    """True when sglang-router's ``GET /workers`` answer lists ``expected`` workers, all
    ``is_healthy``."""
    try:
        workers = json.loads(body).get("workers", [])
    except (ValueError, AttributeError):
        return False
    healthy = [w for w in workers if isinstance(w, dict) and w.get("is_healthy") is True]
    return len(healthy) >= expected


def wait_router_workers(router_url: str, expected: int, timeout_s: float) -> float:
    """Poll sglang-router's ``/workers`` until :func:`router_workers_ready`; return the
    seconds waited. Raises ``RuntimeError`` after ``timeout_s``."""
    start = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(router_url + "/workers", timeout=2.0) as response:
                if router_workers_ready(response.read(), expected):
                    return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"sglang-router did not register {expected} workers")
        time.sleep(0.1)


def save_decisions(gateway_url: str, path: Path, limit: int = 1000) -> None:
    """The gateway's latest ``limit`` decision records (newest first) into ``path``; a
    failure to read them is written there instead of raised."""
    url = f"{gateway_url}/debug/decisions?limit={limit}"
    try:
        with urllib.request.urlopen(url, timeout=10.0) as response:
            path.write_bytes(response.read())
    except OSError as exc:
        path.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))


def request_records(
    requests: Sequence[PrefixRequest], urls: Sequence[str], route: Route,
    results: Sequence[ChatResult],
) -> list[dict[str, object]]:  # fmt: skip
    """One JSON-ready record per request, in request order: where it went (a worker's
    index, or -1 for a router), what came back."""
    rows: list[dict[str, object]] = []
    for r, res in zip(requests, results, strict=True):
        url = route(r)
        rows.append({
            "index": r.index, "prefix_id": r.prefix_id, "chain": r.chain,
            "worker": urls.index(url) if url in urls else -1, **asdict(res),
        })  # fmt: skip
    return rows


def _run(
    target: str, urls: Sequence[str], route: Route, requests: Sequence[PrefixRequest],
    concurrency: int, engine_counters: bool, settle_s: float, records: Path | None = None,
) -> RunResult:  # fmt: skip
    results, totals, wall = asyncio.run(
        run_workload_totals(urls, route, requests, concurrency, engine_counters, settle_s)
    )
    if records is not None:
        lines = (json.dumps(row) for row in request_records(requests, urls, route, results))
        records.write_text("".join(line + "\n" for line in lines))
    if totals is None:
        return summarize(target, results, reported_fraction(results), wall)
    return summarize(target, results, totals.cached_fraction, wall, totals.engine_ttft_mean_s)


def markdown_table(rows: Sequence[RunResult]) -> str:
    """The results as a Markdown table; with an "engine TTFT mean" column when any row
    has the engines' own TTFT (SGLang workers)."""
    if any(r.engine_ttft_mean_s == r.engine_ttft_mean_s for r in rows):  # not all NaN
        return _sglang_table(rows)
    lines = [
        "| target | cached fraction (engines) | (usage) | TTFT p50 | TTFT p90 | wall | failed "
        "| router CPU ms/request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.requests == 0:
            lines.append(f"| {r.target} | not run: {r.error} | | | | | | |")
            continue
        lines.append(
            f"| {r.target} | {r.cached_fraction:.2f} | {r.reported_fraction:.2f} | "
            f"{r.ttft_p50_s:.3f} s | "
            f"{r.ttft_p90_s:.3f} s | {r.wall_s:.1f} s | {r.failures}/{r.requests} | "
            f"{_router_cpu(r)} |"
        )
    return "\n".join(lines) + "\n"


def _sglang_table(rows: Sequence[RunResult]) -> str:
    lines = [
        "| target | cached fraction (engines) | (usage) | engine TTFT mean | TTFT p50 | "
        "TTFT p90 | wall | failed | router CPU ms/request |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.requests == 0:
            lines.append(f"| {r.target} | not run: {r.error} | | | | | | | |")
            continue
        lines.append(
            f"| {r.target} | {r.cached_fraction:.2f} | {r.reported_fraction:.2f} | "
            f"{r.engine_ttft_mean_s:.3f} s | {r.ttft_p50_s:.3f} s | {r.ttft_p90_s:.3f} s | "
            f"{r.wall_s:.1f} s | {r.failures}/{r.requests} | {_router_cpu(r)} |"
        )
    return "\n".join(lines) + "\n"


def _router_cpu(r: RunResult) -> str:
    """The router's CPU milliseconds per request of the run (its whole process: health
    probes and load polls included); "none" for a client-side target."""
    if r.router_cpu_s != r.router_cpu_s or r.requests == 0:  # NaN: no router
        return "none"
    return f"{1000 * r.router_cpu_s / r.requests:.1f}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.engine.bench", description=__doc__)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    parser.add_argument("--workload", choices=("shared-prefix", "agentic"), default="shared-prefix")
    for field in ("agents", "steps", "system_tokens", "call_tokens", "result_tokens"):
        flag = "--" + field.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(_AGENTIC, field), help="agentic")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole target list")
    parser.add_argument(
        "--no-router-wait",
        action="store_true",
        help="send to sglang-router as soon as /health answers (its workers maybe unregistered)",
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="keep logs, decisions, per-request records"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="default: 2 for SGLang (real or sim), else 4"
    )
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--per-prefix", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=1800)
    parser.add_argument("--message-tokens", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gateway-arg", action="append", default=[], help="passed to gateway")
    parser.add_argument("--fleet", choices=("llama", "sim", "sglang"), default="llama")
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="SGLang KV pool per server (real: default 8192; --sim-engine sglang: given, the "
        "simulated twin of that fleet; absent, the slots stand-in)",
    )
    parser.add_argument(
        "--sim-max-running",
        type=int,
        default=None,
        help="--sim-engine sglang with --max-total-tokens: max running requests "
        "(default: SGLang's formula, as the real server)",
    )
    parser.add_argument(
        "--sim-profile",
        default=None,
        help=f"default {SIM_PROFILE}, or {SGLANG_SIM_PROFILE} for the twin of --fleet sglang",
    )
    parser.add_argument(
        "--sim-engine",
        choices=("llamacpp", "sglang"),
        default="llamacpp",
        help="--fleet sim: simulated llama.cpp slots (default) or SGLang's radix cache",
    )
    parser.add_argument(
        "--sim-speed", type=float, default=SIM_SPEED, help="modelled s per wall s (calibration)"
    )
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    return parser


def sglang_twin(args: argparse.Namespace) -> bool:
    """True when ``--fleet sim`` plays the real SGLang fleet (``--sim-engine sglang
    --max-total-tokens N``)."""
    return bool(
        args.fleet == "sim" and args.sim_engine == "sglang" and args.max_total_tokens is not None
    )


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``workers``, ``sim_profile`` and ``max_total_tokens`` by fleet (see ``--help``)."""
    sglang = args.fleet == "sglang" or (args.fleet == "sim" and args.sim_engine == "sglang")
    if args.workers is None:
        args.workers = 2 if sglang else 4
    if args.sim_profile is None:
        args.sim_profile = SGLANG_SIM_PROFILE if sglang_twin(args) else SIM_PROFILE
    if args.fleet == "sglang" and args.max_total_tokens is None:
        args.max_total_tokens = 8192
    return args


@contextlib.contextmanager
def start_fleet(args: argparse.Namespace, log_dir: Path) -> Iterator[list[str]]:
    """The llama.cpp fleet, the real SGLang one (``--fleet sglang``), or a simulated one
    (``--fleet sim``)."""
    if args.fleet == "sglang":
        from loadtests.engine.sglang_fleet import SGLangFleet, SGLangSettings
        from loadtests.engine.sglang_install import ensure_sglang
        from loadtests.engine.sglang_model import ensure_sglang_model
        from loadtests.engine.tiny_model import default_cache_dir

        env = ensure_sglang()
        model = ensure_sglang_model(default_cache_dir(), env.python).resolve()
        sg = SGLangSettings(env.python, model, args.max_total_tokens, SGLANG_PAGE_SIZE)
        with SGLangFleet.start(args.workers, sg, log_dir=log_dir / "sglang") as sglang_fleet:
            yield sglang_fleet.urls
        return
    if args.fleet == "llama":
        with LlamaFleet.start(
            args.workers, ensure_tiny_model(), slots=args.slots, log_dir=log_dir / "llama"
        ) as fleet:
            yield fleet.urls
        return
    prompt_tokens = args.prefix_tokens + args.message_tokens + TEMPLATE_TOKENS
    settings = SimSettings(
        profile=args.sim_profile,
        speed=args.sim_speed,
        engine=args.sim_engine,
        slots=args.slots,
        capacity_tokens=args.slots * prompt_tokens,
        max_running_requests=args.slots,
    )
    if sglang_twin(args):
        settings = replace(
            settings,
            capacity_tokens=args.max_total_tokens,
            max_running_requests=args.sim_max_running,
            page_size=SGLANG_PAGE_SIZE,
        )
    with run_sim_fleet(args.workers, settings, log_dir / "sim") as urls:
        yield urls


def workload_requests(args: argparse.Namespace, salt: int) -> list[PrefixRequest]:
    """The chosen workload's requests with text salt ``salt`` (see ``--workload``)."""
    model = SGLANG_MODEL_NAME if args.fleet == "sglang" else "tiny-llama"
    if args.workload == "agentic":
        agentic = AgenticSpec(
            agents=args.agents, steps=args.steps, system_tokens=args.system_tokens,
            call_tokens=args.call_tokens, result_tokens=args.result_tokens,
            seed=args.seed, text_salt=salt, model=model,
        )  # fmt: skip
        return agentic_requests(agentic)
    spec = SharedPrefixSpec(
        num_prefixes=args.prefixes, per_prefix=args.per_prefix,
        prefix_tokens=args.prefix_tokens, message_tokens=args.message_tokens, seed=args.seed,
        text_salt=salt, model=model,
    )  # fmt: skip
    return shared_prefix_requests(spec)


def run_plan(targets: Sequence[str], repeat: int) -> list[tuple[str, str, int]]:
    """``(target, row label, text salt)`` per run: every target once, ``repeat`` times
    over; labels get `` #k`` when ``repeat > 1``; salts 1, 2, ... (no run reuses text)."""
    plan: list[tuple[str, str, int]] = []
    for k in range(1, repeat + 1):
        for target in targets:
            label = f"{target} #{k}" if repeat > 1 else target
            plan.append((target, label, len(plan) + 1))
    return plan


def main(argv: Sequence[str] | None = None) -> None:
    """Start the fleet once, run every target, print (and optionally write) the table."""
    args = resolve_defaults(_parser().parse_args(argv))
    settle_s = SGLANG_SETTLE_S if args.fleet == "sglang" else 0.0
    targets = [t for t in args.targets.split(",") if t]
    rows: list[RunResult] = []
    with contextlib.ExitStack() as stack:
        if args.log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        else:
            log_dir = args.log_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        urls = stack.enter_context(start_fleet(args, log_dir))
        for target, label, salt in run_plan(targets, args.repeat):
            requests = workload_requests(args, salt)
            file_label = label.replace(":", "-").replace(" #", "-run")
            row = run_target(
                target, urls, requests, args.concurrency, log_dir, args.gateway_arg,
                args.slots, engine_counters=True, settle_s=settle_s, label=file_label,
                wait_router_workers_s=0.0 if args.no_router_wait else ROUTER_WORKERS_TIMEOUT_S,
            )  # fmt: skip
            row = replace(row, target=label)
            print(json.dumps(asdict(row)), flush=True)
            rows.append(row)
    table = markdown_table(rows)
    print(table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
