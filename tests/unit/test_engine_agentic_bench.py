"""The real-engine bench's agentic workload, its chained clients and repeated runs,
without an engine: prompts that extend the previous step, one step of an agent in flight
at a time, run labels and salts, per-request records."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest

from loadtests.engine import bench, client
from loadtests.engine.client import ChatResult
from loadtests.engine.workload import AgenticSpec, agentic_ideal_fraction, agentic_requests


def _text(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in body["messages"]]


def test_each_step_extends_the_agents_previous_prompt() -> None:
    spec = AgenticSpec(agents=3, steps=4, system_tokens=50, task_tokens=5, call_tokens=4,
                       result_tokens=10)  # fmt: skip
    requests = agentic_requests(spec)
    assert len(requests) == 12
    assert [r.index for r in requests] == list(range(12))
    for agent in range(3):
        steps = [r for r in requests if r.prefix_id == agent]
        assert [r.chain for r in steps] == [agent] * 4
        for k, (prev, cur) in enumerate(itertools.pairwise(steps)):
            a, b = _text(prev.body), _text(cur.body)
            assert b[: len(a)] == a  # the previous prompt, then one call and its result
            assert [role for role, _ in b[len(a) :]] == ["assistant", "user"]
            assert len(b) == 2 + 2 * (k + 1)
    systems = {r.body["messages"][0]["content"] for r in requests}
    assert len(systems) == 3 and all(len(s.split()) == 50 for s in systems)
    # rounds: every agent's step k before any agent's step k + 1
    rounds = [(len(r.body["messages"]) - 2) // 2 for r in requests]
    assert rounds == sorted(rounds)


def test_agentic_order_depends_on_seed_and_text_on_salt() -> None:
    base = agentic_requests(AgenticSpec())
    salted = agentic_requests(AgenticSpec(text_salt=1))
    assert base == agentic_requests(AgenticSpec())
    assert [r.prefix_id for r in salted] == [r.prefix_id for r in base]
    assert salted[0].body["messages"][0] != base[0].body["messages"][0]
    assert [r.prefix_id for r in agentic_requests(AgenticSpec(seed=1))] != [
        r.prefix_id for r in base
    ]


def test_ideal_fraction_counts_the_previous_step_as_cached() -> None:
    spec = AgenticSpec(agents=1, steps=2, system_tokens=90, task_tokens=0, call_tokens=5,
                       result_tokens=5)  # fmt: skip
    # prompts 100 and 120 with 5 template tokens a message: 100 of 220 cached
    assert agentic_ideal_fraction(spec) == pytest.approx(100 / 220)
    assert 0.6 < agentic_ideal_fraction(AgenticSpec()) < 0.75


def test_run_chains_keeps_one_request_of_a_chain_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    in_flight: set[int] = set()
    order: list[int] = []

    async def fake_stream(
        session: object, url: str, body: dict[str, Any], timeout_s: float
    ) -> ChatResult:
        chain = body["chain"]
        assert chain not in in_flight
        in_flight.add(chain)
        order.append(body["i"])
        await asyncio.sleep(0.01 * (1 + body["i"] % 3))
        in_flight.discard(chain)
        return ChatResult(True, 200, 0.0, 0.0, prompt_tokens=body["i"])

    monkeypatch.setattr(client, "stream_chat", fake_stream)
    chains = [0, 0, 1, 0, 1, 2, 2, 2]
    jobs = [("u", {"chain": c, "i": i}) for i, c in enumerate(chains)]
    results = asyncio.run(client.run_chains(object(), jobs, chains, 3))  # type: ignore[arg-type]
    assert [r.prompt_tokens for r in results] == list(range(8))  # in job order
    for chain in set(chains):  # each chain's jobs started in order
        mine = [i for i in order if chains[i] == chain]
        assert mine == sorted(mine)


def test_run_plan_labels_and_salts() -> None:
    assert bench.run_plan(["a", "b"], 1) == [("a", "a", 1), ("b", "b", 2)]
    assert bench.run_plan(["a", "b"], 2) == [
        ("a", "a #1", 1), ("b", "b #1", 2), ("a", "a #2", 3), ("b", "b #2", 4),
    ]  # fmt: skip


def test_bench_agentic_arguments_and_records() -> None:
    args = bench.resolve_defaults(
        bench._parser().parse_args(["--fleet", "sglang", "--workload", "agentic", "--agents", "4"])
    )
    requests = bench.workload_requests(args, salt=3)
    assert len(requests) == 4 * AgenticSpec().steps
    assert requests[0].body["model"] != "tiny-llama"  # the SGLang model's served name
    urls = ["http://w0", "http://w1"]
    route = bench.direct_route("sticky", urls)
    results = [ChatResult(True, 200, 0.1, 0.2, 10, 5) for _ in requests]
    rows = bench.request_records(requests, urls, route, results)
    assert [row["worker"] for row in rows] == [r.prefix_id % 2 for r in requests]
    assert rows[0]["chain"] == requests[0].prefix_id and rows[0]["cached_tokens"] == 5
    gateway_rows = bench.request_records(requests, urls, lambda _: "http://gw", results)
    assert {row["worker"] for row in gateway_rows} == {-1}


def test_router_workers_ready_needs_every_worker_listed_healthy() -> None:
    def body(*healthy: bool) -> bytes:
        workers = [{"url": f"http://w{i}", "is_healthy": h} for i, h in enumerate(healthy)]
        return json.dumps({"workers": workers, "total": len(workers)}).encode()

    assert bench.router_workers_ready(body(True, True), 2)
    assert not bench.router_workers_ready(body(True), 2)  # one still registering
    assert not bench.router_workers_ready(body(True, False), 2)
    assert not bench.router_workers_ready(b'{"workers": []}', 2)  # "Router ready | workers: []"
    assert not bench.router_workers_ready(b"OK", 2)
