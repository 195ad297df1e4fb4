"""Cost of the prefix index: hashing + matching a long prompt, recording, memory per block.

Run: ``python -m loadtests.micro.index [--runs 300]``. Prints a Markdown table for
BENCHMARKS.md ("Prefix index cost"). Times are medians and p99 of ``--runs`` repetitions
(wall time with ``time.perf_counter``, CPU time with ``time.thread_time``); memory is
measured with tracemalloc on a separate index.

Scenario for timing: 8 workers, each holding its worker's default capacity (26,250
blocks) of other prompts; the 512,000-character prompt (8,000 blocks of 64) is held in
full by one worker and in part (the first 4,000 blocks) by a second, so matching cannot
stop early (the slowest case).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

import orjson

from gateway.routing.hashing import block_hashes, seed_for
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RequestSettings, parse_request

PROMPT_CHARS = 512_000
WORKERS = 8


def _text(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words = [f"w{rng.randrange(50_000)}" for _ in range(chars // 4)]
    return " ".join(words)[:chars]


def _timings(fn: Callable[[], object], runs: int) -> tuple[float, float, float]:
    """Median wall time, p99 wall time, median CPU time of this thread (seconds).

    CPU time is the cost itself; wall time also counts time the thread waited for a core
    (the benchmark machine's 2 cores are shared)."""
    walls, cpus = [], []
    for _ in range(runs):
        cpu, start = time.thread_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - cpu)
    walls.sort()
    p99 = walls[min(len(walls) - 1, int(0.99 * len(walls)))]
    return statistics.median(walls), p99, statistics.median(cpus)


def _filled_index(prompt_hashes: list[int]) -> PrefixIndex:
    index = PrefixIndex()
    filler = 0
    for w in range(WORKERS):
        worker = f"w{w}"
        blocks = index.capacity_blocks(worker)
        # other prompts, 100 blocks each, until the worker's LRU is full
        while blocks > 0:
            n = min(100, blocks)
            index.record([hash((filler, i)) for i in range(n)], worker, now=0.0)
            filler += 1
            blocks -= n
    index.record(prompt_hashes, "w0", now=1.0)
    index.record(prompt_hashes[: len(prompt_hashes) // 2], "w1", now=1.0)
    return index


def time_hash_and_match(runs: int) -> list[tuple[str, float, float, float]]:
    text = _text(PROMPT_CHARS, 1)
    seed = seed_for("model", None)
    hashes = block_hashes(text, 64, seed)
    index = _filled_index(hashes)
    assert index.match(hashes) == {"w0": len(hashes), "w1": len(hashes) // 2}
    body = orjson.dumps({"model": "model", "messages": [{"role": "user", "content": text}]})
    settings = RequestSettings()
    rows = [
        (
            "hash 512,000 chars (8,000 blocks)",
            *_timings(lambda: block_hashes(text, 64, seed), runs),
        ),
        (
            "match 8,000 blocks (full match, 8 workers)",
            *_timings(lambda: index.match(hashes), runs),
        ),
        (
            "hash + match",
            *_timings(lambda: index.match(block_hashes(text, 64, seed)), runs),
        ),
        (
            "parse_request (chat, 512 kB) + match",
            *_timings(
                lambda: index.match(parse_request(ApiKind.CHAT, body, {}, settings).block_hashes),
                runs,
            ),
        ),
        (
            "record 8,000 blocks already held (refresh)",
            *_timings(lambda: index.record(hashes, "w0"), runs),
        ),
    ]
    fresh_worker = iter(range(10**9))

    def record_new() -> None:
        index.record(hashes, f"new{next(fresh_worker) % 4}")

    rows.append(
        ("record 8,000 blocks on a worker (mostly new)", *_timings(record_new, min(runs, 50)))
    )
    return rows


def memory_per_block(blocks_per_worker: int = 26_250, holders: int = 1) -> float:
    """Bytes per distinct indexed block, each held by ``holders`` workers."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(default_capacity_blocks=blocks_per_worker)
    for w in range(WORKERS):
        base = (w // holders) * blocks_per_worker
        for start in range(0, blocks_per_worker, 1000):
            index.record(
                [(base + i) * 2_654_435_761 % (1 << 63) for i in range(start, start + 1000)],
                f"w{w}",
                now=0.0,
            )
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    distinct = WORKERS * blocks_per_worker // holders
    del index
    return (after - before) / distinct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    print("| operation | median (wall) | p99 (wall) | median CPU time |")
    print("|---|---|---|---|")
    for name, median, p99, cpu in time_hash_and_match(args.runs):
        print(f"| {name} | {median * 1e3:.3f} ms | {p99 * 1e3:.3f} ms | {cpu * 1e3:.3f} ms |")
    print()
    print("| memory | bytes per indexed block |")
    print("|---|---|")
    print(f"| 8 workers x 26,250 blocks, one holder each | {memory_per_block(holders=1):.0f} |")
    shared = memory_per_block(holders=2)
    print(f"| 8 workers x 26,250 blocks, each block on 2 workers | {shared:.0f} |")


if __name__ == "__main__":
    main()
