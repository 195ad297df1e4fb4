"""Two models behind one router (issue 19): model-aware routing against model-blind.

    python -m loadtests.micro.models [--targets gateway:min_ttft sglang-router:cache_aware ...]
        [--workers-per-model 2] [--workload-arg k=v ...] [--rounds 2]

Fleet per target and round: ``--workers-per-model`` simulated SGLang workers serving
``model-a`` and as many serving ``model-b`` (two ``python -m simulator`` subprocesses,
``--served-model-name``; an empty ``--model-path`` so that sglang-router fetches no
tokenizer), a fresh router subprocess in front of all of them.

Workload: ``multi-turn`` twice, one per model (``seed`` 1 for ``model-a``, 2 for
``model-b``: each model its own system prompt and conversations), merged by arrival time;
every session uses one model. Open loop at the arrival times (÷ ``--speed``) through
``loadtests.bench.client``. Each model's requests ask for a fixed number of output tokens
(``--output-tokens A B``, distinct, ``ignore_eos``), so that a worker's own counters say
exactly how many of each model's requests it served: ``a + b`` requests
(``sglang:num_requests_total``) and ``a x A + b x B`` generated tokens
(``sglang:generation_tokens_total``). A request served by a worker of the other model is
*wrong-model*: SGLang answers it with its own model (and echoes the requested name), so
nothing tells the client. For this gateway the ``x-gateway-worker`` header of every answer
says the same per request (shown beside, as a check).

Targets: ``gateway:POLICY`` (model-aware: with two models behind it a request goes only
to workers serving its ``model``), ``sglang-router:POLICY`` (0.3.2; plain mode routes over
every worker whatever the ``model``), any target ``+FLAG`` for extra router flags
(``sglang-router:cache_aware+--enable-igw``, 0.3.2's multi-model mode). A target whose
router does not start is reported with the reason.

Reported per target, rounds pooled: TTFT p50 / p99 (modelled s: wall x ``--speed``), the
cached fraction from the workers' counters (``sglang:cached_tokens_total /
sglang:prompt_tokens_total``), requests per worker (``a/b`` per model), the wrong-model
share, errors, the machine's 1-minute load average after the target's last round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests.bench.client import Outcome, ReplayItem, replay
from loadtests.bench.workers import family_sum, flush_all
from loadtests.engine.probe import parse_prometheus
from loadtests.harness.gateway_proc import run_gateway
from loadtests.harness.ports import free_port
from loadtests.harness.sim_fleet import SimSettings, run_sim_fleet
from loadtests.harness.stats import percentile
from loadtests.workloads import create_workload
from loadtests.workloads.base import WorkloadRequest

MODELS = ("model-a", "model-b")
SEEDS = (1, 2)  # each model's multi-turn workload seed
DEFAULT_TARGETS = (
    "gateway:min_ttft",
    "gateway:cache_aware",
    "sglang-router:cache_aware",
    "sglang-router:round_robin",
    "sglang-router:cache_aware+--enable-igw",
)
DEFAULT_WORKLOAD = (
    "sessions=32", "turns=5", "system_prompt_len=1024", "user_len=128", "answer_len=128",
    "session_rate=1", "think_time_s=4",
)  # fmt: skip
COUNTERS = {
    "prompt": "sglang:prompt_tokens_total",
    "cached": "sglang:cached_tokens_total",
    "requests": "sglang:num_requests_total",
    "generated": "sglang:generation_tokens_total",
}


@dataclass(frozen=True, slots=True)
class ModelSim(SimSettings):
    """The simulator's settings, serving ``served_model_name`` from an empty directory."""

    served_model_name: str = MODELS[0]
    model_path: str = ""

    def args(self, k: int) -> list[str]:
        args = SimSettings.args(self, k)
        args[args.index("--served-model-name") + 1] = self.served_model_name
        return [*args, "--model-path", self.model_path] if self.model_path else args


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the two-model workload: its model and its body's bytes."""

    item: ReplayItem
    model: str


def two_model_workload(
    workload_args: Sequence[str], outputs: Mapping[str, int]
) -> list[tuple[WorkloadRequest, str]]:
    """``multi-turn`` once per model (its own seed, sessions renamed ``model/sN``),
    merged by arrival, re-indexed; each request's output is its model's."""
    merged: list[tuple[WorkloadRequest, str]] = []
    for model, seed in zip(MODELS, SEEDS, strict=True):
        wl = create_workload("multi-turn", [*workload_args, f"seed={seed}"])
        for r in wl.requests:
            renamed = dataclasses.replace(
                r, max_tokens=outputs[model], session_id=f"{model}/{r.session_id}"
            )
            merged.append((renamed, model))
    merged.sort(key=lambda rm: (rm[0].arrival_s, rm[1]))
    return [(dataclasses.replace(r, index=i), m) for i, (r, m) in enumerate(merged)]


def prepare(workload: Sequence[tuple[WorkloadRequest, str]], speed: float) -> list[Request]:
    return [
        Request(ReplayItem(r.index, r.arrival_s / speed, orjson.dumps(r.body(model=m))), m)
        for r, m in workload
    ]


@dataclass
class WorkerCount:
    """One worker's counters over a run, and how many of each model's requests it
    served (solved from its requests and generated tokens)."""

    url: str
    model: str  # the model it serves
    counters: dict[str, float]
    served: dict[str, float] = field(default_factory=dict)  # model -> requests
    exact: bool = True  # the solution is whole and non-negative


def served_by_model(
    requests: float, generated: float, outputs: Mapping[str, int]
) -> dict[str, float]:
    """(requests of model a, of model b) such that ``a + b = requests`` and
    ``a x out_a + b x out_b = generated``."""
    out_a, out_b = (outputs[m] for m in MODELS)
    a = (out_b * requests - generated) / (out_b - out_a)
    return {MODELS[0]: a, MODELS[1]: requests - a}


async def read_counters(urls: Sequence[str]) -> list[dict[str, float]]:
    async with aiohttp.ClientSession() as session:

        async def one(url: str) -> dict[str, float]:
            async with session.get(url + "/metrics", raise_for_status=True) as resp:
                samples = parse_prometheus(await resp.text())
            return {k: family_sum(samples, fam) for k, fam in COUNTERS.items()}

        return list(await asyncio.gather(*(one(u) for u in urls)))


@dataclass
class TargetResult:
    target: str
    outcomes: list[Outcome] = field(default_factory=list)
    models: dict[int, str] = field(default_factory=dict)  # request index -> model
    workers: list[WorkerCount] = field(default_factory=list)
    load_1m: float = 0.0
    rounds: int = 0
    failure: str = ""  # why the router did not run
    url_model: dict[str, str] = field(default_factory=dict)  # worker URL -> its model


def router_args(router: str) -> list[str]:
    if router == "gateway":
        return ["--log-level", "warning"]
    return [
        "--log-level", "warn", "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()),
    ]  # fmt: skip


def target_slug(target: str) -> str:
    """The target's name in file names (its router's log: ``<results>/<slug>.log``)."""
    return "".join(c if c.isalnum() or c in "._" else "-" for c in target)


def parse_target(target: str) -> tuple[str, str, list[str]]:
    """``router:policy[+FLAG...]`` → (router, policy, extra flags)."""
    router, _, spec = target.partition(":")
    policy, *flags = spec.split("+")
    if router not in ("gateway", "sglang-router") or not policy:
        raise ValueError(f"bad target {target!r}: gateway:POLICY or sglang-router:POLICY[+FLAG]")
    return router, policy, flags


def run_target(
    target: str,
    requests: Sequence[Request],
    outputs: Mapping[str, int],
    settings: Sequence[ModelSim],
    args: argparse.Namespace,
    log_dir: Path,
) -> TargetResult:
    router, policy, flags = parse_target(target)
    slug = target_slug(target)
    items = [r.item for r in requests]
    with contextlib.ExitStack() as stack:
        fleets = [
            stack.enter_context(
                run_sim_fleet(args.workers_per_model, s, log_dir / slug / s.served_model_name)
            )
            for s in settings
        ]
        urls = [u for fleet in fleets for u in fleet]
        url_model = {u: s.served_model_name for fleet, s in zip(fleets, settings, strict=True)
                     for u in fleet}  # fmt: skip
        extra = [*router_args(router), *flags]
        proc = stack.enter_context(
            run_gateway(urls, policy, log_dir / f"{slug}.log", extra, router=router)
        )

        async def run() -> TargetResult:
            await flush_all(urls)
            before = await read_counters(urls)
            outcomes, _ = await replay(items, lambda _: proc.url, args.max_seconds, args.timeout)
            after = await read_counters(urls)
            workers = []
            for url, b, a in zip(urls, before, after, strict=True):
                delta = {k: a[k] - b[k] for k in COUNTERS}
                served = served_by_model(delta["requests"], delta["generated"], outputs)
                whole = all(v >= 0 and abs(v - round(v)) < 1e-6 for v in served.values())
                workers.append(WorkerCount(url, url_model[url], delta, served, whole))
            return TargetResult(target, outcomes, {r.item.index: r.model for r in requests},
                                workers, os.getloadavg()[0], 1, "", url_model)  # fmt: skip

        result = asyncio.run(run())
    return result


def merge(results: Sequence[TargetResult]) -> TargetResult:
    """One target's rounds pooled: outcomes together, worker counters summed by position
    (worker ``i`` serves the same model in every round)."""
    first = results[0]
    workers = []
    for i, w in enumerate(first.workers):
        same = [r.workers[i] for r in results]
        counters = {k: sum(x.counters[k] for x in same) for k in COUNTERS}
        served = {m: sum(x.served[m] for x in same) for m in MODELS}
        workers.append(WorkerCount(f"worker {i}", w.model, counters, served,
                                   all(x.exact for x in same)))  # fmt: skip
    url_model = {u: m for r in results for u, m in r.url_model.items()}
    return TargetResult(
        first.target, [o for r in results for o in r.outcomes], first.models, workers,
        max(r.load_1m for r in results), len(results), "", url_model,
    )  # fmt: skip


def wrong_share(r: TargetResult) -> float:
    """Requests served by a worker of the other model / requests served (counters)."""
    total = sum(sum(w.served.values()) for w in r.workers)
    wrong = sum(v for w in r.workers for m, v in w.served.items() if m != w.model)
    return wrong / total if total else float("nan")


def header_wrong_share(r: TargetResult) -> float | None:
    """The same from the ``x-gateway-worker`` headers (None: the router sets none)."""
    named = [o for o in r.outcomes if o.ok and o.worker]
    if not named:
        return None
    wrong = sum(1 for o in named if r.url_model.get(o.worker or "") != r.models[o.index])
    return wrong / len(named)


def _ttfts(r: TargetResult, speed: float) -> list[float]:
    return [(o.ttft_s or 0.0) * speed for o in r.outcomes if o.ok and o.ttft_s is not None]


def summary(r: TargetResult, speed: float) -> dict[str, Any]:
    """One target's figures (``results.json``; the table's row)."""
    if r.failure:
        return {"target": r.target, "failure": r.failure}
    ttfts = _ttfts(r, speed)
    prompt = sum(w.counters["prompt"] for w in r.workers)
    return {
        "target": r.target,
        "ok": sum(o.ok for o in r.outcomes),
        "sent": len(r.outcomes),
        "rounds": r.rounds,
        "ttft_p50_s": percentile(ttfts, 50, "linear"),
        "ttft_p99_s": percentile(ttfts, 99, "linear"),
        "cached_fraction": sum(w.counters["cached"] for w in r.workers) / max(1.0, prompt),
        "workers": [
            {"model": w.model, "served": w.served, "exact": w.exact, **w.counters}
            for w in r.workers
        ],
        "wrong_model_share": wrong_share(r),
        "wrong_model_share_headers": header_wrong_share(r),
        "load_1m": r.load_1m,
    }


def report(results: Sequence[TargetResult], speed: float) -> str:
    lines = [
        "| target | ok / sent | TTFT p50 (s) | p99 (s) | cached fraction | model-a / model-b "
        "requests per worker (its model) | wrong-model share (counters) | (headers) | load 1m |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = summary(r, speed)
        if r.failure:
            lines.append(f"| {r.target} | did not run: {r.failure} | | | | | | | |")
            continue
        per = " · ".join(
            f"{w['served'][MODELS[0]]:.0f}/{w['served'][MODELS[1]]:.0f} ({w['model'][-1]})"
            + ("" if w["exact"] else " inexact")
            for w in s["workers"]
        )
        header = s["wrong_model_share_headers"]
        lines.append(
            f"| {r.target} | {s['ok']} / {s['sent']} | {s['ttft_p50_s']:.3f} "
            f"| {s['ttft_p99_s']:.3f} | {s['cached_fraction']:.3f} | {per} "
            f"| {s['wrong_model_share']:.3f} | {'n/a' if header is None else f'{header:.3f}'} "
            f"| {s['load_1m']:.1f} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.micro.models", description=__doc__.split("\n")[0]
    )
    p.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS),
                   help="gateway:POLICY, sglang-router:POLICY, +FLAG for router flags")  # fmt: skip
    p.add_argument("--workload-arg", action="append", default=[], metavar="K=V",
                   help="a parameter of both models' multi-turn workloads")  # fmt: skip
    p.add_argument("--workers-per-model", type=int, default=2)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--speed", type=float, default=2.0, help="modelled s per wall s")
    p.add_argument("--capacity-tokens", type=int, default=32768, help="KV tokens per worker")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--output-tokens", type=int, nargs=2, default=[8, 12], metavar=("A", "B"),
                   help="each model's output tokens per request (distinct)")  # fmt: skip
    p.add_argument("--max-seconds", type=float, default=120.0, help="stop sending after (wall s)")
    p.add_argument("--timeout", type=float, default=60.0, help="per request (wall s)")
    p.add_argument("--rounds", type=int, default=2, help="runs per target, order alternated")
    p.add_argument("--results", default="", help="log folder (default: a temp directory)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        for t in args.targets:
            parse_target(t)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.output_tokens[0] == args.output_tokens[1]:
        raise SystemExit("--output-tokens: the two models' outputs must differ")
    outputs = dict(zip(MODELS, args.output_tokens, strict=True))
    workload = two_model_workload([*DEFAULT_WORKLOAD, *args.workload_arg], outputs)
    requests = prepare(workload, args.speed)
    log_dir = Path(args.results or tempfile.mkdtemp(prefix="models_bench_"))
    model_dir = tempfile.mkdtemp(prefix="models_model_")
    settings = [
        ModelSim(profile=args.profile, speed=args.speed, capacity_tokens=args.capacity_tokens,
                 max_running_requests=args.max_running_requests, served_model_name=m,
                 model_path=model_dir)
        for m in MODELS
    ]  # fmt: skip
    per_model = {m: sum(1 for _, x in workload if x == m) for m in MODELS}
    span = workload[-1][0].arrival_s if workload else 0.0
    print(
        f"two models, {args.workers_per_model} workers each ({args.profile}, speed "
        f"{args.speed:g}, {args.capacity_tokens:,} KV tokens, max_running "
        f"{args.max_running_requests}); multi-turn per model "
        f"({', '.join([*DEFAULT_WORKLOAD, *args.workload_arg])}): {len(workload)} requests "
        f"({', '.join(f'{m} {n}' for m, n in per_model.items())}) over {span:.1f} modelled s, "
        f"outputs {outputs}; load average before {os.getloadavg()[0]:.1f}; logs {log_dir}",
        flush=True,
    )
    runs: dict[str, list[TargetResult]] = {}
    failed: dict[str, str] = {}
    for k in range(args.rounds):
        for target in args.targets if k % 2 == 0 else args.targets[::-1]:
            if target in failed:
                continue
            print(f"[models] round {k + 1}: {target} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                r = run_target(target, requests, outputs, settings, args, log_dir)
            except RuntimeError as exc:
                failed[target] = _why(log_dir / f"{target_slug(target)}.log", str(exc))
                print(f"[models] {target} did not run: {exc}"[:1500], file=sys.stderr, flush=True)
                continue
            runs.setdefault(target, []).append(r)
            ttfts = _ttfts(r, args.speed)
            print(
                f"[models]   ok {sum(o.ok for o in r.outcomes)}/{len(r.outcomes)} in "
                f"{time.perf_counter() - started:.0f} s, TTFT p50 "
                f"{percentile(ttfts, 50, 'linear'):.3f} s, wrong-model {wrong_share(r):.3f}, "
                f"load {r.load_1m:.1f}",
                file=sys.stderr,
                flush=True,
            )
    results = [
        merge(runs[t]) if t in runs else TargetResult(t, failure=failed.get(t, "no run"))
        for t in args.targets
    ]
    print(report(results, args.speed))
    data = {"per_model_requests": per_model, "outputs": outputs,
            "targets": [summary(r, args.speed) for r in results]}  # fmt: skip
    (log_dir / "results.json").write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    return 0


def _why(log: Path, message: str) -> str:
    """Why a router did not start: its log's panic or error line (a Rust panic's message
    is on the line after ``panicked at``), else the first line of ``message``."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    for needle in ("panicked at", "Error:", "ERROR"):
        for i, ln in enumerate(lines):
            if needle in ln:
                found = lines[i + 1] if needle == "panicked at" and i + 1 < len(lines) else ln
                return found.replace("|", "/")[:300]
    first = message.strip().splitlines()
    return (first[0] if first else "unknown").replace("|", "/")[:300]


if __name__ == "__main__":
    sys.exit(main())
