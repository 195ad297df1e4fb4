"""A real model's tokenizer for the simulated worker (``--tokenizer-path DIR``).

SGLang tokenizes with ``transformers``: ``AutoTokenizer`` over the model directory's
``tokenizer.json`` / ``tokenizer_config.json``, ``apply_chat_template(...,
tokenize=True)`` for chat (the template's special tokens only, none added), plain
``encode`` (special tokens added as the tokenizer's post-processor says) for
``/v1/completions`` and ``/generate``. The simulated worker does the same, through the
same library, so its token ids, cached prefixes and KV events are the ones a real SGLang
server with that model would produce, and the gateway's own renderer
(``gateway.exact``) is checked against an independent implementation whenever they run
together. Before the template, the messages are prepared as SGLang 0.5.23's chat
handler prepares them (:func:`sglang_chat_inputs`).

Needs ``transformers`` (a development dependency; the default arithmetic tokenizer,
:mod:`simulator.model.tokenizer`, needs nothing). Files are read locally, never
downloaded. Output text: a deterministic ring of the vocabulary's ordinary tokens.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


class HFWorkerTokenizer:
    """The :class:`simulator.model.tokenizer.SimTokenizer` interface over ``transformers``."""

    def __init__(
        self, path: str, chat_template: str | None = None, ring_tokens: int = 65_536
    ) -> None:
        try:
            transformers = importlib.import_module("transformers")
        except ImportError as exc:
            raise ValueError(
                f"--tokenizer-path needs the transformers package ({exc}); "
                "it is in the project's dev extra"
            ) from None
        if not (Path(path) / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer-path {path}: no tokenizer.json there")
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        if chat_template is not None:
            tok.chat_template = _template_file(chat_template)
        if not tok.chat_template:
            raise ValueError(f"--tokenizer-path {path}: the tokenizer has no chat template")
        self._tok = tok
        self.vocab_size: int = len(tok)
        eos = tok.eos_token_id
        self.eos_token_id: int = int(eos if eos is not None else 0)
        special = set(tok.all_special_ids)
        ordinary = [i for i in range(self.vocab_size) if i not in special]
        rng = random.Random(20_240_601)
        self._ring = [rng.choice(ordinary) for _ in range(ring_tokens)]

    # ------------------------------------------------------------------ encode/decode
    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def id_to_piece(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        msgs, tool_list = sglang_chat_inputs(messages, tools)
        text: str = self._render(msgs, tool_list, add_generation_prompt, False, template_kwargs)
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        msgs, tool_list = sglang_chat_inputs(messages, tools)
        ids = self._render(msgs, tool_list, add_generation_prompt, True, template_kwargs)
        return [int(i) for i in ids]

    def _render(
        self,
        msgs: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        tokenize: bool,
        template_kwargs: Mapping[str, Any],
    ) -> Any:
        """transformers' ``apply_chat_template`` as SGLang calls it: the text, or (with
        ``tokenize``) the ids without special tokens added."""
        extra = {"return_dict": False} if tokenize else {}
        return self._tok.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
            **extra, **template_kwargs,
        )  # fmt: skip

    def encode_chat_request(self, body: Mapping[str, Any]) -> list[int]:
        """A chat request's prompt as SGLang's chat handler builds it: the messages and
        tools prepared (:func:`sglang_chat_inputs`), ``reasoning_effort`` and
        ``chat_template_kwargs`` as template variables, a continued final assistant
        message appended after the prompt."""
        messages = list(body.get("messages") or [])
        kwargs: dict[str, Any] = {}
        effort = body.get("reasoning_effort")
        if effort is not None:
            kwargs = {"reasoning_effort": effort, "thinking": effort != "none",
                      "enable_thinking": effort != "none"}  # fmt: skip
        given = body.get("chat_template_kwargs")
        kwargs.update(given if isinstance(given, Mapping) else {})
        prefix = None
        last = _message(messages[-1]) if messages and isinstance(messages[-1], Mapping) else None
        if body.get("continue_final_message") and last is not None and last["role"] == "assistant":
            prefix, messages = last["content"], messages[:-1]  # as the template would get it
        tools = body.get("tools")
        msgs, tool_list = sglang_chat_inputs(
            messages, tools if isinstance(tools, list) else None, body.get("tool_choice")
        )
        ids = [int(i) for i in self._render(msgs, tool_list, True, True, kwargs)]
        if prefix:
            more = self._tok.encode(prefix)
            if more and more[0] == self._tok.bos_token_id:
                more = more[1:]
            ids += more
        return ids

    # ------------------------------------------------------------------ output text
    def pseudo_output_ids(self, seed: int, n: int) -> list[int]:
        ring, size = self._ring, len(self._ring)
        start = seed % size
        return [ring[(start + i) % size] for i in range(n)]


def _template_file(path: str) -> str:
    """A ``--chat-template`` file as SGLang reads it: a ``.jinja`` file only, leading and
    trailing newlines stripped, each literal ``\\n`` a newline."""
    if Path(path).suffix != ".jinja":
        raise ValueError(f"--chat-template {path}: SGLang reads only a .jinja file as a template")
    return Path(path).read_text(encoding="utf-8").strip("\n").replace("\\n", "\n")


_KEPT = ("tool_call_id", "name", "phase", "reasoning_content", "tool_calls", "tools", "prefix")


def sglang_chat_inputs(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None,
    tool_choice: Any = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools as SGLang 0.5.23's chat handler hands them to the template
    (the common cases; the gateway's ``gateway.exact.request`` predicts the rest):

    * a user message keeps its role and content; other roles keep the fields SGLang's
      models know, unset ones dropped; a null content becomes ``""``; a list of text
      parts is joined with spaces;
    * an assistant tool call's JSON-string ``arguments`` become an object;
    * a final assistant message with string content becomes a user message;
    * tools pass when declared and ``tool_choice`` is not ``none`` (default ``auto`` with
      tools), each as SGLang dumps it: ``{type, function, defer_loading}``, the function's
      missing ``description`` and ``parameters`` as null.
    """
    tool_list = None
    if tools and tool_choice != "none":
        tool_list = [_tool(t) for t in tools]
        if isinstance(tool_choice, Mapping):
            name = (tool_choice.get("function") or {}).get("name")
            tool_list = [t for t in tool_list if t["function"]["name"] == name] or None
    out = [_message(m) for m in messages]
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and isinstance(last["content"], str):
        out[-1] = {"role": "user", "content": last["content"]}
    return out, tool_list


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    elif content is None:
        content = ""
    role = str(m.get("role", "user"))
    if role == "user":
        return {"role": "user", "content": content}
    msg: dict[str, Any] = {"role": role.lower(), "content": content}
    for key in _KEPT:
        if m.get(key) is not None:
            msg[key] = m[key]
    calls = msg.get("tool_calls")
    if isinstance(calls, list):
        msg["tool_calls"] = [_tool_call(c, msg["role"] == "assistant") for c in calls]
    return msg


def _tool_call(call: Any, parse: bool) -> Any:
    """As SGLang's model dumps it: unset ``id`` and ``index`` stay, as null."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    arguments = call["function"].get("arguments")
    if parse and isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    name = call["function"].get("name")
    return {"id": call.get("id"), "index": call.get("index"), "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


def _tool(t: Any) -> dict[str, Any]:
    """As SGLang dumps it: the function's known fields in the client's order, then a
    missing description and parameters as null (strict, defer_loading only when set)."""
    if not isinstance(t, Mapping) or not isinstance(t.get("function"), Mapping):
        return dict(t) if isinstance(t, Mapping) else {"function": t}
    given = t["function"]
    fields = {k: given.get(k) for k in _FUNCTION_FIELDS}
    if fields["defer_loading"] is None:
        fields["defer_loading"] = t.get("defer_loading")
    for unset in ("strict", "defer_loading"):
        if fields[unset] is None:
            del fields[unset]
    order = [k for k in given if k in fields] + [k for k in fields if k not in given]
    return {"type": t.get("type", "function"), "function": {k: fields[k] for k in order},
            "defer_loading": t.get("defer_loading")}  # fmt: skip
