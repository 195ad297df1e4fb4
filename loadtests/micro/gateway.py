"""Gateway overhead, live: this gateway vs sglang-router vs direct, on the same workers.

    python -m loadtests.micro.gateway [--workers 2] [--duration 8] [--concurrency 32]
                                      [--rate 200] [--write-benchmarks]

One run starts, each as its own process: the simulated workers (``python -m simulator``,
``--model-path`` an empty temp directory so nothing is downloaded), this gateway
(``python -m gateway ... --policy round_robin``), and sglang-router 0.3.2
(``python -m sglang_router.launch_router ... --policy round_robin``). The load generator
(``python -m loadtests.micro.gateway client ...``) is one more process, an asyncio +
aiohttp client bounded in requests and time, run once per measurement:
- closed loop at ``--concurrency`` for ``--duration`` s: requests/s and latency p50/p99,
  non-streaming and streaming chat (streaming latency = last byte; TTFT also kept);
- open loop at ``--rate`` requests/s: latency p50/p99 of non-streaming chat.
Each cell runs ``--rounds`` times, the three paths interleaved so background load on the
shared cores falls on all alike; requests/s is the median round, percentiles are over
every round's latencies. "Direct" spreads the same load over the workers client-side
(round robin), so added latency = path's percentile minus direct's. Processes are stopped
by PID.
Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.harness.ports import free_port, free_port_range, free_ports
from loadtests.harness.procs import running, wait_http
from loadtests.harness.stats import percentile

CHAT_PATH = "/v1/chat/completions"
CHAT_BODY: dict[str, Any] = {
    "model": "sim",
    "messages": [{"role": "user", "content": "Say something short about load balancers."}],
    "max_tokens": 8,
}


# --- the load generator (its own process) --------------------------------------------


@dataclass
class ClientResult:
    requests: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, result: ClientResult
) -> None:
    start = time.perf_counter()
    ttft = None
    try:
        async with session.post(
            url, data=body, headers={"content-type": "application/json"}
        ) as resp:
            if stream:
                async for _ in resp.content.iter_any():
                    if ttft is None:
                        ttft = time.perf_counter() - start
            else:
                await resp.read()
            ok = resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        ok = False
    end = time.perf_counter() - start
    result.requests += 1
    if not ok:
        result.errors += 1
        return
    result.latencies_s.append(end)
    if ttft is not None:
        result.ttfts_s.append(ttft)


async def closed_loop(
    urls: Sequence[str], stream: bool, concurrency: int, duration_s: float, max_requests: int
) -> ClientResult:
    body = json.dumps({**CHAT_BODY, "stream": stream}).encode()
    result = ClientResult()
    rotation = itertools.cycle(urls)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        # warm-up: open connections and let JITs/caches settle, not counted
        await asyncio.gather(
            *(
                _one(session, next(rotation), body, stream, ClientResult())
                for _ in range(concurrency)
            )
        )
        deadline = time.perf_counter() + duration_s
        sent = 0

        async def worker() -> None:
            nonlocal sent
            while time.perf_counter() < deadline and sent < max_requests:
                sent += 1
                await _one(session, next(rotation), body, stream, result)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.elapsed_s = time.perf_counter() - start
    return result


async def open_loop(
    urls: Sequence[str], stream: bool, rate: float, duration_s: float
) -> ClientResult:
    body = json.dumps({**CHAT_BODY, "stream": stream}).encode()
    result = ClientResult()
    rotation = itertools.cycle(urls)
    total = int(rate * duration_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(
            *(_one(session, next(rotation), body, stream, ClientResult()) for _ in range(16))
        )
        start = time.perf_counter()
        tasks = []
        for i in range(total):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, next(rotation), body, stream, result)))
        await asyncio.gather(*tasks)
        result.elapsed_s = time.perf_counter() - start
    return result


def _client_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.micro.gateway client")
    parser.add_argument("--url", nargs="+", required=True)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.0, help="open loop when > 0")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--max-requests", type=int, default=200_000)
    args = parser.parse_args(argv)
    if args.rate > 0:
        coro = open_loop(args.url, args.stream, args.rate, args.duration)
    else:
        coro = closed_loop(
            args.url, args.stream, args.concurrency, args.duration, args.max_requests
        )
    result = asyncio.run(coro)
    print(json.dumps(asdict(result) | {"rps": result.rps}))
    return 0


# --- the orchestrator ------------------------------------------------------------------


def _process(cmd: list[str], log: Path) -> contextlib.AbstractContextManager[Any]:
    """``cmd`` in its own session, output to ``log``; its group stopped by PID on exit."""
    return running(cmd, log=log, grace_s=10.0, group=True)


async def _wait_chat(url: str, timeout_s: float) -> bool:
    """Ready when a chat request succeeds end to end."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.post(
                    url + "/v1/chat/completions",
                    json=CHAT_BODY,
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as resp:
                    await resp.read()
                    if resp.status == 200:
                        return True
            await asyncio.sleep(0.3)
    return False


def _run_client(
    urls: Sequence[str],
    *,
    stream: bool = False,
    concurrency: int = 32,
    rate: float = 0.0,
    duration: float = 8.0,
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "loadtests.micro.gateway",
        "client",
        "--url",
        *urls,
        "--concurrency",
        str(concurrency),
        "--duration",
        str(duration),
        "--rate",
        str(rate),
    ]
    if stream:
        cmd.append("--stream")
    out = subprocess.run(cmd, check=True, capture_output=True, timeout=duration * 4 + 60)
    result: dict[str, Any] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return result


@dataclass
class Row:
    path: str
    measure: str
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int


def _simulator_cmd(base_port: int, workers: int, model_dir: str) -> list[str]:
    # Fast modelled time (x1000) so the gateway's own cost, not generation, dominates.
    return [
        sys.executable,
        "-m",
        "simulator",
        "--workers",
        str(workers),
        "--base-port",
        str(base_port),
        "--model-path",
        model_dir,
        "--speed",
        "1000",
        "--host",
        "127.0.0.1",
    ]


def _gateway_cmd(port: int, urls: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gateway",
        "--worker-urls",
        *urls,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]


def _router_cmd(port: int, urls: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *urls,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warn",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]


def _measures(args: argparse.Namespace) -> list[str]:
    closed = [f"{kind} c={c}" for c in args.concurrency for kind in ("non-stream", "stream")]
    return [*closed, f"non-stream @ {args.rate:g} rps"]


def _measure(urls: Sequence[str], measure: str, args: argparse.Namespace) -> dict[str, Any]:
    targets = [u + CHAT_PATH for u in urls]
    if "@" in measure:
        return _run_client(targets, rate=args.rate, duration=args.duration)
    kind, _, level = measure.partition(" c=")
    return _run_client(
        targets, stream=kind == "stream", concurrency=int(level), duration=args.duration
    )


def _combine(path: str, label: str, runs: Sequence[dict[str, Any]]) -> Row:
    """Rounds of one cell: median requests/s, percentiles over every round's latencies."""
    latencies = [x for run in runs for x in run["latencies_s"]]
    return Row(
        path,
        label,
        statistics.median(r["rps"] for r in runs),
        percentile(latencies, 50, "upper") * 1e3,
        percentile(latencies, 99, "upper") * 1e3,
        sum(r["errors"] for r in runs),
        sum(r["requests"] for r in runs),
    )


def _table(rows: Sequence[Row]) -> str:
    direct = {r.measure: r for r in rows if r.path == "direct"}
    lines = [
        "| path | measure | requests/s | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| errors/requests |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = direct.get(r.measure)
        added50 = r.p50_ms - d.p50_ms if d else float("nan")
        added99 = r.p99_ms - d.p99_ms if d else float("nan")
        lines.append(
            f"| {r.path} | {r.measure} | {r.rps:,.0f} | {r.p50_ms:.2f} | "
            f"{r.p99_ms:.2f} | {added50:+.2f} | {added99:+.2f} | "
            f"{r.errors}/{r.requests} |"
        )
    return "\n".join(lines)


async def _ready(urls: Sequence[str], gateway: str, router: str | None) -> tuple[bool, bool]:
    ok = all(await asyncio.gather(*(wait_http(u + "/health", 60) for u in urls)))
    ok = ok and await _wait_chat(gateway, 30)
    router_ok = bool(router) and await _wait_chat(router or "", 30)
    return ok, router_ok


def _orchestrate(args: argparse.Namespace) -> str:
    logs = Path(tempfile.mkdtemp(prefix="gateway_bench_"))
    model_dir = tempfile.mkdtemp(prefix="sim_model_")
    base = free_port_range(args.workers)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(args.workers)]
    gw_port, router_port = free_ports(2)
    gateway, router = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{router_port}"
    rows: list[Row] = []
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            _process(_simulator_cmd(base, args.workers, model_dir), logs / "simulator.log")
        )
        stack.enter_context(_process(_gateway_cmd(gw_port, urls), logs / "gateway.log"))
        router_proc = stack.enter_context(
            _process(_router_cmd(router_port, urls), logs / "router.log")
        )
        ok, router_ok = asyncio.run(_ready(urls, gateway, router))
        if not ok:
            raise SystemExit(f"workers or gateway did not start; logs in {logs}")
        load_before = os.getloadavg()[0]
        paths = {"direct": urls, "this gateway": [gateway]}
        if router_ok:
            paths["sglang-router 0.3.2"] = [router]
        # Rounds interleave the paths, so background load on the shared cores falls on
        # every path alike rather than on whichever ran during a busy minute.
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for measure in _measures(args):
                for name, target in paths.items():
                    runs.setdefault((name, measure), []).append(_measure(target, measure, args))
        notes.append(
            "load average (1 min) of the shared machine before / after: "
            f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
        )
        rows = [
            _combine(name, measure, runs[(name, measure)])
            for name in paths
            for measure in _measures(args)
        ]
        if not router_ok:
            tail = (logs / "router.log").read_text(errors="replace")[-600:]
            notes.append(f"sglang-router did not serve (exit {router_proc.poll()}): {tail}")
    return _report(rows, notes, args)


def _report(rows: Sequence[Row], notes: Sequence[str], args: argparse.Namespace) -> str:
    by = {(r.path, r.measure): r for r in rows}
    lines = [_table(rows), ""]
    for measure in _measures(args)[:-1]:
        ours, theirs = by.get(("this gateway", measure)), by.get(("sglang-router 0.3.2", measure))
        if ours and theirs and theirs.rps:
            lines.append(
                f"- {measure}: this gateway / sglang-router = "
                f"{ours.rps / theirs.rps:.2f}x requests/s"
            )
    lines += [f"- {note}" for note in notes]
    levels = "/".join(str(c) for c in args.concurrency)
    lines.append(
        f"- settings: {args.workers} simulated workers, {args.rounds} interleaved "
        f"rounds; closed loop at {levels} concurrent for {args.duration:g} s "
        "per cell, open loop "
        f"at {args.rate:g} rps; max_tokens {CHAT_BODY['max_tokens']}; "
        f"machine: {os.cpu_count()} cores shared by every process."
    )
    return "\n".join(lines)


def _write_section(text: str, command: str) -> None:
    path = Path("BENCHMARKS.md")
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    heading = "## Gateway overhead"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = f"{heading}\n\nCommand: `{command}` (run {when}).\n\n{text}\n"
    start = doc.find(heading)
    if start == -1:
        doc = doc.rstrip("\n") + "\n\n" + body
    else:
        end = doc.find("\n## ", start + len(heading))
        doc = doc[:start] + body + ("" if end == -1 else doc[end:])
    path.write_text(doc)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return _client_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m loadtests.micro.gateway")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[8, 32], help="closed-loop concurrency levels"
    )
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions")
    parser.add_argument(
        "--write-benchmarks",
        action="store_true",
        help="replace the '## Gateway overhead' section of BENCHMARKS.md",
    )
    args = parser.parse_args(argv)
    text = _orchestrate(args)
    print(text)
    if args.write_benchmarks:
        _write_section(text, "python -m loadtests.micro.gateway " + " ".join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
