"""Scale on one host: one gateway process against two (``--processes 2``), and against
sglang-router, in one run on the same simulated workers.

    python -m loadtests.bench.scale [--workers 4] [--duration 8] [--rounds 2]
        [--concurrency 32] [--groups 32] [--redis-url redis://127.0.0.1:6379/0]
        [--gateway LABEL=DIR ...] [--policy round_robin] [--overhead-only]

Every party is a process of its own on 127.0.0.1, all sharing the machine's cores (no
pinning): the simulated workers (``python -m simulator --workers N --speed 1000
--enable-cache-report``, one process, so generation takes no time and the routers' own
cost dominates), sglang-router 0.3.2, the gateways, Redis (already running), and the load
generator (``python -m loadtests.bench.scale client ...``, one process per cell: a closed
loop at ``--concurrency`` for ``--duration`` s, asyncio + aiohttp). Per cell the CPU
seconds each party used are read from /proc (the client's from its rusage), so the table
says how the cores were shared. Processes are stopped by PID.

Two phases, each with its contenders' cells interleaved round by round (background load
on the shared cores falls on all alike; requests/s is the median round):

1. Routing overhead, as "Gateway overhead" measures it (a short chat, ``max_tokens`` 8,
   no prefix; ``round_robin`` everywhere): streaming and non-streaming at
   ``--concurrency``, for direct (client-side round robin over the workers),
   sglang-router, this gateway in one process and in two (``--processes 2`` with
   ``--redis-url``, a fresh ``--redis-prefix``). Streaming latency is to the last byte.
   ``--gateway LABEL=DIR`` (repeatable) adds a one-process gateway run from the source
   tree DIR (e.g. ``git archive <commit> | tar -x -C DIR``), named ``gateway x1 LABEL``:
   a before/after comparison in one run. ``--policy`` is the gateways' policy here
   (sglang-router stays on round_robin); ``--overhead-only`` skips the two-process
   gateway and phase 2. The table adds the contender's CPU µs per request (its CPU
   seconds / requests served), the figure least moved by the machine's other load.
2. Shared prefixes (``min_ttft``, both with the same Redis, fresh prefixes): ``--groups``
   system prompts of about 2,000 characters, each request one of them at random plus a
   question of its own, non-streaming; cached fraction = the workers' reported
   ``cached_tokens`` / ``prompt_tokens``. Each cell draws new system prompts (seeded per
   cell), so every cell starts with cold caches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests.harness.ports import free_port, free_port_range
from loadtests.harness.procs import cpu_seconds, running
from loadtests.harness.redis import delete_prefix, redis_answers
from loadtests.harness.stats import percentile

CHAT_PATH = "/v1/chat/completions"
SHORT = {
    "model": "sim",
    "messages": [{"role": "user", "content": "Say something short about load balancers."}],
    "max_tokens": 8,
}
ROUTER = "sglang-router 0.3.2"

# --- the load generator (its own process) --------------------------------------------


@dataclass
class ClientResult:
    requests: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0


def _system_prompt(rng: random.Random, chars: int = 2000) -> str:
    words = [f"w{rng.randrange(100_000)}" for _ in range(chars // 5)]
    return " ".join(words)[:chars]


class Bodies:
    """Request bodies: the short chat, or a shared-prefix chat per ``groups`` > 0."""

    def __init__(self, groups: int, stream: bool, seed: int) -> None:
        self._rng = random.Random(seed)
        self._systems = [_system_prompt(self._rng) for _ in range(groups)]
        self._stream = stream
        self._n = itertools.count()
        self._short = orjson.dumps({**SHORT, "stream": stream})

    def next(self) -> bytes:
        if not self._systems:
            return self._short
        messages = [
            {"role": "system", "content": self._rng.choice(self._systems)},
            {"role": "user", "content": f"Question {next(self._n)}: what is in the notes?"},
        ]
        return orjson.dumps({"model": "sim", "messages": messages, "max_tokens": 8})


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, result: ClientResult
) -> None:
    start = time.perf_counter()
    ok, usage = False, None
    try:
        async with session.post(
            url, data=body, headers={"content-type": "application/json"}
        ) as resp:
            if stream:
                async for _ in resp.content.iter_any():
                    pass
            else:
                data = await resp.read()
                if resp.status == 200:
                    usage = orjson.loads(data).get("usage")
            ok = resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError):
        ok = False
    result.requests += 1
    if not ok:
        result.errors += 1
        return
    result.latencies_s.append(time.perf_counter() - start)
    if isinstance(usage, dict):
        result.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            result.cached_tokens += int(details.get("cached_tokens") or 0)


async def closed_loop(
    urls: Sequence[str], bodies: Bodies, stream: bool, concurrency: int, duration_s: float
) -> ClientResult:
    result = ClientResult()
    rotation = itertools.cycle(urls)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # warm-up (not counted): connections opened, the short body's path warmed
        warm = Bodies(0, stream, 0)
        await asyncio.gather(
            *(_one(session, next(rotation), warm.next(), stream, ClientResult())
              for _ in range(concurrency))
        )  # fmt: skip
        deadline = time.perf_counter() + duration_s

        async def loop() -> None:
            while time.perf_counter() < deadline and result.requests < 500_000:
                await _one(session, next(rotation), bodies.next(), stream, result)

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        result.elapsed_s = time.perf_counter() - start
    return result


def _client_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.scale client")
    parser.add_argument("--url", nargs="+", required=True)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--groups", type=int, default=0, help="0: the short chat")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bodies = Bodies(args.groups, args.stream, args.seed)
    urls = [u + CHAT_PATH for u in args.url]
    result = asyncio.run(closed_loop(urls, bodies, args.stream, args.concurrency, args.duration))
    print(json.dumps(asdict(result) | {"rps": result.rps}))
    return 0


# --- the orchestrator ------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    urls: list[str]  # where the client sends
    pids: list[int]  # the processes whose CPU is its own (a gateway's parent: its tree)


@dataclass
class Cell:
    contender: str
    measure: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def rps(self) -> float:
        return float(statistics.median(float(r["rps"]) for r in self.runs))

    def latency_ms(self, p: float) -> float:
        lat = [x for r in self.runs for x in r["latencies_s"]]
        return percentile(lat, p, "upper") * 1e3 if lat else float("nan")

    def cached(self) -> float | None:
        prompt = sum(r["prompt_tokens"] for r in self.runs)
        return sum(r["cached_tokens"] for r in self.runs) / prompt if prompt else None

    def cpu_us(self) -> float:
        """The contender's CPU µs per request served, over the cell's runs (0: direct)."""
        served: int = sum(r["requests"] for r in self.runs)
        used: float = sum(r["cpu"]["contender"] for r in self.runs)
        return used * 1e6 / max(1, served)

    def cores(self, part: str) -> float:
        """Mean cores ``part`` used over the cell's runs (CPU s / wall s)."""
        return statistics.fmean(r["cpu"][part] / r["wall_s"] for r in self.runs)


def _tree(pid: int) -> list[int]:
    """``pid`` and its children (a gateway's parent and its processes)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return [pid]
    return [pid, *(int(p) for p in text.split())]


def _cpu(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def _run_cell(
    contender: Contender,
    parts: dict[str, list[int]],
    *,
    stream: bool,
    groups: int,
    seed: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "loadtests.bench.scale", "client", "--url", *contender.urls,
           "--concurrency", str(args.concurrency), "--duration", str(args.duration),
           "--groups", str(groups), "--seed", str(seed)]  # fmt: skip
    if stream:
        cmd.append("--stream")
    pids = {name: [p for pid in group for p in _tree(pid)] for name, group in parts.items()}
    before = {name: _cpu(group) for name, group in pids.items()}
    child_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, timeout=args.duration * 4 + 60)
    wall = time.perf_counter() - started
    child_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result: dict[str, Any] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    cpu = {name: _cpu(group) - before[name] for name, group in pids.items()}
    cpu["client"] = (child_after.ru_utime + child_after.ru_stime) - (
        child_before.ru_utime + child_before.ru_stime
    )
    # over the client's whole run (start-up and warm-up included), for every party alike
    result["cpu"] = cpu
    result["wall_s"] = wall
    return result


def _simulator_cmd(base_port: int, workers: int, model_dir: str) -> list[str]:
    return [sys.executable, "-m", "simulator", "--workers", str(workers), "--base-port",
            str(base_port), "--model-path", model_dir, "--speed", "1000", "--host",
            "127.0.0.1", "--enable-cache-report"]  # fmt: skip


def _gateway_cmd(
    port: int, urls: Sequence[str], policy: str, processes: int, redis: tuple[str, str] | None
) -> list[str]:  # run in a source tree's folder, ``-m gateway`` imports that tree
    cmd = [sys.executable, "-m", "gateway", "--worker-urls", *urls, "--policy", policy,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
           "--processes", str(processes)]  # fmt: skip
    if redis is not None:
        cmd += ["--redis-url", redis[0], "--redis-prefix", redis[1]]
    return cmd


def _router_cmd(port: int, urls: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port",
            str(free_port())]  # fmt: skip


async def _serving(url: str, timeout_s: float, times: int = 8) -> bool:
    """``times`` chats in a row answered 200, each on a new connection (with several
    processes, the kernel spreads them over every one)."""
    deadline = time.monotonic() + timeout_s
    ok = 0
    while time.monotonic() < deadline and ok < times:
        connector = aiohttp.TCPConnector(force_close=True)
        status = 0
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.post(url + CHAT_PATH, json=SHORT, timeout=aiohttp.ClientTimeout(total=5)) as r,
            ):
                await r.read()
                status = r.status
        ok = ok + 1 if status == 200 else 0
        if status != 200:
            await asyncio.sleep(0.3)
    return ok >= times


@contextlib.contextmanager
def _gateway(
    stack_dir: Path, name: str, urls: Sequence[str], policy: str, processes: int,
    redis_url: str | None, tree: Path | None = None,
) -> Iterator[Contender]:  # fmt: skip
    """A gateway process (tree) until the block ends, run from the source ``tree``
    (default: this one); its Redis keys deleted after."""
    port = free_port()
    prefix = f"bench-scale-{uuid.uuid4().hex[:8]}"
    redis = (redis_url, prefix) if redis_url else None
    cmd = _gateway_cmd(port, urls, policy, processes, redis)
    log = stack_dir / f"{name.replace(' ', '_')}.log"
    try:
        with running(cmd, log=log, grace_s=15.0, cwd=tree) as proc:
            url = f"http://127.0.0.1:{port}"
            if not asyncio.run(_serving(url, 60)):
                raise SystemExit(f"{name} did not serve; log in {log}")
            yield Contender(name, [url], [proc.pid])
    finally:
        if redis_url:
            asyncio.run(delete_prefix(redis_url, prefix))


def _phase(
    contenders: Sequence[Contender],
    measures: Sequence[tuple[str, bool, int]],
    parts: dict[str, list[int]],
    args: argparse.Namespace,
) -> list[Cell]:
    cells = {(c.name, m): Cell(c.name, m) for c in contenders for m, _, _ in measures}
    seed = itertools.count(1)
    for _ in range(args.rounds):
        for measure, stream, groups in measures:
            for c in contenders:
                own = {"contender": c.pids, **parts}
                cells[(c.name, measure)].runs.append(
                    _run_cell(c, own, stream=stream, groups=groups, seed=next(seed), args=args)
                )
    return list(cells.values())


def _table(cells: Sequence[Cell], with_cached: bool) -> str:
    head = (
        "| contender | measure | requests/s | p50 ms | p99 ms | errors/requests "
        "| contender CPU µs/request |"
    )
    rule = "|---|---|---|---|---|---|---|"
    if with_cached:
        head, rule = head + " cached fraction |", rule + "---|"
    head += " cores: contender / simulator / client |"
    rule += "---|"
    lines = [head, rule]
    for c in cells:
        errors = sum(r["errors"] for r in c.runs)
        requests = sum(r["requests"] for r in c.runs)
        row = (
            f"| {c.contender} | {c.measure} | {c.rps():,.0f} | {c.latency_ms(50):.1f} | "
            f"{c.latency_ms(99):.1f} | {errors}/{requests} | {c.cpu_us():,.0f} |"
        )
        if with_cached:
            cached = c.cached()
            row += " - |" if cached is None else f" {cached:.3f} |"
        cores = " / ".join(f"{c.cores(p):.2f}" for p in ("contender", "simulator", "client"))
        lines.append(row + f" {cores} |")
    return "\n".join(lines)


def _ratio(cells: Sequence[Cell], a: str, b: str, measure: str) -> str:
    by = {(c.contender, c.measure): c for c in cells}
    x, y = by.get((a, measure)), by.get((b, measure))
    if x is None or y is None or not y.rps():
        return f"- {measure}: {a} / {b}: not measured"
    return f"- {measure}: {a} / {b} = {x.rps() / y.rps():.2f}x requests/s"


def _orchestrate(args: argparse.Namespace) -> str:
    if not asyncio.run(redis_answers(args.redis_url)):
        raise SystemExit(f"no Redis at {args.redis_url}: --processes 2 needs one")
    logs = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    model_dir = tempfile.mkdtemp(prefix="sim_model_")
    base = free_port_range(args.workers)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(args.workers)]
    c = args.concurrency
    overhead = [(f"stream c={c}", True, 0), (f"non-stream c={c}", False, 0)]
    shared = [(f"shared prefix c={c}", False, args.groups)]
    load = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(
            running(_simulator_cmd(base, args.workers, model_dir), log=logs / "simulator.log")
        )
        parts = {"simulator": [sim.pid]}
        if not all(asyncio.run(_serving(u, 60, 1)) for u in urls):
            raise SystemExit(f"the simulated workers did not start; logs in {logs}")
        router_port = free_port()
        router = stack.enter_context(
            running(_router_cmd(router_port, urls), log=logs / "router.log")
        )
        router_url = f"http://127.0.0.1:{router_port}"
        contenders = [Contender("direct", urls, [])]
        if asyncio.run(_serving(router_url, 60)):
            contenders.append(Contender(ROUTER, [router_url], [router.pid]))
        with contextlib.ExitStack() as phase:
            for label, tree in _trees(args.gateway):
                name = f"gateway x1 {label}".rstrip()
                contenders.append(
                    phase.enter_context(_gateway(logs, name, urls, args.policy, 1, None, tree))
                )
            if not args.overhead_only:
                contenders.append(
                    phase.enter_context(
                        _gateway(logs, "gateway x2", urls, args.policy, 2, args.redis_url)
                    )
                )
            first = _phase(contenders, overhead, parts, args)
        load.append(os.getloadavg()[0])
        if args.overhead_only:
            return _report(first, [], load, args)
        with contextlib.ExitStack() as phase:
            pair = [
                phase.enter_context(_gateway(logs, name, urls, "min_ttft", n, args.redis_url))
                for name, n in (("gateway x1 + Redis", 1), ("gateway x2 + Redis", 2))
            ]
            second = _phase(pair, shared, parts, args)
        load.append(os.getloadavg()[0])
    return _report(first, second, load, args)


def _trees(specs: Sequence[str]) -> list[tuple[str, Path | None]]:
    """``LABEL=DIR`` specs as (label, tree); none: this tree, unlabelled."""
    if not specs:
        return [("", None)]
    out: list[tuple[str, Path | None]] = []
    for spec in specs:
        label, _, tree = spec.partition("=")
        out.append((label, Path(tree).resolve() if tree else None))
    return out


def _report(
    first: Sequence[Cell], second: Sequence[Cell], load: Sequence[float], args: argparse.Namespace
) -> str:
    c = args.concurrency
    lines = [f"Routing overhead ({args.policy}, short chat):", "", _table(first, False), ""]
    ones = list(
        dict.fromkeys(cell.contender for cell in first if cell.contender.startswith("gateway x1"))
    )
    for measure in (f"stream c={c}", f"non-stream c={c}"):
        for ours in [*ones, "direct"] + ([] if args.overhead_only else ["gateway x2"]):
            lines.append(_ratio(first, ours, ROUTER, measure))
        if not args.overhead_only:
            lines.append(_ratio(first, "gateway x2", "gateway x1", measure))
    if not second:
        lines.append(
            "- load average (1 min) before / after phase 1: " + " / ".join(f"{x:.1f}" for x in load)
        )
        lines.append(_settings(args))
        return "\n".join(lines)
    lines += ["", f"Shared prefixes (min_ttft, {args.groups} system prompts):", ""]
    lines += [_table(second, True), ""]
    measure = f"shared prefix c={c}"
    lines.append(_ratio(second, "gateway x2 + Redis", "gateway x1 + Redis", measure))
    by = {cell.contender: cell.cached() for cell in second}
    one, two = by.get("gateway x1 + Redis"), by.get("gateway x2 + Redis")
    if one is not None and two is not None:
        lines.append(f"- cached fraction, 2 processes - 1: {100 * (two - one):+.1f} points")
    lines.append(
        "- load average (1 min) before / after phase 1 / after phase 2: "
        + " / ".join(f"{x:.1f}" for x in load)
    )
    lines.append(_settings(args))
    return "\n".join(lines)


def _settings(args: argparse.Namespace) -> str:
    return (
        f"- settings: {args.workers} simulated workers (one process, speed 1000), "
        f"{args.rounds} interleaved rounds of {args.duration:g} s per cell, closed loop at "
        f"{args.concurrency}; {os.cpu_count()} cores shared by every process, no pinning; "
        "cores = CPU seconds / wall seconds of the cell (contender: all its processes)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return _client_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.scale")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--gateway",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="a one-process gateway from this source tree (repeatable; default: this tree)",
    )
    parser.add_argument("--policy", default="round_robin", help="the gateways' policy, phase 1")
    parser.add_argument(
        "--overhead-only", action="store_true", help="phase 1 without the 2-process gateway"
    )
    args = parser.parse_args(argv)
    print(_orchestrate(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
