"""Local tokenizers for exact mode: the token ids a worker will cache, computed here.

Exact mode matches a request against the blocks the worker reported in KV events, which
are token ids; so the gateway must render and tokenize the prompt exactly as the worker
does (SGLANG_API.md §6). Chosen explicitly by the config key ``kv_events.tokenizer``
(there is no default: a tokenizer the workers do not use makes every exact match wrong):

* ``"python:<module>:<factory>"``: the object ``factory()`` returns, which must have
  ``encode_chat(messages, tools)`` and ``encode(text)``; loaded by name, so the gateway
  imports no tokenizer of its own choosing (tests and demos name the simulated worker's,
  ``python:simulator.model.tokenizer:default_tokenizer``);
* ``"hf:<dir>"``: a real model's ``tokenizer.json`` (``tokenizers`` package) and its chat
  template (``tokenizer_config.json``'s ``chat_template``, rendered with ``jinja2``),
  both read from a local directory, never downloaded.

Nothing here is called on the event loop's hot path for approximate-mode workers.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    """Prompt → the token ids the worker caches."""

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None
    ) -> list[int]:
        """The chat template rendered with the generation prompt, then encoded."""

    def encode(self, text: str) -> list[int]:
        """Plain text as ``/v1/completions`` and ``/generate`` encode it."""


class HFTokenizer:
    """``tokenizer.json`` + the chat template from ``tokenizer_config.json`` in ``path``.

    Needs the ``tokenizers`` and ``jinja2`` packages (not installed by default). The
    template is rendered with ``add_generation_prompt=True`` and the tokenizer's special
    tokens; the rendered text is encoded without adding special tokens again (the
    template already holds BOS where the model wants it).
    """

    def __init__(self, path: str) -> None:
        import jinja2

        hf = importlib.import_module("tokenizers")  # optional; untyped

        directory = Path(path)
        self._tok = hf.Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ValueError(f"{path}: tokenizer_config.json has no chat_template")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template)
        self._specials = {
            k: v if isinstance(v, str) else (v or {}).get("content", "")
            for k, v in config.items()
            if k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None
    ) -> list[int]:
        text = self._template.render(
            messages=list(messages), tools=tools, add_generation_prompt=True, **self._specials
        )
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)


def load_tokenizer(spec: str) -> Tokenizer:
    """``"hf:<directory>"`` or ``"python:<module>:<factory>"`` (see the module docstring);
    ValueError naming the problem otherwise."""
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    if spec.startswith("python:"):
        return _python_tokenizer(spec[len("python:") :])
    raise ValueError(
        f"unknown tokenizer {spec!r}: expected 'hf:<directory>' or 'python:<module>:<factory>'"
    )


def _python_tokenizer(target: str) -> Tokenizer:
    module_name, sep, factory_name = target.partition(":")
    if not sep or not module_name or not factory_name:
        raise ValueError(f"tokenizer 'python:{target}': expected python:<module>:<factory>")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tokenizer 'python:{target}': {exc}") from None
    tok = factory()
    if not (callable(getattr(tok, "encode_chat", None)) and callable(getattr(tok, "encode", None))):
        raise ValueError(f"tokenizer 'python:{target}': the object has no encode_chat/encode")
    result: Tokenizer = tok
    return result
