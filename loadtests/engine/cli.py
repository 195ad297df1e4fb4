"""Command-line parsing for ``python -m loadtests.engine.llama_fleet``."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtests.engine.tiny_model import ensure_tiny_model


def _add_worker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slots", type=int, default=2, help="parallel slots per worker")
    parser.add_argument("--ctx-per-slot", type=int, default=4096, help="context of each slot")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    parser.add_argument(
        "--cache-ram-mib", type=int, default=0, help="host-RAM prompt cache (0: slots only)"
    )
    parser.add_argument("--alias", default="tiny-llama", help="model name the worker reports")


def _fleet_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.engine.llama_fleet",
        description="Start K llama.cpp workers on 127.0.0.1; Ctrl-C or SIGTERM stops them.",
    )
    parser.add_argument("--workers", type=int, default=4, help="how many workers (K)")
    parser.add_argument(
        "--base-port", type=int, default=None, help="ports base..base+K-1 (default: any free)"
    )
    parser.add_argument(
        "--model", default=None, help="GGUF path (default: the tiny model, built if absent)"
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="keep worker logs here")
    _add_worker_options(parser)
    return parser


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.engine.llama_fleet serve",
        description="Run one llama.cpp worker in this process until SIGTERM.",
    )
    parser.add_argument("--port", type=int, required=True, help="0: any free port")
    parser.add_argument("--model", required=True, help="GGUF path")
    parser.add_argument("--url-file", type=Path, default=None, help="write the URL here")
    _add_worker_options(parser)
    return parser


def parse_fleet_args(argv: list[str]) -> argparse.Namespace:
    """Parse either ``serve ...`` (one worker) or the fleet options; sets ``command``."""
    if argv[:1] == ["serve"]:
        args = _serve_parser().parse_args(argv[1:])
        args.command = "serve"
        return args
    args = _fleet_parser().parse_args(argv)
    args.command = "fleet"
    if args.model is None:
        args.model = str(ensure_tiny_model())
    return args
