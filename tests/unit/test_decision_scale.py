"""A decision at a large fleet (issue 22, "Scale"): what the cheaper paths must keep.

The views built in one pass (``registry.views_of``) are the workers' own views; the
routing core drops a choice's views at dispatch, after the decision record copied them;
the record keeps its candidates as columns (``CandidateColumns``) that read as the
``CandidateScore`` s they replace, in ``to_dict`` too; ``min_ttft`` decides as its
written-out rule (the reference below, the policy's steps without the shortcuts)."""

from __future__ import annotations

import dataclasses
import gc
import math
import random
from collections.abc import Sequence

import pytest

from gateway.routing.cost_model import CostModel
from gateway.routing.decide import RoutingCore
from gateway.routing.decisions import CandidateColumns, CandidateScore, DecisionRecord
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RouteRequest
from gateway.workers.registry import Worker, WorkerRegistry, views_of
from policies.base import Decision, EngineLoad, RouteContext, WorkerCost, WorkerView
from policies.min_ttft import MinTtftPolicy


def _fleet(n: int, ranks: bool = False) -> tuple[WorkerRegistry, list[Worker]]:
    clock = [10.0]
    registry = WorkerRegistry(0.5, lambda: clock[0])
    rng = random.Random(3)
    for i in range(n):
        worker, _ = registry.add(f"http://127.0.0.1:{19100 + i}", "sglang")
        worker.flags.clear()
        worker.metadata.capacity_tokens = 1000 * (i + 1) if i % 3 else None
        worker.in_flight, worker.queued_prefill_tokens = rng.randrange(5), rng.randrange(900)
        worker.decoding_requests, worker.peer_in_flight = rng.randrange(3), rng.randrange(2)
        worker.peer_queued_prefill_tokens, worker.peer_decoding_requests = 7 * i, i % 2
        if i % 4:
            worker.engine_load = EngineLoad(i, i % 3, None if i % 2 else 40 * i, 0.1 * (i % 9))
            worker.load_read_at = 9.0 if i % 5 else 11.0  # read "after" now: age 0
    if ranks:  # the first worker routed to per DP rank: its ranks are candidates
        first = next(iter(registry))
        first.metadata.dp_size = 2
        assert registry.sync_ranks(first)
        rank = first.ranks[1]
        rank.in_flight, rank.engine_load, rank.load_read_at = 3, EngineLoad(1, 1, 5, 0.2), 9.5
    return registry, list(registry.candidates())


def _request(hashes: list[int], tokens: int = 64) -> RouteRequest:
    return RouteRequest(
        kind=ApiKind.CHAT, model=None, stream=False, include_usage=False,
        prompt_chars=4 * tokens, prompt_tokens=tokens, block_hashes=hashes, routing_key=None,
        rid=None, body=b"{}",
    )  # fmt: skip


# --- views -----------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [False, True])
def test_views_of_are_the_workers_own_views(ranks: bool) -> None:
    _, workers = _fleet(9, ranks)
    costs = {w.id: WorkerCost(1e-5 * (i + 1)) for i, w in enumerate(workers) if i % 2}
    matched = {w.id: 16 * i for i, w in enumerate(workers) if i % 3}
    setup = {workers[1].id: 0.5}
    free = {w.id: i for i, w in enumerate(workers) if i == 4}
    built = views_of(
        workers, 10.0, matched, lambda wid: costs.get(wid, WorkerCost()), free.get, setup
    )
    each = [
        w.view(
            10.0, matched.get(w.id, 0), costs.get(w.id, WorkerCost()), free.get(w.id),
            setup.get(w.id, 0.0),
        )
        for w in workers
    ]  # fmt: skip
    assert built == each
    assert [f.name for f in dataclasses.fields(WorkerView)][:11] == [
        "id",
        "in_flight",
        "queued_prefill_tokens",
        "decoding_requests",
        "capacity_tokens",
        "engine_load",
        "matched_tokens",
        "matched_host_tokens",
        "cost",
        "free_sequences",
        "setup_s",
    ]  # fmt: skip  (Worker.view and views_of pass them by position)
    ages = {v.id: v.engine_load.age_s for v in built if v.engine_load is not None}
    assert set(ages.values()) >= {0.0, 1.0}  # read at 9.0, and read "after" now: 0


def test_a_view_is_a_plain_copy_replace_still_works() -> None:
    view = WorkerView("w", 2, engine_load=EngineLoad(1, 2, 3, 0.5))
    other = dataclasses.replace(view, matched_host_tokens=5)
    assert other.matched_host_tokens == 5 and view.matched_host_tokens == 0
    assert other.engine_load is view.engine_load and other.id == "w"


# --- the choice's views, the record's candidates ---------------------------------------


def _core(policy: str = "min_ttft") -> tuple[RoutingCore, PrefixIndex]:
    from policies.registry import create_policy

    index = PrefixIndex(block_tokens=16.0, max_blocks_per_worker=1000)
    return RoutingCore(create_policy(policy), index, CostModel(), random.Random(0)), index


def test_dispatch_drops_the_views_after_the_record_copied_them() -> None:
    core, index = _core()
    _, workers = _fleet(6)
    index.record([1, 2, 3], workers[2].id, 0.0, pin=False)
    req = _request([1, 2, 3, 4])
    choice = core.choose(req, workers, 10.0)
    assert len(choice.views) == 6
    record = DecisionRecord.from_decision(
        request_id="r1", policy=choice.policy.name, decision=choice.decision,
        candidates=choice.views, prompt_tokens=req.prompt_tokens,
    )  # fmt: skip
    expected = [
        CandidateScore(v.id, v.matched_tokens, choice.decision.scores.get(v.id))
        for v in choice.views
    ]
    core.dispatch(req, choice, 10.0)
    assert choice.views == []
    assert list(record.candidates) == expected and len(record.candidates) == 6
    assert record.matched_tokens == choice.matched_tokens == 48
    assert record.worker == choice.worker.id


def test_record_columns_read_as_candidate_scores() -> None:
    views = [
        WorkerView("a", matched_tokens=16),
        WorkerView("b", matched_tokens=48, matched_host_tokens=32),
        WorkerView("c"),
    ]
    decision = Decision("b", "prefix_hit", {"a": 0.5, "b": math.inf})
    record = DecisionRecord.from_decision(
        request_id="r", policy="p", decision=decision, candidates=views, prompt_tokens=64,
        now=1.0,
    )  # fmt: skip
    cands = record.candidates
    assert isinstance(cands, CandidateColumns)
    scores = (
        CandidateScore("a", 16, 0.5), CandidateScore("b", 48, math.inf, 32),
        CandidateScore("c", 0, None),
    )  # fmt: skip
    assert cands == scores and tuple(cands) == scores and cands[1] == scores[1]
    assert cands[-1] == scores[-1] and cands[:2] == scores[:2] and len(cands) == 3
    assert record.matched_tokens == 48 and record.matched_host_tokens == 32
    assert record.to_dict()["candidates"] == [
        {"worker": "a", "matched_tokens": 16, "score": 0.5},
        {"worker": "b", "matched_tokens": 48, "score": None, "matched_host_tokens": 32},
        {"worker": "c", "matched_tokens": 0, "score": None},
    ]
    # no host tier anywhere: no host column
    plain = CandidateColumns.of(views[:1], {})
    assert plain.host is None and list(plain) == [CandidateScore("a", 16, None)]
    with pytest.raises(ValueError):
        CandidateColumns(("a",), (1, 2), (None,))


def test_a_decision_for_a_worker_not_among_the_candidates_records_no_match() -> None:
    record = DecisionRecord.from_decision(
        request_id="r", policy="p", decision=Decision("zz", "load"),
        candidates=[WorkerView("a", matched_tokens=16)], prompt_tokens=64,
    )  # fmt: skip
    assert record.matched_tokens == 0 and record.matched_host_tokens == 0


def test_record_columns_are_untracked_by_the_collector() -> None:
    views = [WorkerView(f"w{i}", matched_tokens=i) for i in range(64)]
    cands = CandidateColumns.of(views, {v.id: 0.1 * i for i, v in enumerate(views)})
    gc.collect()
    assert not any(gc.is_tracked(c) for c in (cands.workers, cands.matched, cands.scores))


# --- min_ttft against its written-out rule ---------------------------------------------


class _Reference(MinTtftPolicy):
    """The policy's steps as first written (generator expressions, the private holder
    found anew for the eligible, the share loop), for the decisions to compare."""

    def select(self, ctx: RouteContext) -> Decision:
        candidates = ctx.candidates
        estimates: dict[str, float] = {}
        scores: dict[str, float] = {}
        for w in candidates:
            estimate, own = self.estimate(w, ctx.prompt_tokens)
            estimates[w.id] = estimate
            scores[w.id] = estimate + self._work_weight * own
        if len(candidates) == 1:
            return Decision(candidates[0].id, "only_candidate", estimates)
        private = self._private_holder(candidates, ctx.prompt_tokens)
        longest_all = max(w.matched_tokens for w in candidates)
        eligible = self._within_load_cap(candidates, ctx.prompt_tokens, private, longest_all)
        holder = self._private_holder(eligible, ctx.prompt_tokens)
        sticky = self._exploit(holder, eligible, estimates)
        if sticky is not None:
            self._remember_ref(sticky.id, candidates)
            return Decision(sticky.id, self._why(sticky, longest_all), estimates)
        if max(w.matched_tokens for w in eligible) <= 0:
            rooms = [w.free_sequences for w in eligible]
            if not any(r is None for r in rooms):
                most = max(r for r in rooms if r is not None)
                eligible = [w for w in eligible if w.free_sequences == most]
        best = min(scores[w.id] for w in eligible)
        band = best + self._tolerance_s + self._tolerance_rel * best
        near = [w for w in eligible if scores[w.id] <= band]
        longest = max(w.matched_tokens for w in near)
        pool = [w for w in near if w.matched_tokens == longest]
        low = min(scores[w.id] for w in pool)
        if longest <= 0:
            pool = [w for w in pool if scores[w.id] <= low + self._tolerance_s]
            fewest = min(w.in_flight for w in pool)
            pool = [w for w in pool if w.in_flight == fewest]
            fair = 1.0 / len(candidates)
            least = min(self._shares.get(w.id, fair) for w in pool)
            pool = [w for w in pool if self._shares.get(w.id, fair) <= least + 1e-9]
            low = min(scores[w.id] for w in pool)
        tied = [w for w in pool if scores[w.id] == low]
        chosen = tied[0] if len(tied) == 1 else ctx.rng.choice(tied)
        self._remember_ref(chosen.id, candidates)
        return Decision(chosen.id, self._why(chosen, longest_all), estimates)

    @staticmethod
    def _why(chosen: WorkerView, longest: int) -> str:
        if longest <= 0:
            return "miss"
        return "prefix_hit" if chosen.matched_tokens >= longest else "load"

    def _remember_ref(self, chosen: str, candidates: Sequence[WorkerView]) -> None:
        self._decisions += 1
        alpha = max(1.0 / self._share_window, 1.0 / (self._decisions + len(candidates) - 1))
        fair = 1.0 / len(candidates)
        for w in candidates:
            share = self._shares.get(w.id, fair) * (1.0 - alpha)
            self._shares[w.id] = share + alpha if w.id == chosen else share
            self._touched[w.id] = self._decisions


def test_min_ttft_decides_as_its_written_out_rule() -> None:
    rng = random.Random(7)
    policy, reference = MinTtftPolicy(), _Reference()
    ids = [f"w{i}" for i in range(24)]
    for step in range(400):
        n = rng.choice((2, 5, 24))
        prompt = rng.randrange(10, 5000)
        views = [
            WorkerView(
                wid, in_flight=rng.randrange(12), queued_prefill_tokens=rng.randrange(20000),
                decoding_requests=rng.randrange(6),
                engine_load=EngineLoad(rng.randrange(9), rng.randrange(4), None, rng.random())
                if rng.random() < 0.5 else None,
                matched_tokens=rng.choice((0, 0, 256, prompt - 10, prompt)),
                cost=WorkerCost(1e-5 * rng.uniform(1, 3)),
                free_sequences=None if step % 7 else rng.randrange(3),
            )
            for wid in ids[:n]
        ]  # fmt: skip
        got = policy.select(RouteContext(prompt, views, random.Random(step)))
        want = reference.select(RouteContext(prompt, views, random.Random(step)))
        assert (got.worker_id, got.reason, got.scores) == (want.worker_id, want.reason, want.scores)
        assert policy._shares == reference._shares and policy._touched == reference._touched


# --- the benchmark ---------------------------------------------------------------------


def test_the_decision_bench_runs_and_reports_the_collectors_load(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loadtests.micro import decision

    args = ["--fleets", "2", "--requests", "30", "--warmup", "5", "--capacity-tokens", "4000"]
    assert decision.main([*args, "--system-prompts", "2", "--in-flight", "2", "--phases"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| 2 |")]
    assert [r.split(" | ")[2] for r in rows] == list(decision.POLICIES)
    # tracked, one full GC, the deferred bookkeeping
    assert all(len(r.strip("|").split("|")) == 14 for r in rows)
    phases = [line for line in out if "mean CPU µs per phase" in line]
    assert len(phases) == 3 and all("dispatch" in line for line in phases)
    deferred = [r.strip("|").split("|")[13].split("/") for r in rows]
    assert all(int(p50) >= 0 and int(p99) >= int(p50) for p50, p99 in deferred)
