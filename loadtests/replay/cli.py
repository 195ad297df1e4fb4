"""Offline replay: a workload or trace through the gateway's own routing parts and the
simulated SGLang worker model, on a virtual clock, with the bounds beside the result.

Usage::

    python -m loadtests.replay --trace loadtests/data/mooncake_synthetic.jsonl \\
        --workers 4 --capacity-tokens 200000 --policy min_ttft --limit 500 --out out/r1
    python -m loadtests.replay --workload generated-shared-prefix \\
        --workload-arg request_rate=20 --workers 8 --capacity-tokens 430000 --policy cache_aware
    python -m loadtests.replay sweep --trace ... --policy min_ttft \\
        --grid work_weight=0,0.5,1 --time-scales 1,2,3 --slo-s 2 --out out/sweep
    python -m loadtests.replay --workload tenants --workers 8 --capacity-tokens 307328 \
        --page-size 16 --exact --no-bounds          # exact mode: routed on the KV events
    python -m loadtests.replay compare out/r1 out/r2     # one Markdown table

``--trace`` reads ``.jsonl`` as Mooncake and ``.csv`` as Azure 2023. ``--time-scale 3``
compresses arrivals threefold. ``--policy sglang_cache_aware`` selects the reference
re-implementation of sglang-router's rule (``loadtests/replay/sglang_rule.py``).
Outputs (``--out``): ``summary.json``, ``summary.md``, PNG charts; the table is printed.
See ``docs/REPLAY.md`` for every figure's definition.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from loadtests.replay.compare import compare_main
from loadtests.replay.report import render_table, write_outputs
from loadtests.replay.run import add_common_args, config_from_args, replay
from loadtests.replay.sweep import sweep_main


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "sweep":
        return sweep_main(args[1:])
    if args and args[0] == "compare":
        return compare_main(args[1:])
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser)
    parser.add_argument("--time-scale", type=float, default=1.0)
    ns = parser.parse_args(args)
    try:
        config = config_from_args(ns, ns.time_scale)
        summary, outcome = replay(config)
    except ValueError as exc:
        parser.error(str(exc))
    print(render_table(summary))
    if ns.out is not None:
        for note in write_outputs(ns.out, summary, outcome.records, outcome.timelines):
            print(note)
        print(f"wrote {ns.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
