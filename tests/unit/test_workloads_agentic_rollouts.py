"""The ``agentic`` and ``rollouts`` workloads generate what their docstrings say: agents
whose prompt grows by one tool call and its result per step, with per-program system
prompts and tools; GRPO groups of n samples of one prompt arriving together."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import aiohttp
import orjson
import pytest

from gateway.routing.request import ApiKind, RequestSettings, parse_request
from loadtests.harness.inprocess import run_gateway
from loadtests.replay.prompts import PromptBuilder
from loadtests.workloads import WorkloadRequest, create_workload, workload_names
from simulator.fleet import SimConfig, SimulatedFleet
from simulator.model.radix_cache import encode_tokens
from simulator.model.tokenizer import default_tokenizer

MODEL = "sim-model"
SMALL_AGENTS = ["agents=6", "agent_types=2", "steps=4", "system_prompt_len=120", "tools=3",
                "tool_description_len=20", "task_len=30", "call_len=10", "result_len=40",
                "agent_rate=2"]  # fmt: skip


def _by_agent(requests: tuple[WorkloadRequest, ...]) -> dict[str, list[WorkloadRequest]]:
    out: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in requests:
        assert r.session_id is not None
        out[r.session_id].append(r)
    return out


def test_both_are_in_the_catalog() -> None:
    assert {"agentic", "rollouts"} <= set(workload_names())


def test_agentic_steps_append_one_call_and_its_result() -> None:
    w = create_workload("agentic", SMALL_AGENTS)
    assert len(w.requests) == 6 * 4
    agents = _by_agent(w.requests)
    assert len(agents) == 6
    for steps in agents.values():
        assert [len(r.messages) for r in steps] == [2, 4, 6, 8]
        assert [r.arrival_s for r in steps] == sorted(r.arrival_s for r in steps)
        for prev, cur in itertools.pairwise(steps):
            assert cur.messages[: len(prev.messages)] == prev.messages
            call, result = cur.messages[len(prev.messages) :]
            assert call.role == "assistant" and len(call.tool_calls) == 1
            assert call.tool_calls[0].name in {t.name for t in cur.tools}
            assert result.role == "tool" and result.tool_call_id == call.tool_calls[0].id
            assert orjson.loads(call.tool_calls[0].arguments)["input"]
            assert prev.tools == cur.tools
        assert steps[0].messages[0].role == "system" and steps[0].messages[1].role == "user"


def test_agentic_programs_share_system_prompt_and_tools_agents_their_task() -> None:
    w = create_workload("agentic", SMALL_AGENTS)
    first = [steps[0] for steps in _by_agent(w.requests).values()]
    by_program: dict[str | None, set[tuple[object, ...]]] = defaultdict(set)
    for r in first:
        by_program[r.group].add((r.messages[0], r.tools))
    assert set(by_program) == {"program0", "program1"}
    assert all(len(v) == 1 for v in by_program.values())  # one prefix per program
    prefixes = [next(iter(v)) for v in by_program.values()]
    assert prefixes[0] != prefixes[1]
    assert len({r.messages[1] for r in first}) == 6  # each agent its own task
    assert all(len(r.tools) == 3 for r in first)


def test_agentic_body_carries_tools_and_calls_and_hashes_as_a_growing_prefix() -> None:
    w = create_workload("agentic", SMALL_AGENTS)
    steps = next(iter(_by_agent(w.requests).values()))
    body = steps[2].body()
    assert [t["function"]["name"] for t in body["tools"]] == [t.name for t in steps[2].tools]
    assert body["messages"][2]["tool_calls"][0]["type"] == "function"
    assert body["messages"][3]["role"] == "tool" and "tool_call_id" in body["messages"][3]
    assert body["max_tokens"] == steps[2].max_tokens and body["user"] == steps[2].session_id
    settings = RequestSettings()
    hashes = [parse_request(ApiKind.CHAT, orjson.dumps(r.body()), {}, settings).block_hashes
              for r in steps]  # fmt: skip
    for a, b in itertools.pairwise(hashes):
        assert len(b) > len(a) and b[: len(a) - 1] == a[: len(a) - 1]


def test_agentic_worker_tokens_match_the_simulator_and_grow_as_a_prefix() -> None:
    w = create_workload("agentic", SMALL_AGENTS)
    builder, tok = PromptBuilder(), default_tokenizer()
    steps = next(iter(_by_agent(w.requests).values()))
    keys = []
    for r in steps:
        prepared = builder.prepare(r)
        expected = tok.encode_chat(r.chat_messages(), r.tool_dicts())
        assert prepared.prompt_key == encode_tokens(expected)
        assert sum(builder.bound_blocks(r).tokens) == len(expected)
        keys.append(expected)
    gen = len(tok.encode("<|im_start|>assistant\n"))
    for a, b in itertools.pairwise(keys):
        assert b[: len(a) - gen] == a[:-gen]  # the previous prompt but its generation prompt


def test_agentic_think_time_and_determinism() -> None:
    w = create_workload("agentic", ["agents=40", "steps=6", "think_time_s=5", "seed=2"])
    gaps = [b.arrival_s - a.arrival_s for steps in _by_agent(w.requests).values()
            for a, b in itertools.pairwise(steps)]  # fmt: skip
    assert sum(gaps) / len(gaps) == pytest.approx(5.0, rel=0.2)
    again = create_workload("agentic", ["agents=40", "steps=6", "think_time_s=5", "seed=2"])
    assert [r.body() for r in w.requests] == [r.body() for r in again.requests]
    other = create_workload("agentic", ["agents=40", "steps=6", "think_time_s=5", "seed=3"])
    assert [r.body() for r in w.requests] != [r.body() for r in other.requests]


SMALL_ROLLOUTS = ["steps=3", "prompts_per_step=4", "n=8", "instruction_len=30", "prompt_len=50",
                  "output_len=64", "step_interval_s=10"]  # fmt: skip


def test_rollouts_groups_of_n_share_one_prompt_and_arrive_together() -> None:
    w = create_workload("rollouts", SMALL_ROLLOUTS)
    assert len(w.requests) == 3 * 4 * 8
    groups: dict[str | None, list[WorkloadRequest]] = defaultdict(list)
    for r in w.requests:
        groups[r.group].append(r)
    assert len(groups) == 12 and all(len(g) == 8 for g in groups.values())
    for members in groups.values():
        assert len({m.messages for m in members}) == 1  # one prompt per group
        assert len({m.arrival_s for m in members}) == 1  # arriving together
        assert len({m.max_tokens for m in members}) > 1  # samples end at different times
    problems = {g[0].messages[-1].content for g in groups.values()}
    assert len(problems) == 12  # a new prompt per group
    assert len({g[0].messages[0].content for g in groups.values()}) == 1  # shared instruction
    assert Counter(r.arrival_s for r in w.requests) == {0.0: 32, 10.0: 32, 20.0: 32}
    assert all(r.session_id is None for r in w.requests)


def test_rollouts_order_and_group_key() -> None:
    grouped = create_workload("rollouts", SMALL_ROLLOUTS)
    runs = [len(list(run)) for _, run in itertools.groupby(r.group for r in grouped.requests)]
    assert runs == [8] * 12  # a group's samples one after another
    shuffled = create_workload("rollouts", [*SMALL_ROLLOUTS, "order=shuffled"])
    assert sorted(r.group or "" for r in shuffled.requests) == sorted(
        r.group or "" for r in grouped.requests
    )
    assert [r.group for r in shuffled.requests] != [r.group for r in grouped.requests]
    keyed = create_workload("rollouts", [*SMALL_ROLLOUTS, "group_key=true"])
    assert all(r.session_id == r.group for r in keyed.requests)
    bare = create_workload("rollouts", [*SMALL_ROLLOUTS, "instruction_len=0"])
    assert all(len(r.messages) == 1 and r.messages[0].role == "user" for r in bare.requests)
    with pytest.raises(ValueError, match="order"):
        create_workload("rollouts", ["order=random"])


async def _cached(session: aiohttp.ClientSession, url: str, req: WorkloadRequest) -> int:
    """The cached tokens the worker reports for ``req`` sent through the gateway."""
    body = req.body(MODEL, stream=False)
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def test_both_run_live_through_the_gateway() -> None:
    """The bodies are accepted by the gateway and a simulated SGLang worker (tools, tool
    calls, tool messages); an agent's next step and a group's next sample hit the cache."""
    agent = next(iter(_by_agent(create_workload("agentic", SMALL_AGENTS).requests).values()))
    group = create_workload("rollouts", SMALL_ROLLOUTS).requests[:3]
    config = SimConfig(speed=1000, capacity_tokens=40_000)
    async with (
        await SimulatedFleet.start(2, config) as fleet,
        run_gateway(fleet.urls, policy__name="dynamo_kv") as gw,
        aiohttp.ClientSession() as session,
    ):
        steps = [await _cached(session, gw.url, r) for r in agent]
        samples = [await _cached(session, gw.url, r) for r in group]
    assert steps[0] < steps[1] < steps[2] < steps[3]  # each step reuses the one before
    assert samples[0] < samples[1] == samples[2] > 0
