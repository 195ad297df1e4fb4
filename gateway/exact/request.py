"""Exact mode's view of one request: its token ids and cache namespace, computed lazily.

* :func:`request_tokens` reads a request body as the worker will cache it: the token ids
  (``chat`` rendered and tokenized by the configured tokenizer, ``completions`` /
  ``generate`` text tokenized or ids taken as given; a batch keys on its first prompt)
  and the namespace ``(LoRA, cache_salt, extra_key)``. Unknown shapes give ``None``
  tokens, so the request gets no exact hit rather than a wrong one.
* :class:`ExactRequest` is what the router holds per request: it tokenizes at most once
  per tokenizer, and only if some candidate worker is followed by the manager (an
  :class:`ExactMatcher`, :class:`gateway.exact.manager.KVEventsManager` in the gateway).
  The router awaits :meth:`ExactRequest.prepare_tokens` before its synchronous decision:
  a body over ``offload_bytes`` is parsed, rendered and encoded in a worker thread (the
  event loop serves other requests meanwhile; ``tokenizers`` encodes without the GIL),
  a smaller one inline (a thread hop costs more than its tokenization). The decision then
  reads the cached tokens.

Cost: one JSON parse and one tokenization per request that needs tokens; none otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from gateway.exact.index import Namespace
from gateway.exact.tokenizer import ChatRules, Tokenizer

# A body larger than this is tokenized in a thread, a smaller one on the event loop: dense
# BPE costs ~0.2 ms per KiB, a thread hop ~0.1 ms (docs/KV_EVENTS.md, measured).
OFFLOAD_BYTES = 4 << 10


class ExactMatcher(Protocol):
    """What a request asks of the manager (``KVEventsManager``): tokens, matches, modes."""

    def tokenizer_for(self, worker_id: str) -> Tokenizer | None: ...

    def wants_tokens(self, worker_ids: Iterable[str]) -> bool: ...

    def match_tiers(
        self, ids: Sequence[int] | None, namespace: Namespace, worker_ids: Iterable[str]
    ) -> dict[str, tuple[int, int]]: ...

    def dispatched(
        self, worker_id: str, ids: Sequence[int] | None, namespace: Namespace
    ) -> None: ...

    def mode(self, worker_id: str) -> str: ...

    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None: ...


class ExactRequest:
    """One request as exact mode sees it; tokenized lazily, at most once per tokenizer
    (workers of one model share theirs: usually one tokenization per request)."""

    __slots__ = (
        "_body", "_executor", "_host", "_kind", "_mgr", "_offload_bytes", "_tokens", "skipped",
    )  # fmt: skip

    def __init__(
        self,
        mgr: ExactMatcher,
        kind: str,
        body: bytes,
        max_bytes: int | None = None,
        *,
        executor: Executor | None = None,
        offload_bytes: int = OFFLOAD_BYTES,
    ) -> None:
        self._mgr, self._kind, self._body = mgr, kind, body
        self._executor, self._offload_bytes = executor, offload_bytes
        self._tokens: dict[int, tuple[list[int] | None, Namespace]] = {}  # id(tokenizer) ->
        # A body over ``max_bytes`` is never tokenized (no JSON parse either); its workers
        # are matched by the approximate index.
        self.skipped = max_bytes is not None and len(body) > max_bytes
        self._host: dict[str, int] = {}  # the last match's host-tier part, per worker

    def _groups(self, worker_ids: Sequence[str]) -> dict[int, tuple[Tokenizer, list[str]]]:
        """The followed workers among ``worker_ids``, by tokenizer; {} when none is (or
        the body is not to be tokenized): nothing then needs the request's tokens."""
        groups: dict[int, tuple[Tokenizer, list[str]]] = {}
        if self.skipped or not self._mgr.wants_tokens(worker_ids):
            return groups
        for wid in worker_ids:
            tok = self._mgr.tokenizer_for(wid)
            if tok is not None:
                groups.setdefault(id(tok), (tok, []))[1].append(wid)
        return groups

    async def prepare_tokens(self, worker_ids: Sequence[str]) -> None:
        """Tokenize now for the tokenizers of these candidates, so the synchronous
        decision only reads the result: in the executor (None: the loop's default one)
        when the body is over ``offload_bytes``, else inline. A tokenizer met later (a
        worker followed meanwhile) is tokenized inline by :meth:`tokens`."""
        for key, (tok, _) in self._groups(worker_ids).items():
            if key in self._tokens:
                continue
            if len(self._body) > self._offload_bytes:
                loop = asyncio.get_running_loop()
                got = await loop.run_in_executor(
                    self._executor, request_tokens, self._kind, self._body, tok
                )
            else:
                got = request_tokens(self._kind, self._body, tok)
            self._tokens.setdefault(key, got)

    def tokens(self, tokenizer: Tokenizer) -> tuple[list[int] | None, Namespace]:
        if self.skipped:
            return None, (None, None, None)
        key = id(tokenizer)  # the manager holds its tokenizers for the request's life
        got = self._tokens.get(key)
        if got is None:
            got = self._tokens[key] = request_tokens(self._kind, self._body, tokenizer)
        return got

    def match(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Matched tokens of the workers in exact mode (others absent; all absent for a
        body too large to tokenize); their host-tier parts in :meth:`host_tokens`."""
        out: dict[str, int] = {}
        host = self._host = {}
        for tok, wids in self._groups(worker_ids).values():
            for wid, (tokens, on_host) in self._mgr.match_tiers(*self.tokens(tok), wids).items():
                out[wid] = tokens
                if on_host:
                    host[wid] = on_host
        return out

    def host_tokens(self) -> dict[str, int]:
        """Of the last :meth:`match`, the tokens on each worker's host tier (HiCache; only
        workers with some)."""
        return self._host

    def dispatched(self, worker_id: str) -> None:
        tok = self._mgr.tokenizer_for(worker_id)
        if tok is not None and self._mgr.wants_tokens([worker_id]):
            self._mgr.dispatched(worker_id, *self.tokens(tok))

    def mode(self, worker_id: str) -> str:
        return self._mgr.mode(worker_id)

    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None:
        self._mgr.observe(worker_id, mode, predicted, reported)


def request_tokens(
    kind: str, body: bytes, tokenizer: Tokenizer
) -> tuple[list[int] | None, Namespace]:
    """The token ids a worker caches for this body, and its namespace; None if unknown.

    ``kind`` is ``chat``, ``completions`` or ``generate`` (others: None). A batch is
    tokenized on its first prompt (routing keys on it). A body the engine would refuse,
    or one the chat template refuses, gets None tokens: no exact hit, never a wrong one.
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, (None, None, None)
    if not isinstance(obj, dict):
        return None, (None, None, None)
    namespace = _request_namespace(obj)
    try:
        return _tokens(kind, obj, tokenizer), namespace
    except Exception:  # the template's refusal (ValueError), a malformed body, a python:
        # tokenizer's own error (a jinja2 TemplateError is no ValueError): no exact hit
        return None, namespace


def _request_namespace(obj: Mapping[str, Any]) -> Namespace:
    lora = obj.get("lora_path")
    model = obj.get("model")
    if not lora and isinstance(model, str) and ":" in model:
        lora = model.split(":", 1)[1]
    salt, extra = obj.get("cache_salt"), obj.get("extra_key")
    return (
        str(lora) if lora else None,
        str(salt) if salt else None,
        str(extra) if extra else None,
    )


def _tokens(kind: str, obj: Mapping[str, Any], tokenizer: Tokenizer) -> list[int] | None:
    if kind == "chat":
        rules = getattr(tokenizer, "chat_rules", None)
        if isinstance(rules, ChatRules):
            return _template_chat_tokens(obj, tokenizer, rules)
        messages = obj.get("messages")  # a python: tokenizer: the engine's own chat path
        return tokenizer.encode_chat(messages, obj.get("tools")) if messages else None
    value = obj.get("prompt") if kind == "completions" else obj.get("text")
    if kind == "generate" and value is None:
        value = obj.get("input_ids")
    if kind not in ("completions", "generate") or value is None:
        return None
    if isinstance(value, list) and value and not isinstance(value[0], int):
        value = value[0]  # a batch: its first prompt
    if isinstance(value, str):
        return tokenizer.encode(value)
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return value
    return None


def _template_chat_tokens(
    obj: Mapping[str, Any], tokenizer: Tokenizer, rules: ChatRules
) -> list[int]:
    chat = sglang_chat(obj, rules)
    if chat.input_ids is not None:
        return chat.input_ids
    if chat.template_kwargs:
        ids = tokenizer.encode_chat(chat.messages, chat.tools, **chat.template_kwargs)
    else:
        ids = tokenizer.encode_chat(chat.messages, chat.tools)
    if chat.assistant_prefix:
        more = tokenizer.encode(chat.assistant_prefix)
        if more and more[0] == rules.bos_token_id:
            more = more[1:]
        ids = ids + more
    return ids


# ---------------------------------------------------------------- SGLang's chat handler
#
# SGLang 0.5.23 (srt/entrypoints/openai/protocol.py, serving_chat.py, the Jinja path of a
# text model) turns a chat request into the arguments of ``apply_chat_template``: the
# request is validated into pydantic models and dumped back (unknown fields dropped,
# defaults filled in), then prepared. What it refuses (HTTP 400) raises ValueError here.

_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
_TOOL_HOSTS = ("root", "system", "developer")  # roles whose message may carry ``tools``
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_TRUE_WORDS = ("1", "true", "yes", "y", "on")
_SCHEMA_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
# apply_chat_template's own parameters: SGLang passes these itself (a duplicate is a
# TypeError), or they would be read as arguments, not template variables.
_PASSED = (
    "conversation",
    "conversations",
    "tools",
    "tokenize",
    "add_generation_prompt",
    "return_dict",
)
_ARGUMENTS = (
    "continue_final_message",
    "return_assistant_tokens_mask",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "tokenizer_kwargs",
)


@dataclass(slots=True)
class SGLangChat:
    """A chat request as SGLang hands it to the template: ``encode_chat(messages, tools,
    **template_kwargs)``, then ``assistant_prefix`` encoded and appended (BOS dropped);
    or ``input_ids`` given by the client, used as they are."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    assistant_prefix: str | None = None
    input_ids: list[int] | None = None


def sglang_chat(obj: Mapping[str, Any], rules: ChatRules) -> SGLangChat:
    """Prepare a chat request body as SGLang 0.5.23 does before its Jinja template:

    * messages as its models dump them: ``user`` keeps role and content only; other roles
      (lower-cased) keep ``tool_call_id``, ``name``, ``phase``, ``reasoning_content``,
      ``tool_calls`` (each ``{id, index, type, function: {name, arguments}}``), ``tools``
      and ``prefix`` when set; a null content becomes ``""``; a list of text parts is
      joined with spaces for a ``"string"`` template, kept as ``[{type, text}]`` for an
      ``"openai"`` one (a tool message's always joined); other parts are refused;
    * an assistant tool call's ``arguments`` JSON string parsed (it must be an object);
    * a final assistant message with string content: with ``continue_final_message`` it is
      removed and its text appended after the rendered prompt, else it becomes a user
      message (content only);
    * tools: passed only when some are declared and ``tool_choice`` (default ``none``
      without tools, ``auto`` with) is not ``none``; a named choice passes only that one;
      each tool dumped as ``{type, function, defer_loading}`` (``function``: the client's
      keys in its order, then a missing ``description`` and ``parameters`` as null);
    * template variables: ``reasoning_effort`` (also from ``reasoning.effort``) when set,
      ``thinking`` and ``enable_thinking`` defaulted from it (effort not ``none``, or
      ``reasoning.enabled``), then ``chat_template_kwargs``, over the server's defaults.
    """
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    dumped = [_message(m) for m in messages]
    request_tools = obj.get("tools")
    tools = None if request_tools is None else [_tool(t) for t in _as_list(request_tools)]
    effective = list(tools or [])
    for m in dumped:
        if m["role"] in _TOOL_HOSTS and m.get("tools"):
            effective.extend(m["tools"])
    hosted = any(_hosts_tools(m) for m in messages)
    choice = _tool_choice(obj, request_tools is None and not hosted)
    effort, kwargs = _reasoning(obj)
    final = obj.get("continue_final_message", False)
    if not isinstance(final, bool):
        raise ValueError("continue_final_message must be a boolean")
    input_ids = obj.get("input_ids")
    if input_ids is not None and not (
        isinstance(input_ids, list) and all(_is_int(t) for t in input_ids)
    ):
        raise ValueError("input_ids must be a list of integers")
    if rules.default_chat_template_kwargs:
        kwargs = dict(kwargs or {})
        for key, value in rules.default_chat_template_kwargs.items():
            kwargs.setdefault(key, value)
        if effort is None and kwargs.get("reasoning_effort") is not None:
            effort = kwargs["reasoning_effort"]
    _check_tools(choice, effective, hosted, kwargs)
    template_tools = None
    if effective and choice != "none":
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            template_tools = [t for t in tools or [] if t["function"]["name"] == name] or None
        elif tools:
            template_tools = tools
    if input_ids is not None:
        return SGLangChat([], template_tools, input_ids=list(input_ids))
    prepared = [_for_template(m, rules.content_format) for m in dumped]
    prefix = None
    last = prepared[-1]
    if last["role"] == "assistant" and isinstance(last.get("content"), str):
        if final:
            prefix = last["content"]
            prepared = prepared[:-1]
        else:
            prepared[-1] = {"role": "user", "content": last["content"]}
    template_kwargs: dict[str, Any] = {}
    if effort is not None:
        template_kwargs["reasoning_effort"] = effort
    template_kwargs.update(kwargs or {})
    return SGLangChat(prepared, template_tools, _template_variables(template_kwargs), prefix)


def _as_list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError("expected a list")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(value: Any, kind: type, what: str) -> Any:
    """``value`` if it is None or of ``kind`` (a bool is no int here), else ValueError."""
    if value is None or (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
        return value
    raise ValueError(f"{what}: expected {kind.__name__}")


def _hosts_tools(raw: Any) -> bool:
    role = raw.get("role") if isinstance(raw, dict) else None
    return isinstance(role, str) and role.lower() in _TOOL_HOSTS and bool(raw.get("tools"))


def _message(raw: Any) -> dict[str, Any]:
    """One message as SGLang's models dump it (unset fields as None)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise ValueError("a message needs a string role")
    if raw["role"] == "user":
        if raw.get("content") is None:
            raise ValueError("a user message needs content")
        return {"role": "user", "content": _content(raw["content"])}
    role = raw["role"].lower()
    if role not in _GENERIC_ROLES:
        raise ValueError(f"unknown role {raw['role']!r}")
    phase = raw.get("phase")
    if phase not in (None, "commentary", "final_answer"):
        raise ValueError("unknown phase")
    calls = raw.get("tool_calls")
    tools = raw.get("tools")
    return {
        "role": role,
        "content": None if raw.get("content") is None else _content(raw["content"]),
        "tool_call_id": _optional(raw.get("tool_call_id"), str, "tool_call_id"),
        "name": _optional(raw.get("name"), str, "name"),
        "phase": phase,
        "reasoning_content": _optional(raw.get("reasoning_content"), str, "reasoning_content"),
        "tool_calls": None if calls is None else [_tool_call(c) for c in _as_list(calls)],
        "tools": None if tools is None else [_tool(t) for t in _as_list(tools)],
        "prefix": _optional(raw.get("prefix"), bool, "prefix"),
    }


def _content(value: Any) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    parts = []
    for part in _as_list(value):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise ValueError("only text content parts are predicted")  # media, thinking
        if not isinstance(part.get("text"), str):
            raise ValueError("a text part needs a string text")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tool_call(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise ValueError("a tool call needs a function")
    if raw.get("type", "function") != "function":
        raise ValueError("a tool call's type must be 'function'")
    function = raw["function"]
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, str | dict):
        raise ValueError("arguments must be a string or an object")
    return {
        "id": _optional(raw.get("id"), str, "id"),
        "index": _optional(raw.get("index"), int, "index"),
        "type": "function",
        "function": {"name": _optional(function.get("name"), str, "name"), "arguments": arguments},
    }


def _tool(raw: Any) -> dict[str, Any]:
    """A tool as SGLang dumps it: ``{type, function, defer_loading}``."""
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise ValueError("a tool needs a function")
    kind = raw.get("type", "function")
    if not isinstance(kind, str):
        raise ValueError("a tool's type must be a string")
    deferred = _optional(raw.get("defer_loading"), bool, "defer_loading")
    function = raw["function"]
    if not isinstance(function.get("name"), str):
        raise ValueError("a tool needs a name")
    fields: dict[str, Any] = {
        "description": _optional(function.get("description"), str, "description"),
        "name": function["name"],
        "parameters": function.get("parameters"),
        "strict": _optional(function.get("strict"), bool, "strict"),
        "defer_loading": _optional(function.get("defer_loading"), bool, "defer_loading"),
    }
    if fields["defer_loading"] is None:
        fields["defer_loading"] = deferred
    for unset in ("strict", "defer_loading"):
        if fields[unset] is None:
            del fields[unset]
    order = [k for k in function if k in fields] + [k for k in fields if k not in function]
    _check_schema_types(fields.get("parameters"))
    return {"type": kind, "function": {k: fields[k] for k in order}, "defer_loading": deferred}


def _check_schema_types(schema: Any) -> None:
    """SGLang rewrites non-standard JSON Schema ``type`` names (``varchar``, ``int``...)
    before the template sees them; such a schema is refused here rather than rewritten."""
    if isinstance(schema, list):
        for item in schema:
            _check_schema_types(item)
    elif isinstance(schema, dict):
        kind = schema.get("type")
        names = kind if isinstance(kind, list) else [kind]
        if any(isinstance(n, str) and n not in _SCHEMA_TYPES for n in names) or (
            isinstance(kind, list) and len(set(map(repr, kind))) != len(kind)
        ):
            raise ValueError(f"non-standard schema type {kind!r}")
        for value in schema.values():
            _check_schema_types(value)


def _tool_choice(obj: Mapping[str, Any], no_tools: bool) -> str | dict[str, Any]:
    choice = obj.get("tool_choice")
    if choice is None:
        return "none" if no_tools else "auto"
    if choice in ("auto", "required", "none"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        function = choice.get("function")
        if isinstance(function, dict):
            return {"function": {"name": _optional(function.get("name"), str, "name")}}
    raise ValueError("unknown tool_choice")


def _check_tools(
    choice: str | dict[str, Any], effective: list[dict[str, Any]], hosted: bool, kwargs: Any
) -> None:
    """The refusals of SGLang's request validation that concern the template."""
    if isinstance(kwargs, dict) and "chat_template" in kwargs:
        raise ValueError("a request-supplied chat template is refused by default")
    names = [t["function"]["name"] for t in effective]
    if choice == "required" and not effective:
        raise ValueError("tool_choice 'required' without tools")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise ValueError("tool_choice names a tool that is not declared")
    if hosted and len(set(names)) != len(names):
        raise ValueError("tool names must be unique across request and message tools")


def _reasoning(obj: Mapping[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """``reasoning_effort`` and ``chat_template_kwargs`` after SGLang's reading of
    ``reasoning`` / ``reasoning_effort`` (``thinking`` and ``enable_thinking`` defaulted)."""
    effort = obj.get("reasoning_effort")
    thinking = None
    reasoning = obj.get("reasoning")
    if isinstance(reasoning, dict):
        wanted = reasoning.get("effort")
        if wanted is None:
            wanted = reasoning.get("reasoning_effort")
        if wanted in _EFFORTS:
            effort = wanted
        elif isinstance(wanted, int | float) and not isinstance(wanted, bool):
            effort = float(wanted)
        elif wanted is not None:
            raise ValueError("reasoning effort not predicted")  # numeric strings and worse
        enabled = reasoning.get("enabled")
        if enabled is None:
            enabled = reasoning.get("enable", False)
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in _TRUE_WORDS
        if enabled:
            thinking = True
    if effort is not None:
        thinking = effort != "none"
    kwargs = obj.get("chat_template_kwargs")
    if thinking is not None:
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        kwargs.setdefault("thinking", thinking)
        kwargs.setdefault("enable_thinking", thinking)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    if isinstance(effort, bool) or not (
        effort is None
        or effort in _EFFORTS
        or (isinstance(effort, int | float) and 0.0 <= effort <= 0.99)
    ):
        raise ValueError("reasoning_effort not predicted")
    if isinstance(effort, int):
        effort = float(effort)
    return effort, kwargs


def _for_template(message: dict[str, Any], content_format: str) -> dict[str, Any]:
    """One dumped message as the template gets it (SGLang's
    ``process_content_for_template_format`` and ``normalize_tool_content``)."""
    for call in message.get("tool_calls") or ():
        arguments = call["function"]["arguments"]
        if isinstance(arguments, str) and message["role"] == "assistant":
            try:
                parsed = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                raise ValueError("tool call arguments must be valid JSON") from None
            if not isinstance(parsed, dict):
                raise ValueError("tool call arguments must be a JSON object")
            call["function"]["arguments"] = parsed
    content = "" if message["content"] is None else message["content"]
    if isinstance(content, list) and content_format == "openai":
        out = {k: v for k, v in message.items() if v is not None and k != "content"}
        out["content"] = content  # moved last, as SGLang rebuilds the message
    else:
        if isinstance(content, list):
            content = " ".join(part["text"] for part in content)
        out = {k: v for k, v in {**message, "content": content}.items() if v is not None}
    if out["role"] == "tool" and isinstance(out["content"], list):
        out["content"] = " ".join(part["text"] for part in out["content"])
    return out


def _template_variables(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs`` as the template sees them: the names SGLang passes itself
    are refused (a TypeError there), apply_chat_template's own arguments are not template
    variables (any of them that changes the output is refused)."""
    for name in _PASSED:
        if name in kwargs:
            raise ValueError(f"chat_template_kwargs may not set {name!r}")
    for name in _ARGUMENTS:
        if name in ("continue_final_message", "return_assistant_tokens_mask") and kwargs.get(name):
            raise ValueError(f"chat_template_kwargs {name!r} is refused with the generation prompt")
        kwargs.pop(name, None)
    return kwargs
