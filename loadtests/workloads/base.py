"""The shape every workload produces: requests with arrival times, as OpenAI chat requests.

A :class:`WorkloadRequest` is usable three ways:

* a live client (Locust, the live benchmark) sends :meth:`WorkloadRequest.body` as an
  OpenAI ``/v1/chat/completions`` request at ``arrival_s`` seconds after the start;
* the offline replay passes the same body to the gateway's own request parser, so block
  hashing is the gateway's, and tokenises the same messages for the simulated worker;
* bounds read its block structure (:meth:`WorkloadRequest.trace` for traces, token blocks
  of the tokenised prompt otherwise).

Trace prompts (Mooncake, Azure) are kept as block ids and rendered to text only on demand:
the Mooncake conversation trace is ~580 MB of text when rendered whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loadtests.workloads.text import piece_ids, render, stable_seed

DEFAULT_MODEL = "default"
TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call of an assistant message (an OpenAI ``tool_calls`` entry)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI clients send it

    def as_dict(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function offered to the model (an OpenAI ``tools`` entry): string parameters,
    each with a description, all required."""

    name: str
    description: str
    parameters: tuple[tuple[str, str], ...] = ()  # (name, description)

    def as_dict(self) -> dict[str, Any]:
        properties = {p: {"type": "string", "description": d} for p, d in self.parameters}
        schema = {"type": "object", "properties": properties,
                  "required": [p for p, _ in self.parameters]}  # fmt: skip
        function = {"name": self.name, "description": self.description, "parameters": schema}
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One OpenAI chat message; an assistant's may carry tool calls, a ``tool`` message
    answers the call named by ``tool_call_id``."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True, slots=True)
class TracePrompt:
    """A prompt given as chained blocks of ``block_tokens`` tokens, the last one partial.

    Block ``h`` renders as ``block_tokens`` pieces of pseudo-text seeded by ``(seed, h)``;
    the last block is the first ``last_block_tokens`` of its pieces. Equal ids therefore
    give equal text, and (ids being chained) equal prefixes.
    """

    hash_ids: tuple[int, ...]
    input_tokens: int
    block_tokens: int = TRACE_BLOCK_TOKENS
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.hash_ids or self.input_tokens <= 0:
            raise ValueError("a trace prompt needs at least one block and one token")
        if self.input_tokens > self.block_tokens * len(self.hash_ids):
            raise ValueError("input_tokens exceeds the blocks' capacity")

    @property
    def last_block_tokens(self) -> int:
        return self.input_tokens - self.block_tokens * (len(self.hash_ids) - 1)

    def block_sizes(self) -> tuple[int, ...]:
        if self.last_block_tokens <= 0:
            raise ValueError("input_tokens leaves the last block empty")
        return (self.block_tokens,) * (len(self.hash_ids) - 1) + (self.last_block_tokens,)

    def block_seed(self, hash_id: int) -> int:
        return stable_seed("trace-block", self.seed, hash_id)

    def text(self) -> str:
        sizes = self.block_sizes()
        return "".join(
            render(piece_ids(self.block_seed(h), n))
            for h, n in zip(self.hash_ids, sizes, strict=True)
        )


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload: what to send and when (seconds after the start)."""

    index: int
    arrival_s: float
    max_tokens: int
    messages: tuple[ChatMessage, ...] = ()
    trace: TracePrompt | None = None  # set for trace workloads instead of ``messages``
    session_id: str | None = None  # conversation / user, the routing key if any
    group: str | None = None  # shared-prefix group or tenant, for reporting
    adapter: str | None = None  # a LoRA adapter's name: the body's model is "model:adapter"
    tools: tuple[ToolSpec, ...] = ()  # functions offered to the model (the body's ``tools``)

    def __post_init__(self) -> None:
        if (self.trace is None) == (not self.messages):
            raise ValueError("exactly one of messages and trace must be given")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The OpenAI ``messages`` list (trace prompts become one user message)."""
        if self.trace is not None:
            return [{"role": "user", "content": self.trace.text()}]
        return [m.as_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The OpenAI ``tools`` list, or None when the request offers none."""
        return [t.as_dict() for t in self.tools] if self.tools else None

    def body(self, model: str = DEFAULT_MODEL, stream: bool = True) -> dict[str, Any]:
        """The OpenAI chat-completions body a live client sends for this request.

        ``ignore_eos`` (an SGLang extension) makes the worker produce exactly
        ``max_tokens`` tokens, so output lengths follow the workload. A request with an
        ``adapter`` names it SGLang's OpenAI way, ``model: "model:adapter"``.
        """
        body: dict[str, Any] = {
            "model": model if self.adapter is None else f"{model}:{self.adapter}",
            "messages": self.chat_messages(),
            "max_tokens": self.max_tokens,
            "stream": stream,
            "ignore_eos": True,
        }
        if self.tools:
            body["tools"] = self.tool_dicts()
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.session_id is not None:
            body["user"] = self.session_id
        return body

    def approx_prompt_tokens(self) -> int:
        """Prompt tokens without the chat template (pieces are one token each)."""
        if self.trace is not None:
            return self.trace.input_tokens
        chars = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
                    for m in self.messages)  # fmt: skip
        chars += sum(len(t.description) + sum(len(d) for _, d in t.parameters) for t in self.tools)
        return chars // 4


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, parameterised request sequence, sorted by arrival time."""

    name: str
    requests: tuple[WorkloadRequest, ...]
    params: dict[str, Any] = field(default_factory=dict)

    def scaled(self, time_scale: float) -> Workload:
        """Arrivals compressed ``time_scale``-fold (3 → three times the rate)."""
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        reqs = tuple(replace(r, arrival_s=r.arrival_s / time_scale) for r in self.requests)
        return replace(self, requests=reqs)

    def limited(self, limit: int | None) -> Workload:
        """The first ``limit`` requests (all when ``None`` or 0)."""
        if not limit:
            return self
        return replace(self, requests=self.requests[:limit])


def finish(name: str, requests: Sequence[WorkloadRequest], params: dict[str, Any]) -> Workload:
    """Sort by arrival (stable) and renumber, so ``index`` is the arrival rank."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    return Workload(
        name=name,
        requests=tuple(replace(r, index=i) for i, r in enumerate(ordered)),
        params=dict(params),
    )
