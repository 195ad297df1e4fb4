"""LoRA adapters under an adapter-heavy workload (issue 19): adapter-aware routing against
adapter-blind routing and sglang-router.

    python -m loadtests.micro.lora [--targets gateway:min_ttft gateway:min_ttft:blind ...]
        [--workload-arg k=v ...] [--workers 4] [--max-loaded-loras 6] ...

Workload: ``lora-tenants`` (``loadtests/workloads/lora.py``): tenants with one adapter
and one shared context each, Zipf popularity, ``model: "tiny-llama:tenantNN"``, open loop
at its arrival times (divided by ``--speed``) through ``loadtests.bench.client``.

Per target, a fresh fleet of ``--workers`` simulated SGLang workers (``python -m
simulator``, one subprocess: ``--enable-lora``, ``--max-loras-per-batch``,
``--max-loaded-loras`` below the number of adapters, ``--lora-load-s``) and a fresh
router subprocess (``loadtests.harness.gateway_proc``). Then the same warm-up for every
target: each worker is sent ``POST /load_lora_adapter`` for every adapter, in an order
that leaves worker ``k`` holding ``--max-loaded-loras`` adapters striped by popularity
(tenants ``k``, ``k + workers``, ...: the popular ones start loaded, spread over the
workers, the tail starts evicted everywhere), so
every worker has loaded every adapter once and SGLang's implicit reload serves any of
them there (an adapter never loaded is a 400). The loads go in rounds of
``--max-loaded-loras``; for this gateway each round waits until its ``/workers`` shows
what every worker holds, since it can load an adapter elsewhere only from a path it saw
loaded (``gateway/routing/lora.py``). Then ``/flush_cache`` everywhere, the workers'
counters, the replay, the counters again.

Targets: ``gateway:POLICY`` (adapter-aware, the default ``lora.affinity``),
``gateway:POLICY:blind`` (``--no-lora-affinity``), ``sglang-router:POLICY`` (0.3.2; it
forwards ``model`` untouched and ignores adapters). The gateways run with
``--health-check-interval-secs`` ``--health-interval`` (the adapters each worker holds are
re-read after every health pass).

``--rounds`` (2) runs every target that many times, the order reversed every other round,
and pools each target's rounds. Reported per target: TTFT p50/p90 over the pooled requests
(modelled seconds: wall x ``--speed``), their ratio to the first target's, each round's
p90, the cached fraction from the workers' own counters
(``sglang:cached_tokens_total / sglang:prompt_tokens_total``), requests per worker, the
adapter loads (implicit reloads included) / of them implicit reloads / evictions per worker
(the simulator's ``sim_lora_counters`` in ``/server_info``; warm-up excluded), errors, the
machine's highest 1-minute load average after a round of the target. Every request's
outcome (adapter, worker, TTFT, cached tokens) goes to
``<results>/<target>-round<k>-outcomes.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests.bench.client import Outcome, ReplayItem, replay
from loadtests.bench.workers import WorkerDelta, deltas, flush_all, read_all
from loadtests.harness.gateway_proc import run_gateway
from loadtests.harness.ports import free_port
from loadtests.harness.sim_fleet import SimSettings, run_sim_fleet
from loadtests.harness.stats import percentile
from loadtests.workloads import Workload, create_workload
from loadtests.workloads.lora import NAME, adapter_name, adapter_path, warmup_orders

MODEL = "tiny-llama"  # SimSettings' --served-model-name
DEFAULT_TARGETS = (
    "gateway:min_ttft",
    "gateway:cache_aware",
    "gateway:min_ttft:blind",
    "gateway:round_robin:blind",
    "sglang-router:cache_aware",
    "sglang-router:round_robin",
)
COUNTERS = ("loads", "reloads", "evictions")


@dataclass(frozen=True, slots=True)
class LoraSim(SimSettings):
    """The simulator's settings plus LoRA and an empty model directory (so sglang-router
    never fetches a tokenizer)."""

    model_path: str = ""
    max_loras_per_batch: int = 4
    max_loaded_loras: int = 6
    lora_load_s: float = 0.2

    def args(self, k: int) -> list[str]:
        return [
            *SimSettings.args(self, k), "--model-path", self.model_path, "--enable-lora",
            "--max-loras-per-batch", str(self.max_loras_per_batch),
            "--max-loaded-loras", str(self.max_loaded_loras),
            "--lora-load-s", str(self.lora_load_s),
        ]  # fmt: skip


@dataclass
class TargetResult:
    target: str
    outcomes: list[Outcome]
    wall_s: float
    workers: list[WorkerDelta]
    lora: list[dict[str, int]]  # per worker: COUNTERS during the replay
    load_1m: float
    warmup_s: float
    errors: dict[str, int] = field(default_factory=dict)
    round_p90s: list[float] = field(default_factory=list)  # merged: each round's TTFT p90
    speed: float = 1.0


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, json=body) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {answer}")
        return answer


async def _gateway_sees(
    session: aiohttp.ClientSession, gateway: str, held: dict[str, set[str]], timeout_s: float
) -> None:
    """Until the gateway's ``/workers`` shows ``held`` (worker URL → adapters)."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(gateway + "/workers") as resp:
            seen = {
                w["url"]: set(w.get("lora_adapters") or ()) for w in (await resp.json())["workers"]
            }
        if all(seen.get(url) == names for url, names in held.items()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway sees {seen}, the workers hold {held}")
        await asyncio.sleep(0.1)


async def warm_up(
    urls: Sequence[str], adapters: Sequence[str], slots: int, gateway: str | None
) -> None:
    """Every adapter loaded once on every worker (:func:`warmup_orders`), in rounds of
    ``slots``; with ``gateway``, each round waits until it has seen the round's state."""
    orders = warmup_orders(adapters, len(urls), slots)
    held: dict[str, set[str]] = {}
    async with aiohttp.ClientSession() as session:

        async def load(url: str, names: list[str]) -> None:
            for name in names:
                body = {"lora_name": name, "lora_path": adapter_path(name)}
                answer = await _post(session, url + "/load_lora_adapter", body)
                held[url] = set(answer["loaded_adapters"])

        for start in range(0, len(adapters), slots):
            rounds = [order[start : start + slots] for order in orders]
            await asyncio.gather(*(load(u, r) for u, r in zip(urls, rounds, strict=True)))
            if gateway is not None:
                await _gateway_sees(session, gateway, held, 30.0)


async def lora_counters(urls: Sequence[str]) -> list[dict[str, int]]:
    async with aiohttp.ClientSession() as session:
        out = []
        for url in urls:
            async with session.get(url + "/server_info") as resp:
                info = await resp.json()
            out.append({k: int(info["sim_lora_counters"][k]) for k in COUNTERS})
        return out


def router_args(router: str, blind: bool, health_interval: float) -> list[str]:
    if router == "gateway":
        extra = ["--log-level", "warning", "--health-check-interval-secs", f"{health_interval:g}"]
        return [*extra, "--no-lora-affinity"] if blind else extra
    return [
        "--log-level", "warn", "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()),
    ]  # fmt: skip


def parse_target(target: str) -> tuple[str, str, bool]:
    """``router:policy[:blind]`` → (router, policy, blind)."""
    router, _, rest = target.partition(":")
    policy, _, flag = rest.partition(":")
    if router not in ("gateway", "sglang-router") or not policy or flag not in ("", "blind"):
        raise ValueError(f"bad target {target!r}: gateway:POLICY[:blind] or sglang-router:POLICY")
    if flag and router != "gateway":
        raise ValueError(f"{target!r}: sglang-router is adapter-blind already")
    return router, policy, bool(flag)


def run_target(
    target: str,
    items: Sequence[ReplayItem],
    adapters: Sequence[str],
    settings: LoraSim,
    args: argparse.Namespace,
    log_dir: Path,
) -> TargetResult:
    router, policy, blind = parse_target(target)
    slug = target.replace(":", "-")
    extra = router_args(router, blind, args.health_interval)
    with (
        run_sim_fleet(args.workers, settings, log_dir / slug) as urls,
        run_gateway(urls, policy, log_dir / f"{slug}.log", extra, router=router) as proc,
    ):

        async def run() -> TargetResult:
            t0 = time.perf_counter()
            gateway = proc.url if router == "gateway" else None
            await warm_up(urls, adapters, settings.max_loaded_loras, gateway)
            warmup = time.perf_counter() - t0
            await flush_all(urls)
            before, lora_before = await read_all(urls), await lora_counters(urls)
            outcomes, wall = await replay(items, lambda _: proc.url, args.max_seconds, args.timeout)
            after, lora_after = await read_all(urls), await lora_counters(urls)
            lora = [
                {k: a[k] - b[k] for k in COUNTERS}
                for b, a in zip(lora_before, lora_after, strict=True)
            ]
            errors: dict[str, int] = {}
            for o in outcomes:
                if not o.ok:
                    key = f"{o.status} {o.error[:80]}"
                    errors[key] = errors.get(key, 0) + 1
            return TargetResult(
                target, outcomes, wall, deltas(urls, before, after), lora,
                os.getloadavg()[0], warmup, errors, [], args.speed,
            )  # fmt: skip

        return asyncio.run(run())


def merge(results: Sequence[TargetResult]) -> TargetResult:
    """One target's rounds pooled: outcomes together, counters summed per worker."""
    first = results[0]
    workers = [
        WorkerDelta(
            url=f"worker {i}",
            prompt_tokens=sum(r.workers[i].prompt_tokens for r in results),
            cached_tokens=sum(r.workers[i].cached_tokens for r in results),
            requests=sum(r.workers[i].requests for r in results),
            prefill_busy_s=sum(r.workers[i].prefill_busy_s for r in results),
        )
        for i in range(len(first.workers))
    ]
    lora = [
        {k: sum(r.lora[i][k] for r in results) for k in COUNTERS} for i in range(len(first.lora))
    ]
    errors: dict[str, int] = {}
    for r in results:
        for key, n in r.errors.items():
            errors[key] = errors.get(key, 0) + n
    return TargetResult(
        first.target, [o for r in results for o in r.outcomes], sum(r.wall_s for r in results),
        workers, lora, max(r.load_1m for r in results), sum(r.warmup_s for r in results),
        errors, [percentile(_ttfts(r, r.speed), 90, "linear") for r in results], first.speed,
    )  # fmt: skip


def prepare(workload: Workload, speed: float, max_output: int) -> list[ReplayItem]:
    """Bodies serialised (``model: "tiny-llama:tenantNN"``), arrivals in wall time."""
    return [
        ReplayItem(
            r.index,
            r.arrival_s / speed,
            orjson.dumps(r.body(model=MODEL) | {"max_tokens": min(r.max_tokens, max_output)}),
        )
        for r in workload.requests
    ]


def _ttfts(r: TargetResult, speed: float) -> list[float]:
    return [(o.ttft_s or 0.0) * speed for o in r.outcomes if o.ok and o.ttft_s is not None]


def report(results: Sequence[TargetResult], speed: float) -> str:
    """The table: one row per target, ratios to the first row."""
    lines = [
        "| target | TTFT p50 (s) | p90 (s) | p50 / p90 vs first | p90 per round (s) | "
        "cached fraction | requests per worker | adapter loads / implicit reloads / "
        "evictions per worker | errors | load 1m (max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base: tuple[float, float] | None = None
    for r in results:
        ttfts = _ttfts(r, speed)
        p50, p90 = percentile(ttfts, 50, "linear"), percentile(ttfts, 90, "linear")
        base = base or (p50, p90)
        prompt = sum(w.prompt_tokens for w in r.workers)
        cached = sum(w.cached_tokens for w in r.workers) / max(1.0, prompt)
        per_worker = " / ".join(f"{w.requests:.0f}" for w in r.workers)
        lora = " · ".join("/".join(str(c[k]) for k in COUNTERS) for c in r.lora)
        total = "/".join(str(sum(c[k] for c in r.lora)) for k in COUNTERS)
        errors = sum(r.errors.values())
        lines.append(
            f"| {r.target} | {p50:.3f} | {p90:.3f} | {p50 / base[0]:.2f} / {p90 / base[1]:.2f} "
            f"| {' / '.join(f'{x:.3f}' for x in r.round_p90s)} | {cached:.3f} | {per_worker} "
            f"| {lora} (Σ {total}) | {errors} | {r.load_1m:.1f} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.micro.lora", description=__doc__.split("\n")[0]
    )
    p.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS),
                   help="gateway:POLICY[:blind], sglang-router:POLICY")  # fmt: skip
    p.add_argument("--workload-arg", action="append", default=[], metavar="K=V",
                   help=f"a parameter of the {NAME} workload")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--speed", type=float, default=2.0, help="modelled s per wall s")
    p.add_argument("--capacity-tokens", type=int, default=20000, help="KV tokens per worker")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--max-loras-per-batch", type=int, default=4)
    p.add_argument("--max-loaded-loras", type=int, default=6)
    p.add_argument("--lora-load-s", type=float, default=0.2, help="modelled s per load")
    p.add_argument("--max-output-tokens", type=int, default=16, help="cap on every output")
    p.add_argument("--max-seconds", type=float, default=60.0, help="stop sending after (wall s)")
    p.add_argument("--timeout", type=float, default=60.0, help="per request (wall s)")
    p.add_argument("--health-interval", type=float, default=1.0, help="the gateways' (s)")
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
    workload = create_workload(NAME, [f"seed={args.seed}", *args.workload_arg])
    p = workload.params
    adapters = [adapter_name(t) for t in range(p["tenants"])]
    if args.max_loaded_loras >= len(adapters):
        print("note: --max-loaded-loras >= adapters: placement does not matter", file=sys.stderr)
    items = prepare(workload, args.speed, args.max_output_tokens)
    adapters_of = {r.index: r.adapter for r in workload.requests}
    log_dir = Path(args.results or tempfile.mkdtemp(prefix="lora_bench_"))
    model_dir = tempfile.mkdtemp(prefix="lora_model_")
    settings = LoraSim(
        profile=args.profile,
        speed=args.speed,
        capacity_tokens=args.capacity_tokens,
        max_running_requests=args.max_running_requests,
        model_path=model_dir,
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        lora_load_s=args.lora_load_s,
    )
    sent = sum(1 for it in items if it.at_s <= args.max_seconds)
    print(
        f"{NAME}: {p['tenants']} tenants/adapters, Zipf s={p['zipf_s']:g}, context "
        f"{p['context_len']} + {p['questions_per_tenant']} questions x {p['question_len']} "
        f"tokens (working set {p['working_set_tokens']:,} vs {args.workers} x "
        f"{args.capacity_tokens:,} KV), {p['request_rate']:g} req/s modelled, "
        f"{len(items)} requests ({sent} sent within {args.max_seconds:g} wall s), output "
        f"{min(p['output_len'], args.max_output_tokens)} tokens; {args.workers} workers "
        f"{args.profile} at speed {args.speed:g}, max_running {args.max_running_requests}, "
        f"max_loras_per_batch {args.max_loras_per_batch}, max_loaded_loras "
        f"{args.max_loaded_loras}, lora_load_s {args.lora_load_s:g}; load average before "
        f"{os.getloadavg()[0]:.1f}; logs {log_dir}",
        flush=True,
    )
    runs: dict[str, list[TargetResult]] = {}
    for k in range(args.rounds):
        # the order reversed every other round: a busy spell of the shared machine falls
        # on different targets
        for target in args.targets if k % 2 == 0 else args.targets[::-1]:
            print(f"[lora] round {k + 1}: {target} ...", file=sys.stderr, flush=True)
            try:
                r = run_target(target, items, adapters, settings, args, log_dir)
            except RuntimeError as exc:
                print(f"[lora] {target} did not run: {exc}"[:600], file=sys.stderr, flush=True)
                continue
            runs.setdefault(target, []).append(r)
            dump = [
                {"index": o.index, "adapter": adapters_of[o.index], "worker": o.worker,
                 "ttft_s": o.ttft_s, "cached": o.cached_tokens, "prompt": o.prompt_tokens,
                 "sent_s": o.sent_s, "status": o.status}
                for o in r.outcomes
            ]  # fmt: skip
            name = f"{target.replace(':', '-')}-round{k + 1}-outcomes.json"
            (log_dir / name).write_bytes(orjson.dumps(dump))
            ttfts = _ttfts(r, args.speed)
            print(
                f"[lora]   ok {sum(o.ok for o in r.outcomes)}/{len(r.outcomes)}, warm-up "
                f"{r.warmup_s:.1f} s, TTFT p50 {percentile(ttfts, 50, 'linear'):.3f} p90 "
                f"{percentile(ttfts, 90, 'linear'):.3f} s, errors {r.errors or 'none'}, "
                f"load {r.load_1m:.1f}",
                file=sys.stderr,
                flush=True,
            )
    results = [merge(runs[t]) for t in args.targets if t in runs]
    print(report(results, args.speed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
