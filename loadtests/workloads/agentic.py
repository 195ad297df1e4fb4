"""``agentic``: tool-using agents whose prompt grows by one tool call and its result per step.

``agents`` agents start as a Poisson process of ``agent_rate`` per second. Each is an
instance of one of ``agent_types`` agent programs (agent ``a`` runs program ``a %
agent_types``): a program is a long system prompt (``system_prompt_len`` tokens) and a
list of ``tools`` functions (the request's OpenAI ``tools``, each described in about
``tool_description_len`` tokens, with two string parameters), so instances of one
program share that prefix. Each agent has its own task (a user message of ``task_len``
tokens) and takes ``steps`` steps: step ``k`` sends the system prompt, the task, then
the ``k`` earlier steps' tool calls (an assistant message with one ``tool_calls`` entry
whose arguments are about ``call_len`` tokens) each followed by its result (a ``tool``
message of about ``result_len`` tokens). Step ``k``'s prompt is therefore step ``k -
1``'s plus one call and one result, and asks for as many tokens as its own call has.
Lengths vary uniformly by ``±jitter``.

Steps are ``think_time_s`` apart (exponential mean: the tool's run time), open loop as
``multi-turn`` is: a slow server does not delay the next step, and the history is fixed
text rather than the model's replies, so every run sees the same prompts. Requests carry
the agent as ``user`` (``session_id``) and the program as their group.
"""

from __future__ import annotations

import json
import random

from loadtests.workloads.arrivals import poisson_arrivals
from loadtests.workloads.base import (
    ChatMessage,
    ToolCall,
    ToolSpec,
    Workload,
    WorkloadRequest,
    finish,
)
from loadtests.workloads.text import pseudo_text, stable_seed

NAME = "agentic"
PARAMETER_TOKENS = 8  # each tool parameter's description


def _jittered(rng: random.Random, mean: int, jitter: float) -> int:
    return max(1, round(mean * (1 + rng.uniform(-jitter, jitter))))


def program_tools(
    seed: int, program: int, count: int, description_len: int
) -> tuple[ToolSpec, ...]:
    """The tools of agent program ``program``: names unique to it, pseudo-text descriptions."""
    return tuple(
        ToolSpec(
            name=f"p{program}_tool{j}",
            description=pseudo_text(stable_seed(NAME, seed, "tool", program, j), description_len),
            parameters=tuple(
                (
                    name,
                    pseudo_text(
                        stable_seed(NAME, seed, "param", program, j, name), PARAMETER_TOKENS
                    ),
                )
                for name in ("target", "input")
            ),
        )
        for j in range(count)
    )


def agentic(
    agents: int = 48,
    agent_types: int = 4,
    steps: int = 10,
    system_prompt_len: int = 2000,
    tools: int = 12,
    tool_description_len: int = 60,
    task_len: int = 200,
    call_len: int = 40,
    result_len: int = 400,
    jitter: float = 0.5,
    think_time_s: float = 3.0,
    agent_rate: float = 0.5,
    seed: int = 0,
) -> Workload:
    """Build the workload (see module docstring)."""
    if agents < 1 or agent_types < 1 or steps < 1 or tools < 1:
        raise ValueError("agents, agent_types, steps and tools must be at least 1")
    rng = random.Random(stable_seed(NAME, seed))
    programs = [
        (
            ChatMessage("system", pseudo_text(stable_seed(NAME, seed, "system", p),
                                              system_prompt_len)),
            program_tools(seed, p, tools, tool_description_len),
        )
        for p in range(agent_types)
    ]  # fmt: skip
    starts = poisson_arrivals(rng, agents, agent_rate)
    requests: list[WorkloadRequest] = []
    for a, start in enumerate(starts):
        program = a % agent_types
        system, specs = programs[program]
        task = pseudo_text(stable_seed(NAME, seed, a, "task"), _jittered(rng, task_len, jitter))
        history = [system, ChatMessage("user", task)]
        t = start
        for k in range(steps):
            call_tokens = _jittered(rng, call_len, jitter)
            requests.append(
                WorkloadRequest(
                    len(requests),
                    t,
                    call_tokens,
                    tuple(history),
                    session_id=f"agent{a}",
                    group=f"program{program}",
                    tools=specs,
                )
            )
            tool = specs[rng.randrange(len(specs))]
            arguments = json.dumps(
                {
                    "target": f"item{k}",
                    "input": pseudo_text(stable_seed(NAME, seed, a, k, "call"), call_tokens),
                }
            )
            call = ToolCall(f"call_{a}_{k}", tool.name, arguments)
            result = pseudo_text(
                stable_seed(NAME, seed, a, k, "result"), _jittered(rng, result_len, jitter)
            )
            history += [ChatMessage("assistant", "", tool_calls=(call,)),
                        ChatMessage("tool", result, tool_call_id=call.id)]  # fmt: skip
            t += rng.expovariate(1 / think_time_s) if think_time_s > 0 else 0.0
    params = dict(
        agents=agents,
        agent_types=agent_types,
        steps=steps,
        system_prompt_len=system_prompt_len,
        tools=tools,
        tool_description_len=tool_description_len,
        task_len=task_len,
        call_len=call_len,
        result_len=result_len,
        jitter=jitter,
        think_time_s=think_time_s,
        agent_rate=agent_rate,
        seed=seed,
    )
    return finish(NAME, requests, params)
