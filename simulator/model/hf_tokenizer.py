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
            tok.chat_template = Path(chat_template).read_text()
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
        text: str = self._tok.apply_chat_template(
            msgs,
            tools=tool_list,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        msgs, tool_list = sglang_chat_inputs(messages, tools)
        ids = self._tok.apply_chat_template(
            msgs,
            tools=tool_list,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **template_kwargs,
        )
        return [int(i) for i in ids]

    # ------------------------------------------------------------------ output text
    def pseudo_output_ids(self, seed: int, n: int) -> list[int]:
        ring, size = self._ring, len(self._ring)
        start = seed % size
        return [ring[(start + i) % size] for i in range(n)]


def sglang_chat_inputs(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools as SGLang 0.5.23 hands them to the template: a tool is its
    ``function`` object; an assistant tool call's JSON-string ``arguments`` become an
    object; a content list of text parts is joined into one string."""
    tool_list = None
    if tools:
        tool_list = [
            dict(t["function"]) if isinstance(t, Mapping) and "function" in t else dict(t)
            for t in tools
        ]
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, list) and all(
            isinstance(p, Mapping) and p.get("type") == "text" for p in content
        ):
            msg["content"] = "".join(str(p.get("text", "")) for p in content)
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                call = dict(call) if isinstance(call, Mapping) else call
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
                    function = dict(function)
                    with contextlib.suppress(json.JSONDecodeError):
                        function["arguments"] = json.loads(function["arguments"])
                    call["function"] = function
                fixed.append(call)
            msg["tool_calls"] = fixed
        out.append(msg)
    return out, tool_list
