"""``make demo-real``: the gateway in front of four real llama.cpp workers.

Builds the tiny random-weights model on first use (cached in ``.cache/``), starts four
llama.cpp servers (one thread, two slots each, no RAM prompt cache: each holds exactly two
prompts), then the gateway on http://127.0.0.1:30000 with ``min_ttft``. Ctrl-C stops all.
The model's text is gibberish: it is there for real prefill work and real KV reuse.
"""

from __future__ import annotations

import argparse
import sys

from loadtests.demo import serve_until_stopped
from loadtests.engine.llama_fleet import LlamaFleet
from loadtests.engine.tiny_model import ensure_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2, help="prompts each worker holds")
    parser.add_argument("--ctx-per-slot", type=int, default=4096)
    parser.add_argument("--port", type=int, default=30000, help="the gateway's port")
    parser.add_argument("--policy", default="min_ttft")
    args = parser.parse_args(argv)
    model = ensure_tiny_model()
    with LlamaFleet.start(
        args.workers, model, slots=args.slots, ctx_per_slot=args.ctx_per_slot
    ) as fleet:
        gateway = f"http://127.0.0.1:{args.port}"
        cmd = [
            sys.executable,
            "-m",
            "gateway",
            "--port",
            str(args.port),
            "--policy",
            args.policy,
            "--worker-urls",
            *fleet.urls,
        ]
        serve_until_stopped(cmd, gateway, f"{args.workers} llama.cpp workers", [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
