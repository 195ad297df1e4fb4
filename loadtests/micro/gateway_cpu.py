"""The gateway's own CPU per request, side by side with other builds of it and sglang-router.

    python -m loadtests.micro.gateway_cpu [--workers 2] [--duration 6] [--concurrency 32]
        [--rounds 3] [--gateway LABEL=DIR ...] [--simulator-from DIR] [--no-router]
        [--policy round_robin]

Why another bench: ``loadtests.micro.gateway`` measures what a client sees (requests/s,
latency); a change to the request path's parser shows first in the gateway's own CPU
time, which on 2 shared cores is hidden inside the client's and the workers' noise. This
one reads each proxy process's CPU time (user + system, from ``/proc``) before and after every
measurement and divides by the requests it served.

Each ``--gateway LABEL=DIR`` starts a gateway from the source tree ``DIR`` (its
``gateway`` and ``policies`` packages, e.g. ``git archive <commit> gateway policies | tar
-x -C DIR``; default: this tree), all on the same workers: a before/after comparison in
one run, the paths interleaved round by round so background load falls on each alike.
sglang-router 0.3.2 (the ``bench`` extra) runs too unless ``--no-router`` or it is not
installed. Simulated workers, gateways and the load generator (``loadtests.micro.gateway
client``) are processes of their own, on 127.0.0.1, stopped by PID.

Cost: ``rounds x 2 x paths`` client runs of ``--duration`` s each (3 x 2 x 3 x 6 s ≈ 2 min).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.harness.ports import free_port_range, free_ports
from loadtests.harness.procs import cpu_seconds, running
from loadtests.micro.gateway import (
    CHAT_PATH,
    _gateway_cmd,
    _ready,
    _router_cmd,
    _run_client,
    _simulator_cmd,
    _wait_chat,
)

ROUTER = "sglang-router 0.3.2"


@dataclass
class Cell:
    """One path x one measure, over the rounds."""

    cpu_us: list[float] = field(default_factory=list)  # per request, one value per round
    rps: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, cwd: Path | None = None) -> Iterator[int]:
    """Run ``cmd`` (in ``cwd``: ``python -m`` imports that tree's packages first) and
    yield its PID; stopped by its process group."""
    with running(cmd, log=log, grace_s=10.0, group=True, cwd=cwd) as proc:
        yield proc.pid


def _measure(
    pid: int, url: str, stream: bool, args: argparse.Namespace
) -> tuple[float, dict[str, Any]]:
    # every proxy measured here is one process: the gateway serves on one event loop,
    # sglang-router on threads
    before = cpu_seconds(pid)
    result = _run_client(
        [url + CHAT_PATH], stream=stream, concurrency=args.concurrency, duration=args.duration
    )
    used = cpu_seconds(pid) - before
    return used * 1e6 / max(1, result["requests"]), result


def _table(cells: dict[tuple[str, str], Cell], paths: Sequence[str]) -> str:
    lines = [
        "| path | measure | gateway CPU µs/request (median) | requests/s (median) "
        "| errors/requests |",
        "|---|---|---|---|---|",
    ]
    for name in paths:
        for measure in ("non-stream", "stream"):
            c = cells[(name, measure)]
            lines.append(
                f"| {name} | {measure} | {statistics.median(c.cpu_us):,.0f} "
                f"| {statistics.median(c.rps):,.0f} | {c.errors}/{c.requests} |"
            )
    return "\n".join(lines)


def _ratios(cells: dict[tuple[str, str], Cell], paths: Sequence[str]) -> list[str]:
    out = []
    base = paths[0]
    for name in paths[1:]:
        for measure in ("non-stream", "stream"):
            ours = statistics.median(cells[(base, measure)].cpu_us)
            theirs = statistics.median(cells[(name, measure)].cpu_us)
            out.append(f"- {measure}: {base} / {name} CPU per request = {ours / theirs:.2f}x")
    return out


def run(args: argparse.Namespace) -> str:
    logs = Path(tempfile.mkdtemp(prefix="gateway_cpu_"))
    model_dir = tempfile.mkdtemp(prefix="sim_model_")
    base_port = free_port_range(args.workers)
    urls = [f"http://127.0.0.1:{base_port + i}" for i in range(args.workers)]
    trees: dict[str, Path] = {}
    for spec in args.gateway or ["this tree=."]:
        label, _, tree = spec.partition("=")
        trees[label] = Path(tree).resolve()
    router = not args.no_router and importlib.util.find_spec("sglang_router") is not None
    ports = free_ports(len(trees) + 1)
    targets: dict[str, tuple[str, int]] = {}
    with contextlib.ExitStack() as stack:
        sim_tree = Path(args.simulator_from).resolve() if args.simulator_from else Path.cwd()
        stack.enter_context(
            _process(
                _simulator_cmd(base_port, args.workers, model_dir),
                logs / "simulator.log",
                cwd=sim_tree,
            )
        )
        for (label, tree), port in zip(trees.items(), ports, strict=False):
            log = logs / f"gateway-{len(targets)}.log"
            cmd = _gateway_cmd(port, urls)
            cmd[cmd.index("--policy") + 1] = args.policy
            pid = stack.enter_context(_process(cmd, log, cwd=tree))
            targets[label] = (f"http://127.0.0.1:{port}", pid)
        if router:
            pid = stack.enter_context(_process(_router_cmd(ports[-1], urls), logs / "router.log"))
            targets[ROUTER] = (f"http://127.0.0.1:{ports[-1]}", pid)
        first = next(iter(targets.values()))[0]
        ok, _ = asyncio.run(_ready(urls, first, None))
        if not ok:
            raise SystemExit(f"workers or gateway did not start; logs in {logs}")
        for label, (url, _pid) in list(targets.items()):
            if not asyncio.run(_wait_chat(url, 30)):
                print(f"{label} did not serve; left out (logs in {logs})", file=sys.stderr)
                del targets[label]
        cells: dict[tuple[str, str], Cell] = {}
        for _ in range(args.rounds):
            for measure in ("non-stream", "stream"):
                for label, (url, pid) in targets.items():
                    cpu_us, result = _measure(pid, url, measure == "stream", args)
                    cell = cells.setdefault((label, measure), Cell())
                    cell.cpu_us.append(cpu_us)
                    cell.rps.append(result["rps"])
                    cell.errors += result["errors"]
                    cell.requests += result["requests"]
    paths = list(targets)
    notes = [
        f"- settings: gateways' policy {args.policy}, {args.workers} simulated workers, "
        f"{args.rounds} interleaved rounds, "
        f"closed loop at {args.concurrency} concurrent for {args.duration:g} s per cell, "
        f"chat with max_tokens 8; machine: {os.cpu_count()} cores shared by every process."
    ]
    return "\n".join([_table(cells, paths), "", *_ratios(cells, paths), *notes])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.micro.gateway_cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--gateway",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="a gateway from this source tree, side by side with the others (repeatable; "
        "default: this tree)",
    )
    parser.add_argument(
        "--simulator-from", metavar="DIR", help="run the simulated workers from this tree"
    )
    parser.add_argument("--no-router", action="store_true", help="leave sglang-router out")
    parser.add_argument(
        "--policy", default="round_robin", help="the gateways' policy (sglang-router: round_robin)"
    )
    print(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
