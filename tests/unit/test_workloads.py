"""Workload generators: deterministic, right shapes and lengths, the promised prefix structure."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pytest

from gateway.routing.request import ApiKind, RequestSettings, parse_request
from loadtests.replay.bounds import BlockRequest, infinite_cache
from loadtests.workloads import Workload, create_workload, workload_names
from loadtests.workloads.arrivals import ramp_arrivals
from loadtests.workloads.base import TracePrompt, WorkloadRequest
from loadtests.workloads.text import PIECE_CHARS, pseudo_text, stable_seed


def _gateway_blocks(req: WorkloadRequest) -> BlockRequest:
    """The gateway's own block hashes of the body a live client would send."""
    body = orjson.dumps(req.body())
    parsed = parse_request(ApiKind.CHAT, body, {}, RequestSettings())
    ids = tuple(parsed.block_hashes)
    return BlockRequest(ids, (16,) * len(ids))


def _bodies(workload: Workload) -> list[bytes]:
    return [orjson.dumps(r.body()) for r in workload.requests]


def test_pseudo_text_is_deterministic_prefix_stable_and_four_chars_per_token() -> None:
    text = pseudo_text(stable_seed("x", 1), 300)
    assert len(text) == 300 * PIECE_CHARS
    assert len(text.split()) == 300
    assert text == pseudo_text(stable_seed("x", 1), 300)
    assert text.startswith(pseudo_text(stable_seed("x", 1), 123))
    assert text != pseudo_text(stable_seed("x", 2), 300)


@pytest.mark.parametrize("name", ["generated-shared-prefix", "multi-turn", "multi-tenant"])
def test_generators_are_deterministic_given_seed(name: str) -> None:
    small = {
        "generated-shared-prefix": ["num_groups=4", "prompts_per_group=3", "request_rate=5"],
        "multi-turn": ["sessions=4", "turns=3"],
        "multi-tenant": ["tenants=4", "users_per_tenant=2", "num_requests=30"],
    }[name]
    a = create_workload(name, [*small, "seed=1"])
    b = create_workload(name, [*small, "seed=1"])
    c = create_workload(name, [*small, "seed=2"])
    assert _bodies(a) == _bodies(b)
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]
    assert _bodies(a) != _bodies(c)
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals)
    assert [r.index for r in a.requests] == list(range(len(a.requests)))


def test_generated_shared_prefix_shape_and_ideal_hit_rate() -> None:
    w = create_workload("generated-shared-prefix", ["num_groups=8", "prompts_per_group=16"])
    assert len(w.requests) == 8 * 16
    assert all(r.arrival_s == 0.0 and r.max_tokens == 256 for r in w.requests)
    by_group: dict[str, set[str]] = {}
    for r in w.requests:
        system, question = r.messages
        assert (system.role, question.role) == ("system", "user")
        assert len(system.content) == 2048 * PIECE_CHARS
        assert len(question.content) == 128 * PIECE_CHARS
        assert r.group is not None
        by_group.setdefault(r.group, set()).add(system.content)
    assert len(by_group) == 8 and all(len(s) == 1 for s in by_group.values())
    groups = [r.group for r in w.requests]
    assert groups != sorted(groups, key=lambda g: int(str(g)[1:]))  # shuffled
    # Ideal hit rate: 15 of 16 prompts of a group reuse the 2,048-token system prompt.
    rate = infinite_cache([_gateway_blocks(r) for r in w.requests]).token_hit_rate
    assert rate == pytest.approx(15 / 16 * 2048 / (2048 + 128), abs=0.01)


def test_multi_turn_each_turn_extends_the_previous_one() -> None:
    w = create_workload("multi-turn", ["sessions=3", "turns=4", "think_time_s=5"])
    sessions: dict[str, list[WorkloadRequest]] = {}
    for r in w.requests:
        assert r.session_id is not None
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) == 3 and all(len(t) == 4 for t in sessions.values())
    for turns in sessions.values():
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival_s > prev.arrival_s
            assert nxt.messages[: len(prev.messages)] == prev.messages
            answer, question = nxt.messages[len(prev.messages) :]
            assert (answer.role, question.role) == ("assistant", "user")
            assert len(answer.content) == prev.max_tokens * PIECE_CHARS
    # Prefix structure: the gateway's blocks of turn k are a prefix of turn k+1's.
    for turns in sessions.values():
        blocks = [_gateway_blocks(r).ids for r in turns]
        for a, b in itertools.pairwise(blocks):
            assert b[: len(a)] == a


def test_multi_tenant_shares_context_and_ramps_rate() -> None:
    w = create_workload(
        "multi-tenant",
        [
            "tenants=5",
            "users_per_tenant=3",
            "context_len=600",
            "question_len=120",
            "num_requests=400",
            "rate_start=2",
            "rate_end=40",
            "ramp_s=20",
        ],
    )
    contexts: dict[str | None, set[str]] = {}
    for r in w.requests:
        system, question = r.messages
        contexts.setdefault(r.group, set()).add(system.content)
        assert len(system.content) == 600 * PIECE_CHARS
        assert 84 <= len(question.content) // PIECE_CHARS <= 156
    assert len(contexts) == 5 and all(len(s) == 1 for s in contexts.values())
    assert len({r.session_id for r in w.requests}) <= 15
    arrivals = [r.arrival_s for r in w.requests]
    early = sum(1 for t in arrivals if t < 5)
    late = sum(1 for t in arrivals if 15 <= t < 20)
    assert late > 3 * early


def test_ramp_arrivals_match_expected_counts() -> None:
    import random

    times = ramp_arrivals(random.Random(3), 20_000, 3.0, 60.0, 100.0)
    in_ramp = sum(1 for t in times if t < 100.0)
    assert in_ramp == pytest.approx(3 * 100 + 57 * 100 / 2, rel=0.05)


def test_mooncake_trace_blocks_text_and_time_scale(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 1030, "output_length": 7, "hash_ids": [0, 1, 2]},
        {"timestamp": 4000, "input_length": 600, "output_length": 0, "hash_ids": [0, 3]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    w = create_workload("mooncake", [f"path={path}", "speed=2"])
    first, second = w.requests
    assert (first.arrival_s, second.arrival_s) == (0.0, 1.5)
    assert (first.max_tokens, second.max_tokens) == (7, 1)
    assert first.trace is not None and second.trace is not None
    assert first.trace.block_sizes() == (512, 512, 6)
    a, b = first.trace.text(), second.trace.text()
    assert len(a) == 1030 * PIECE_CHARS and len(b) == 600 * PIECE_CHARS
    block = 512 * PIECE_CHARS
    assert a[:block] == b[:block] and a[block : 2 * block] != b[block : 2 * block]
    assert first.chat_messages() == [{"role": "user", "content": a}]
    assert first.session_id is None
    keyed = create_workload("mooncake", [f"path={path}", "session_block=1"])
    assert [r.session_id for r in keyed.requests] == ["b1", "b3"]
    assert keyed.requests[0].body()["user"] == "b1"


def test_trace_prompt_truncated_block_is_a_prefix_of_the_full_block() -> None:
    full = TracePrompt((5,), 512).text()
    part = TracePrompt((5,), 100).text()
    assert full.startswith(part) and len(part) == 400


def test_bundled_traces_load_with_limit() -> None:
    w = create_workload("mooncake-synthetic", ["limit=50"])
    assert len(w.requests) == 50 and w.requests[0].arrival_s == 0.0
    azure = create_workload("azure", ["limit=40", "speed=4"])
    ids = [h for r in azure.requests if r.trace for h in r.trace.hash_ids]
    assert len(ids) == len(set(ids))  # no reuse at all
    assert (
        infinite_cache(
            [
                BlockRequest(r.trace.hash_ids, r.trace.block_sizes())
                for r in azure.requests
                if r.trace
            ]
        ).token_hit_rate
        == 0.0
    )


def test_registry_parses_typed_arguments_and_rejects_unknown() -> None:
    assert "generated-shared-prefix" in workload_names()
    w = create_workload(
        "generated-shared-prefix",
        ["num_groups=2", "prompts_per_group=2", "shuffle=false", "question_len=8"],
    )
    assert [r.group for r in w.requests] == ["g0", "g0", "g1", "g1"]
    with pytest.raises(ValueError, match="bad workload argument"):
        create_workload("generated-shared-prefix", ["nope=1"])
    with pytest.raises(ValueError, match="unknown workload"):
        create_workload("nope")
    with pytest.raises(ValueError):
        create_workload("multi-turn", ["turns=abc"])


def test_time_scale_and_limit() -> None:
    w = create_workload("multi-turn", ["sessions=3", "turns=2"])
    scaled = w.scaled(4.0).limited(3)
    assert len(scaled.requests) == 3
    assert [r.arrival_s * 4 for r in scaled.requests] == pytest.approx(
        [r.arrival_s for r in w.requests[:3]]
    )
