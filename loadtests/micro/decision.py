"""Cost of one routing decision at 8, 64 and 256 workers, with a realistically full index.

Run: ``python -m loadtests.micro.decision [--fleets 8 64 256] [--requests 3000]
[--profile min_ttft]``. Prints a Markdown table for BENCHMARKS.md ("Scale").

What is timed, per request, is what ``gateway.routing.router.Router.handle`` does between
a parsed request and sending it: ``RoutingCore.estimate``, ``WorkerRegistry.candidates``,
``RoutingCore.choose`` (views with the index match, the policy's ``select``),
``RoutingCore.dispatch`` (the recording in the index, the lease) and the decision record
(``DecisionRecord.from_decision``, the router's extra fields, ``DecisionLog.add``). As
live, the index defers a recording's bookkeeping (``PrefixIndex.defer``: only the holder
marks on the request's path); the rest, ``PrefixIndex.flush``, which the gateway runs at
the event loop's next turn, runs after each decision here and is timed apart (the table's
last column); ``--record-at-once`` puts it back on the decision's path. Wall
time of each decision with ``time.perf_counter_ns``, the garbage collector on (as live);
p50 / p99 / max over ``--requests`` decisions after ``--warmup`` untimed ones. Not timed:
parsing and hashing the body (``loadtests.micro.index`` measures those), telemetry hooks,
and the end of each request (``RoutingCore.feedback`` with the worker's report, the
lease's release), which runs between two decisions.

Index contents (per fleet size, built once and shared by the three policies' runs in
turn, each run continuing from the state the previous left): every worker reports
``--capacity-tokens`` of KV (420,000: one H100-80GB for an 8B model, the index's default
26,250 blocks of 16 tokens) and holds conversations until its share of the index is full:
conversation ``c`` goes to worker ``c mod W``; its prompt is one of ``--system-prompts``
system prompts of 2,048 tokens (128 blocks) followed by a history of 1,000 to 16,000
tokens (uniform); each worker's LRU ends at its capacity, so 256 workers hold 6.7 million
blocks (each system prompt's blocks held by about every worker). Block hashes are
synthetic chains (their values only key dicts; hashing is not what is measured).

Requests: 70 % the next turn of a conversation held somewhere (its history plus 200 new
tokens: every worker holding its system prompt matches 128 blocks, its holder more), 20 %
a new conversation on one of the system prompts, 10 % a cold prompt of 1,000 to 4,000
tokens. Each worker has engine load figures as a poll leaves them and a calibrated cost
model; ``--in-flight`` requests per worker stay outstanding (the oldest is finished, with
its feedback, before each new decision), so the leases, pins and load counts are those of
a busy gateway.

``--profile POLICY`` runs cProfile over that policy's decisions at the largest fleet and
prints the top functions by internal time. ``--shortlist-above N`` (default the
routing core's, 64; 0: never) and ``--shortlist-least-loaded K``: the candidate shortlist
(``gateway.routing.decide.Shortlist``); printed: the mean number of
candidates the policy saw (a line per cell). ``--phases`` prints, per cell, the mean CPU
time of each phase (estimate, candidates, choose, record, dispatch; a clock read between
phases, so the cells' own figures grow by about a microsecond) and, in brackets, its p99
over the timed decisions (each phase's own: they need not fall on the same decisions).

The collector's load, after the timed decisions (with their requests still in flight):
the objects it tracks (thousands: what every full collection walks) and the CPU time of
one full collection forced then. ``--gc-freeze``: ``gc.freeze()`` once the modules are
imported, before any fleet is built, as a gateway could right after start-up: the
interpreter's and the libraries' own objects then leave every full collection.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import random
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from gateway.app import ttft_estimate
from gateway.routing.cost_model import CostModel
from gateway.routing.decide import Choice, RoutingCore, Shortlist
from gateway.routing.decisions import DecisionLog, DecisionRecord
from gateway.routing.lease import Lease
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RouteRequest
from gateway.routing.tokens import TokenAccounting
from gateway.workers.registry import Worker, WorkerRegistry
from policies.base import EngineLoad
from policies.registry import create_policy

BLOCK_CHARS = 64
CHARS_PER_TOKEN = 4.0
BLOCK_TOKENS = BLOCK_CHARS / CHARS_PER_TOKEN  # 16, the index's default
SYSTEM_BLOCKS = 128  # 2,048 tokens
TURN_BLOCKS = 13  # about 200 tokens of a new user message
POLICIES = ("min_ttft", "cache_aware", "round_robin")


@dataclass(slots=True)
class Fleet:
    """One fleet size's state: the registry, the index, the conversations it holds."""

    registry: WorkerRegistry
    workers: list[Worker]
    index: PrefixIndex
    costs: CostModel
    tokens: TokenAccounting
    # each one's block chain: tuples, which the garbage collector stops tracking (lists
    # of millions of hashes would add the benchmark's own data to every full collection)
    conversations: list[tuple[int, ...]]
    blocks: int  # blocks in the index (sum over workers)


def _chain(tag: tuple[int, ...], n: int) -> list[int]:
    return [hash((*tag, i)) for i in range(n)]


def build_fleet(workers: int, capacity_tokens: int, system_prompts: int, seed: int) -> Fleet:
    rng = random.Random(seed)
    clock = [0.0]
    registry = WorkerRegistry(0.5, lambda: clock[0])
    index = PrefixIndex(block_tokens=BLOCK_TOKENS, clock=lambda: clock[0])
    costs = CostModel()
    fleet: list[Worker] = []
    for w in range(workers):
        worker, _ = registry.add(f"http://10.0.{w // 250}.{w % 250 + 1}:30000", "sglang")
        worker.flags.clear()  # probed healthy
        worker.metadata.capacity_tokens = capacity_tokens
        worker.engine_load = EngineLoad(rng.randrange(16), rng.randrange(4), None, 0.5)
        index.set_capacity(worker.id, capacity_tokens)
        for _ in range(20):  # calibrated: TTFTs observed
            costs.observe(worker.id, rng.randrange(200, 4000), rng.randrange(5000), 0.05)
        fleet.append(worker)
    systems = [_chain((1, s), SYSTEM_BLOCKS) for s in range(system_prompts)]
    conversations: list[tuple[int, ...]] = []
    full = [False] * workers
    capacity = index.capacity_blocks(fleet[0].id)
    c = 0
    while not all(full):
        w = c % workers
        if not full[w]:
            history = rng.randint(1_000, 16_000) // int(BLOCK_TOKENS)
            chain = systems[rng.randrange(system_prompts)] + _chain((2, c), history)
            index.record(chain, fleet[w].id, now=0.0, pin=False)
            conversations.append(tuple(chain))
            full[w] = index.stats(fleet[w].id).blocks >= capacity
        c += 1
    blocks = sum(index.stats(w.id).blocks for w in fleet)
    tokens = TokenAccounting(CHARS_PER_TOKEN, BLOCK_CHARS)
    return Fleet(registry, fleet, index, costs, tokens, conversations, blocks)


def _request(chain: list[int]) -> RouteRequest:
    chars = len(chain) * BLOCK_CHARS
    return RouteRequest(
        kind=ApiKind.CHAT,
        model="m",
        stream=True,
        include_usage=True,
        prompt_chars=chars,
        prompt_tokens=int(chars / CHARS_PER_TOKEN),
        block_hashes=chain,
        routing_key=None,
        rid=None,
        body=b"",
        block_chars=BLOCK_CHARS,
    )


def make_requests(fleet: Fleet, n: int, system_prompts: int, seed: int) -> Iterator[RouteRequest]:
    """``n`` requests, each made when asked for (as live, only those in flight exist)."""
    rng = random.Random(seed)
    for i in range(n):
        draw = rng.random()
        if draw < 0.7:
            held = rng.choice(fleet.conversations)
            chain = [*held, *_chain((3, seed, i), TURN_BLOCKS)]
        elif draw < 0.9:
            system = _chain((1, rng.randrange(system_prompts)), SYSTEM_BLOCKS)
            chain = system + _chain((4, seed, i), rng.randint(5, 60))
        else:
            chain = _chain((5, seed, i), rng.randint(1_000, 4_000) // int(BLOCK_TOKENS))
        yield _request(chain)


@dataclass(frozen=True, slots=True)
class _Report:
    """The worker's answer, as ``RoutingCore.feedback`` reads it."""

    status: int
    ttft_s: float | None
    cached_tokens: int | None
    prompt_tokens: int | None


class Decider:
    """The router's decision phases, in its order, over one fleet and policy."""

    def __init__(
        self,
        fleet: Fleet,
        policy: str,
        seed: int,
        in_flight_per_worker: int,
        shortlist: Shortlist | None = None,
        deferred: bool = True,
    ) -> None:
        self.fleet = fleet
        self.core = RoutingCore(
            create_policy(policy),
            fleet.index,
            fleet.costs,
            random.Random(seed),
            fleet.tokens,
            ttft_estimate(),
        )
        self.core.tiers = fleet.index  # as gateway.app (no worker here has a host tier)
        if shortlist is not None:
            self.core.shortlist = shortlist
        # as live (``gateway.app``): the recording's bookkeeping waits for ``flush``,
        # which ``run`` calls after each decision, timed apart (``deferred``); False:
        # recorded at once, on the decision's path
        fleet.index.defer((lambda: None) if deferred else None)
        self.deferred: list[int] = []  # CPU ns of each timed decision's flush
        self.left_out = 0  # candidates the shortlist left out, over the timed decisions
        self.log = DecisionLog()
        self.outstanding: deque[tuple[RouteRequest, Choice, Lease]] = deque()
        self.limit = in_flight_per_worker * len(fleet.workers)
        self.now = 1.0
        # ``--phases``: CPU ns per phase of each timed decision (None: not measured)
        self.phases: dict[str, list[int]] | None = None
        self._marked = 0

    def decide(self, req: RouteRequest, n: int) -> tuple[RouteRequest, Choice, Lease]:
        """One decision, as ``Router.handle`` and ``Router._attempt`` make it."""
        core, registry, mark = self.core, self.fleet.registry, self.mark
        mark("")
        core.estimate(req)
        mark("estimate")
        workers = registry.candidates((), req.model, None, None)
        mark("candidates")
        choice = core.choose(req, workers, self.now, None, None, None)
        mark("choose")
        record = DecisionRecord.from_decision(
            request_id=f"r{n}",
            policy=choice.policy.name,
            decision=choice.decision,
            candidates=choice.views,
            prompt_tokens=req.prompt_tokens,
            model=req.model,
        )
        record.arm, record.shadows = choice.arm, choice.shadows
        record.estimated_ttft_s = choice.estimated_ttft_s
        self.log.add(record)
        mark("record")
        lease = core.dispatch(req, choice, self.now, None)
        record.index_mode = choice.index_mode
        mark("dispatch")
        return req, choice, lease

    def mark(self, phase: str) -> None:
        """With ``phases`` on, charge the CPU time since the last mark to ``phase``."""
        if self.phases is None:
            return
        now = time.thread_time_ns()
        if phase:
            self.phases.setdefault(phase, []).append(now - self._marked)
        self._marked = now

    def finish_oldest(self) -> None:
        """The oldest outstanding request ends: the worker reports the predicted prefix
        cached, the lease is released (not timed)."""
        req, choice, lease = self.outstanding.popleft()
        report = _Report(200, 0.05, choice.matched_tokens, req.prompt_tokens)
        self.core.feedback(req, choice, lease, report, self.now, None)
        lease.release()

    def run(
        self,
        requests: Iterable[RouteRequest],
        timed: bool,
        profiler: cProfile.Profile | None = None,
    ) -> tuple[list[int], list[int]]:
        """Decide every request; when ``timed``, the wall and CPU time of each (ns).
        ``profiler`` is on during the decisions only."""
        walls: list[int] = []
        cpus: list[int] = []
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        for n, req in enumerate(requests):
            while len(self.outstanding) >= self.limit:
                self.finish_oldest()
            self.now += 0.001
            if profiler is not None:
                profiler.enable()
            c0, w0 = cpu(), wall()
            outcome = self.decide(req, n)
            w1, c1 = wall(), cpu()
            if profiler is not None:
                profiler.disable()
            self.fleet.index.flush()  # the event loop's next turn
            c2 = cpu()
            self.outstanding.append(outcome)
            if timed:
                walls.append(w1 - w0)
                cpus.append(c1 - c0)
                self.deferred.append(c2 - c1)
                self.left_out += outcome[1].left_out
        return walls, cpus


class GcPauses:
    """Collections of the cyclic garbage collector while installed: count and longest
    pause of the full (generation 2) ones, longest pause of any."""

    def __init__(self) -> None:
        self.full = 0
        self.longest_full_s = 0.0
        self.longest_s = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        self.longest_s = max(self.longest_s, pause)
        if info["generation"] == 2:
            self.full += 1
            self.longest_full_s = max(self.longest_full_s, pause)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


@dataclass(frozen=True, slots=True)
class Row:
    workers: int
    blocks: int
    policy: str
    p50_us: float  # wall
    p99_us: float
    max_us: float
    cpu_p50_us: float  # this thread's CPU time
    cpu_p99_us: float
    holders: float  # mean number of workers the index matched per request
    full_gcs: int  # full collections during the timed decisions
    longest_gc_ms: float  # longest collection (any generation)
    tracked_k: float  # objects the collector tracks after them, thousands
    full_gc_cpu_ms: float  # CPU time of one full collection forced then
    seen: float  # mean candidates the policy saw (all of them without a shortlist)
    deferred_p50_us: float  # CPU of the index bookkeeping after the decision (``flush``)
    deferred_p99_us: float


def _pct(sorted_ns: Sequence[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1e3


def measure(
    fleet: Fleet,
    policy: str,
    args: argparse.Namespace,
    profile: bool = False,
) -> Row:
    shortlist = Shortlist(args.shortlist_above, args.shortlist_least_loaded)
    decider = Decider(
        fleet, policy, args.seed, args.in_flight, shortlist, deferred=not args.record_at_once
    )
    sample = make_requests(fleet, 300, args.system_prompts, args.seed + 3)
    holders = statistics.fmean(len(fleet.index.match(r.block_hashes)) for r in sample)
    decider.run(make_requests(fleet, args.warmup, args.system_prompts, args.seed + 1), False)
    timed = make_requests(fleet, args.requests, args.system_prompts, args.seed + 2)
    profiler = cProfile.Profile() if profile else None
    if args.phases:
        decider.phases = {}
    with GcPauses() as pauses:
        walls, cpus = decider.run(timed, True, profiler)
    seen = len(fleet.workers) - decider.left_out / len(cpus)
    print(f"# {len(fleet.workers)} workers, {policy}: candidates the policy saw (mean) {seen:.1f}")
    if decider.phases is not None:
        means = ", ".join(
            f"{k} {sum(v) / 1e3 / len(v):,.0f} ({_pct(sorted(v), 0.99):,.0f})"
            for k, v in decider.phases.items()
        )
        print(f"# {len(fleet.workers)} workers, {policy}: mean CPU µs per phase (p99): {means}")
    times, cpu_times = sorted(walls), sorted(cpus)
    if profiler is not None:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
        stats.print_stats(18)
        print(out.getvalue())
    tracked = len(gc.get_objects())
    c0 = time.thread_time()
    gc.collect()
    full_gc_cpu_s = time.thread_time() - c0
    while decider.outstanding:
        decider.finish_oldest()
    deferred = sorted(decider.deferred)
    return Row(
        len(fleet.workers),
        fleet.blocks,
        policy,
        _pct(times, 0.50),
        _pct(times, 0.99),
        times[-1] / 1e3,
        _pct(cpu_times, 0.50),
        _pct(cpu_times, 0.99),
        holders,
        pauses.full,
        pauses.longest_s * 1e3,
        tracked / 1e3,
        full_gc_cpu_s * 1e3,
        seen,
        _pct(deferred, 0.50),
        _pct(deferred, 0.99),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fleets", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--requests", type=int, default=3000, help="timed decisions per cell")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--capacity-tokens", type=int, default=420_000)
    parser.add_argument("--system-prompts", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=4, help="outstanding per worker")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", metavar="POLICY", help="cProfile it at the largest fleet")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before building")
    parser.add_argument("--phases", action="store_true", help="mean CPU time of each phase")
    parser.add_argument(
        "--record-at-once",
        action="store_true",
        help="the index recording's bookkeeping on the decision's path (not deferred)",
    )
    default = Shortlist()
    parser.add_argument(
        "--shortlist-above",
        type=int,
        default=default.above,
        help="candidate shortlist above this many workers (0: never; RoutingCore.shortlist)",
    )
    parser.add_argument("--shortlist-least-loaded", type=int, default=default.least_loaded)
    args = parser.parse_args(argv)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    load_before = os.getloadavg()[0]
    rows: list[Row] = []
    largest = max(args.fleets)
    for workers in args.fleets:
        built = time.perf_counter()
        fleet = build_fleet(workers, args.capacity_tokens, args.system_prompts, args.seed)
        gc.collect()
        print(
            f"# {workers} workers: {fleet.blocks:,} blocks, {len(fleet.conversations):,} "
            f"conversations, built in {time.perf_counter() - built:.1f} s",
            flush=True,
        )
        for policy in args.policies:
            profile = args.profile == policy and workers == largest
            rows.append(measure(fleet, policy, args, profile))
        del fleet
        gc.collect()
    print()
    print(
        "| workers | blocks in the index | policy | workers matched per request (mean) "
        "| p50 µs | p99 µs | max µs | CPU p50 µs | CPU p99 µs | full GCs | longest GC ms "
        "| tracked objects (k) | one full GC, CPU ms | deferred CPU p50 / p99 µs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.workers} | {r.blocks:,} | {r.policy} | {r.holders:.1f} | {r.p50_us:,.0f} "
            f"| {r.p99_us:,.0f} | {r.max_us:,.0f} | {r.cpu_p50_us:,.0f} | {r.cpu_p99_us:,.0f} "
            f"| {r.full_gcs} | {r.longest_gc_ms:,.1f} | {r.tracked_k:,.0f} "
            f"| {r.full_gc_cpu_ms:,.1f} | {r.deferred_p50_us:,.0f} / {r.deferred_p99_us:,.0f} |"
        )
    print()
    print(
        f"- {args.requests} timed decisions per cell after {args.warmup} untimed; "
        f"{args.in_flight} requests in flight per worker; load average (1 min) "
        f"before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f} "
        f"({os.cpu_count()} cores, shared)"
        + ("; gc.freeze() before building" if args.gc_freeze else "")
        + ("; recorded at once (not deferred)" if args.record_at_once else "")
        + (
            f"; shortlist above {args.shortlist_above} workers "
            f"({args.shortlist_least_loaded} least loaded)"
            if args.shortlist_above
            else "; no shortlist"
        )
    )
    if args.gc_freeze:
        gc.unfreeze()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
