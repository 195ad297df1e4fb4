"""Live PD benchmark: prefill/decode disaggregation against a regular fleet of the same size.

    python -m loadtests.bench.pd [--prefill 2] [--decode 2] [--speed 1] [--rounds 3]
        [--workload NAME:k=v,...] [--arms ARM ...] [--results DIR]

One run starts, as subprocesses on 127.0.0.1 (``loadtests.harness.sim_fleet``), the two
fleets every arm is measured on, and keeps them for the whole run:

* **PD**: N simulated SGLang prefill workers (``--disaggregation-mode prefill``, worker
  i's bootstrap server on a free port P + i) in one process and M decode workers
  (``--disaggregation-mode decode``) in another (docs/PD.md section 8);
* **regular**: N + M ordinary simulated SGLang workers, in two processes of N and M
  workers (the same split of the simulator's CPU as the PD fleet's).

Same profile, KV capacity, running-request cap and speed everywhere. An arm is
``FLEET:ROUTER:POLICY[/DECODE_POLICY]``:

* ``pd:gateway:min_ttft/least_load``: this gateway, ``--pd-disaggregation --prefill URL
  PORT ... --decode URL ... --prefill-policy min_ttft --decode-policy least_load`` (its
  defaults); ``pd:gateway:cache_aware/least_load`` the like-for-like prefill rule;
* ``pd:sglang-router:cache_aware/round_robin``: sglang-router 0.3.2 with the same
  ``--pd-disaggregation --prefill URL PORT ... --decode URL ...`` flags and
  ``--prefill-policy cache_aware --decode-policy round_robin``;
* ``regular:gateway:min_ttft``, ``regular:sglang-router:cache_aware``: the same routers
  with ``--worker-urls`` over the regular fleet.

The bootstrap ports given to both routers are the ones each prefill's ``/server_info``
reports (``disaggregation_bootstrap_port``). Each arm's router is a fresh process, ready
when its ``/readiness`` counts every worker healthy, stopped by PID after the run. Before
each run the fleet's caches are flushed and its counters read; the seeded workload is sent
open loop at its arrival times (``loadtests.bench.client``: streamed chat completions
with usage, TTFT = the first event), bounded by ``--max-requests``, ``--max-seconds``
(no send after) and ``--timeout``; then the counters are read again. ``--rounds K``
repeats every arm, the order reversed every other round, and pools the outcomes
(``loadtests.bench.report.merge``).

Figures per arm: TTFT p50 / p99 (wall ms; x ``--speed`` for modelled time), pooled and
per round with the median of the rounds' (robust to a busy spell of the shared machine
falling on one round), and the pooled ones' ratios to the sglang-router PD arm's; TPOT
p50 (per request, (last byte - first event) / (completion tokens - 1), wall ms); the
**prefill-side hit rate** from the responses' usage (Σ cached / Σ prompt tokens; on PD the
decode reports the prefill's hit, docs/PD.md section 4) and, as a cross-check, from the
prefill workers' own counters (every worker's on the regular fleet); completed requests
per second (first send to last answer);
requests per prefill and per decode worker; the router process's CPU time per request
(user + system, during the run: this gateway is Python, sglang-router Rust, and the
machine is shared); failures; the machine's 1-minute load.

Output in ``--results`` (default ``results/bench-pd-<UTC time>/``): ``report.md``,
``results.json``, every request's outcome per arm and round
(``<arm>-<round>-outcomes.json``: sent time, status, TTFT, latency, usage) and the
routers' and workers' logs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.bench.client import Outcome, ReplayItem, replay
from loadtests.bench.live import BenchSim, _code_state, parse_spec, prepare, router_available
from loadtests.bench.report import ContenderResult, merge
from loadtests.bench.workers import WorkerDelta, deltas, flush_all, read_all
from loadtests.harness.gateway_proc import ROUTER_MODULES, router_ready
from loadtests.harness.ports import free_port, free_port_range
from loadtests.harness.procs import NotReady, cpu_seconds, http_get, running, wait_until
from loadtests.harness.sim_fleet import run_sim_fleet
from loadtests.harness.stats import percentile
from loadtests.workloads import create_workload

DEFAULT_ARMS = (
    "pd:gateway:min_ttft/least_load",
    "pd:gateway:cache_aware/least_load",
    "pd:sglang-router:cache_aware/round_robin",
    "regular:gateway:min_ttft",
    "regular:sglang-router:cache_aware",
)
DEFAULT_WORKLOAD = (
    "generated-shared-prefix:num_groups=16,prompts_per_group=16,output_len=32,request_rate=16"
)
FLEETS = ("pd", "regular")


@dataclass(frozen=True, slots=True)
class Arm:
    """One row: which fleet, which router, which policies (``FLEET:ROUTER:POLICY[/DECODE]``)."""

    spec: str
    fleet: str
    router: str
    policy: str
    decode_policy: str = ""

    @classmethod
    def parse(cls, spec: str) -> Arm:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in FLEETS or parts[1] not in ROUTER_MODULES:
            raise ValueError(f"bad arm {spec!r}: FLEET:ROUTER:POLICY[/DECODE_POLICY]")
        fleet, router, policies = parts
        policy, _, decode = policies.partition("/")
        if not policy or (fleet == "pd") != bool(decode):
            raise ValueError(f"bad arm {spec!r}: a pd arm names both policies, a regular one one")
        return cls(spec, fleet, router, policy, decode)


@dataclass(frozen=True, slots=True)
class Fleets:
    """The running workers: the PD fleet (prefills with their bootstrap ports, decodes) and
    the regular fleet."""

    prefill: list[str]
    bootstrap_ports: list[int]
    decode: list[str]
    regular: list[str]

    def of(self, arm: Arm) -> list[str]:
        return [*self.prefill, *self.decode] if arm.fleet == "pd" else self.regular


@dataclass
class ArmResult:
    """One arm's pooled rounds: the client's outcomes and the prefill side's counters
    (``result.workers``: the prefill workers on PD, every worker on the regular fleet),
    and the decode workers' counters on PD."""

    arm: Arm
    result: ContenderResult
    decode: list[WorkerDelta] = field(default_factory=list)
    per_round: list[tuple[float, float]] = field(default_factory=list)  # TTFT p50, p99 (s)
    router_cpu_s: float = 0.0  # the router process's CPU seconds, every round


def router_command(arm: Arm, fleets: Fleets, port: int) -> list[str]:
    """The router's command line: the same PD flags for this gateway and sglang-router."""
    args = [sys.executable, "-m", ROUTER_MODULES[arm.router], "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip
    if arm.router == "gateway":
        args += ["--log-level", "warning"]
    else:
        args += ["--log-level", "warn", "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(free_port())]  # fmt: skip
    if arm.fleet == "regular":
        return [*args, "--policy", arm.policy, "--worker-urls", *fleets.regular]
    args += ["--pd-disaggregation", "--prefill-policy", arm.policy,
             "--decode-policy", arm.decode_policy]  # fmt: skip
    for url, bootstrap in zip(fleets.prefill, fleets.bootstrap_ports, strict=True):
        args += ["--prefill", url, str(bootstrap)]
    for url in fleets.decode:
        args += ["--decode", url]
    return args


@contextlib.contextmanager
def run_router(
    arm: Arm, fleets: Fleets, log: Path, timeout_s: float = 30.0
) -> Iterator[tuple[str, int]]:
    """Start the arm's router, yield its URL and PID once ready, stop it by PID."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with running(router_command(arm, fleets, port), log=log, stdin=subprocess.DEVNULL) as proc:
        try:
            workers = len(fleets.of(arm))
            wait_until(lambda: router_ready(url, workers, "/readiness"), timeout_s, watch=[proc])
        except NotReady:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"{arm.spec} did not become ready:\n{tail}") from None
        yield url, proc.pid


def bootstrap_port(url: str) -> int:
    """A prefill worker's bootstrap port, as its ``/server_info`` reports it."""
    body = http_get(url + "/server_info", 5.0)
    if body is None:
        raise RuntimeError(f"no /server_info from {url}")
    return int(json.loads(body)["disaggregation_bootstrap_port"])


async def _measure(
    items: Sequence[ReplayItem], url: str, urls: Sequence[str], args: argparse.Namespace
) -> tuple[list[Outcome], float, list[WorkerDelta]]:
    await flush_all(urls)
    before = await read_all(urls)
    outcomes, wall = await replay(items, lambda _: url, args.max_seconds, args.timeout)
    after = await read_all(urls)
    return outcomes, wall, deltas(urls, before, after)


@dataclass(frozen=True, slots=True)
class Run:
    """One run of one arm: the result (its workers: the prefill side's counters), the
    decode workers' counters (PD) and the router process's CPU seconds during the run."""

    result: ContenderResult
    decode: list[WorkerDelta]
    router_cpu_s: float


def run_arm(
    arm: Arm, fleets: Fleets, items: Sequence[ReplayItem], args: argparse.Namespace, log: Path
) -> Run:
    urls = fleets.of(arm)
    with run_router(arm, fleets, log) as (url, pid):
        cpu = cpu_seconds(pid)
        outcomes, wall, counted = asyncio.run(_measure(items, url, urls, args))
        cpu = cpu_seconds(pid) - cpu
    split = len(fleets.prefill) if arm.fleet == "pd" else len(urls)
    result = ContenderResult(
        args.workload, arm.spec, outcomes, wall, counted[:split], args.speed,
        load_1m=os.getloadavg()[0],
    )  # fmt: skip
    return Run(result, counted[split:], cpu)


def _pool(decodes: Sequence[Sequence[WorkerDelta]]) -> list[WorkerDelta]:
    if not decodes or not decodes[0]:
        return []
    return [
        WorkerDelta(first.url, *(sum(getattr(d[i], f) for d in decodes) for f in
                    ("prompt_tokens", "cached_tokens", "requests", "prefill_busy_s")))
        for i, first in enumerate(decodes[0])
    ]  # fmt: skip


@contextlib.contextmanager
def start_fleets(
    args: argparse.Namespace, log_dir: Path, model_dir: str, fleets: set[str]
) -> Iterator[Fleets]:
    """The PD fleet (N prefill + M decode) and the regular fleet (N + M), those of
    ``fleets`` that arms use, all at once."""
    n, m = args.prefill, args.decode

    def settings(mode: str = "null", port: int = 0) -> BenchSim:
        return BenchSim(
            profile=args.profile, speed=args.speed, capacity_tokens=args.capacity_tokens,
            max_running_requests=args.max_running_requests, model_path=model_dir,
            disaggregation_mode=mode, bootstrap_port=port, transfer_profile=args.transfer_profile,
        )  # fmt: skip

    prefill: list[str] = []
    decode: list[str] = []
    regular: list[str] = []
    with contextlib.ExitStack() as stack:
        if "pd" in fleets:
            prefill = stack.enter_context(
                run_sim_fleet(n, settings("prefill", free_port_range(n)), log_dir / "prefill")
            )
            decode = stack.enter_context(run_sim_fleet(m, settings("decode"), log_dir / "decode"))
        if "regular" in fleets:
            regular = stack.enter_context(run_sim_fleet(n, settings(), log_dir / "regular-a"))
            regular += stack.enter_context(run_sim_fleet(m, settings(), log_dir / "regular-b"))
        yield Fleets(prefill, [bootstrap_port(u) for u in prefill], decode, regular)


def orchestrate(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    out_dir = Path(
        args.results or f"results/bench-pd-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    )
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    arms = [Arm.parse(a) for a in args.arms]
    notes: list[str] = []
    if not router_available():
        skipped = [a.spec for a in arms if a.router == "sglang-router"]
        arms = [a for a in arms if a.router != "sglang-router"]
        if skipped:
            notes.append("sglang-router is not importable (the `bench` extra): skipped "
                         + ", ".join(skipped))  # fmt: skip
    name, params, _ = parse_spec(args.workload)
    if not any(p.startswith("seed=") for p in params):
        params = [*params, f"seed={args.seed}"]
    workload = create_workload(name, params).limited(args.max_requests)
    items = prepare(workload, args.speed, args.max_output_tokens)
    model_dir = tempfile.mkdtemp(prefix="bench_pd_model_")
    load_before = os.getloadavg()[0]
    runs: dict[str, list[Run]] = {}
    try:
        with start_fleets(args, log_dir, model_dir, {a.fleet for a in arms}) as fleets:
            for k in range(args.rounds):
                for arm in arms if k % 2 == 0 else arms[::-1]:
                    print(f"[bench-pd] round {k + 1}: {arm.spec} ...", file=sys.stderr, flush=True)
                    slug = f"{arm.spec.replace(':', '-').replace('/', '-')}-{k + 1}"
                    try:
                        result = run_arm(arm, fleets, items, args, log_dir / f"{slug}.log")
                    except RuntimeError as exc:
                        notes.append(f"{arm.spec} did not run: {exc}"[:400])
                        continue
                    runs.setdefault(arm.spec, []).append(result)
                    r = result.result
                    rows = [dataclasses.asdict(o) for o in r.outcomes]
                    (out_dir / f"{slug}-outcomes.json").write_text(json.dumps(rows) + "\n")
                    print(
                        f"[bench-pd]   ok {r.ok}/{r.sent}, hit {r.reported_fraction:.3f}, "
                        f"TTFT p99 {percentile(r.ttfts, 99, 'nearest') * 1e3:.0f} ms, "
                        f"load {r.load_1m:.1f}",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    results = [
        ArmResult(
            a,
            merge([r.result for r in runs[a.spec]]),
            _pool([r.decode for r in runs[a.spec]]),
            [_p50_p99(r.result.ttfts) for r in runs[a.spec]],
            sum(r.router_cpu_s for r in runs[a.spec]),
        )
        for a in arms
        if a.spec in runs
    ]
    notes.append(_code_state())
    notes.append(
        f"load average (1 min) of the shared {os.cpu_count()}-core machine before / after: "
        f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
    )
    setup = describe(args, name, params, len(items), workload.requests[-1].arrival_s)
    text = render(setup, results, notes)
    (out_dir / "report.md").write_text(text + "\n")
    data = {
        "args": vars(args),
        "setup": setup,
        "notes": notes,
        "arms": [
            {**r.result.summary(), "arm": r.arm.spec, "per_round_ttft_p50_p99_s": r.per_round,
             "router_cpu_s": r.router_cpu_s,
             "decode_requests": {d.url: d.requests for d in r.decode}}
            for r in results
        ],
    }  # fmt: skip
    (out_dir / "results.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"[bench-pd] results in {out_dir}", file=sys.stderr)
    return text, data


def describe(args: argparse.Namespace, name: str, params: list[str], sent: int, span: float) -> str:
    n, m = args.prefill, args.decode
    cap = args.max_running_requests or "capped by SGLang's formula"
    return (
        f"Workload `{name}` ({', '.join(params)}): {sent} requests over {span:.1f} modelled s, "
        f"output capped at {args.max_output_tokens or '∞'} tokens, arrivals ÷ {args.speed:g} "
        f"(the simulator's `--speed`), sending stops after {args.max_seconds:g} wall s. "
        f"PD fleet: {n} prefill + {m} decode simulated SGLang workers (transfer link "
        f"{args.transfer_profile or 'rdma-400g'}); regular fleet: {n + m} workers. Each worker: "
        f"profile {args.profile}, {args.capacity_tokens:,} KV tokens, running requests {cap}. "
        f"{args.rounds} round(s) per arm (order alternated, outcomes pooled)."
    )


def _p50_p99(values: Sequence[float]) -> tuple[float, float]:
    return percentile(values, 50, "nearest"), percentile(values, 99, "nearest")


def _median_rounds(per_round: Sequence[tuple[float, float]]) -> tuple[float, float]:
    if not per_round:
        return math.nan, math.nan
    return (statistics.median(p for p, _ in per_round),
            statistics.median(p for _, p in per_round))  # fmt: skip


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:,.0f}"


def _ratio(a: float, b: float) -> str:
    return "-" if not b or a != a or b != b else f"{a / b:.2f}"


def tpots(outcomes: Sequence[Outcome]) -> list[float]:
    """Per successful request, (last byte - first event) / (completion tokens - 1)."""
    return [
        (o.latency_s - o.ttft_s) / (o.completion_tokens - 1)
        for o in outcomes
        if o.ok and o.ttft_s is not None and o.completion_tokens > 1
    ]


def render(setup: str, results: Sequence[ArmResult], notes: Sequence[str]) -> str:
    """The arms as one Markdown table, TTFT ratios against the sglang-router PD arm's."""
    ref = next((r for r in results if r.arm.fleet == "pd" and r.arm.router != "gateway"), None)
    ref_q = _p50_p99(ref.result.ttfts) if ref else (0.0, 0.0)
    lines = [
        setup,
        "",
        "| arm | ok / sent | failed | TTFT p50 / p99 ms | per round | median of rounds "
        "| p50 / p99 ÷ sglang-router PD | prefill-side hit (usage) | hit (workers' counters) "
        "| TPOT p50 ms | req/s | router CPU ms / request | requests per prefill (per worker "
        "when regular) | requests per decode | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for item in results:
        r = item.result
        t50, t99 = _p50_p99(r.ttfts)
        rounds = ", ".join(f"{_ms(a)} / {_ms(b)}" for a, b in item.per_round)
        m50, m99 = _median_rounds(item.per_round)
        per = " / ".join(f"{w.requests:.0f}" for w in r.workers)
        dec = " / ".join(f"{w.requests:.0f}" for w in item.decode) or "-"
        lines.append(
            f"| {item.arm.spec} | {r.ok} / {r.sent} | {r.failed + r.shed} | {_ms(t50)} / "
            f"{_ms(t99)} | {rounds} | {_ms(m50)} / {_ms(m99)} | "
            f"{_ratio(t50, ref_q[0])} / {_ratio(t99, ref_q[1])} | "
            f"{r.reported_fraction:.3f} | {r.cached_fraction:.3f} | "
            f"{_ms(percentile(tpots(r.outcomes), 50, 'nearest'))} | {r.throughput:.2f} | "
            f"{item.router_cpu_s / max(1, r.sent) * 1e3:.1f} | "
            f"{per} | {dec} | {r.load_1m:.1f} |"
        )
    errors = [f"- {i.arm.spec}: {e}" for i in results for e in i.result.summary()["errors"]]
    return "\n".join([*lines, "", *errors, *(f"- {n}" for n in notes)])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench.pd", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (N)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (M)")
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument(
        "--speed", type=float, default=1.0,
        help="modelled s per wall s (default 1: a PD pair's extra HTTP hops take wall time)",
    )  # fmt: skip
    p.add_argument("--capacity-tokens", type=int, default=32768, help="KV tokens per worker")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="per worker (default: SGLang's formula, as the replay)")  # fmt: skip
    p.add_argument("--transfer-profile", default="", help="the KV link (default rdma-400g)")
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, metavar="NAME[:k=v,...]")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS),
                   help="FLEET:ROUTER:POLICY[/DECODE_POLICY], FLEET pd or regular")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="runs per arm, order alternated")
    p.add_argument("--max-requests", type=int, default=400, help="first N requests at most")
    p.add_argument("--max-seconds", type=float, default=40.0, help="stop sending after (wall s)")
    p.add_argument("--timeout", type=float, default=60.0, help="per request (wall s)")
    p.add_argument("--max-output-tokens", type=int, default=32, help="cap; 0 keeps the workload's")
    p.add_argument("--results", default="", help="output folder")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the fleets and routers are stopped by their PIDs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for spec in args.arms:
            Arm.parse(spec)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    text, _ = orchestrate(args)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
