"""Local tokenizers for exact mode: the token ids a worker will cache, computed here.

Exact mode matches a request against the blocks the worker reported in KV events, which
are token ids; so the gateway must render and tokenize the prompt exactly as the worker
does (SGLANG_API.md §6, docs/KV_EVENTS.md "Tokenizers and chat templates"). Chosen
explicitly by the config key ``kv_events.tokenizer`` (there is no default: a tokenizer the
workers do not use makes every exact match wrong):

* ``"hf:<dir>"``: :class:`HFTokenizer`, a real model's files read from a local directory,
  never downloaded: ``tokenizer.json`` (``tokenizers`` package) and its chat template
  (:mod:`gateway.exact.chat_template`, ``jinja2``), encoded as SGLang 0.5.23 encodes with
  ``transformers`` 5.19; the request is prepared before the template as SGLang's chat
  handler prepares it (:mod:`gateway.exact.request`, which reads :attr:`HFTokenizer.chat_rules`).
* ``"python:<module>:<factory>"``: the object ``factory()`` returns, which must have
  ``encode_chat(messages, tools)`` and ``encode(text)``; loaded by name, so the gateway
  imports no tokenizer of its own choosing (tests and demos name the simulated worker's,
  ``python:simulator.model.tokenizer:default_tokenizer``). Such an object stands for the
  engine's whole chat path: it gets the request's messages and tools as sent.

Both optional packages are imported when an ``hf:`` tokenizer is loaded, not before.
Nothing here is called on the event loop's hot path for approximate-mode workers.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.exact.chat_template import ChatTemplate


class Tokenizer(Protocol):
    """Prompt → the token ids the worker caches."""

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The chat template rendered with the generation prompt, then encoded.

        ``template_kwargs`` are extra template variables (a request's
        ``chat_template_kwargs``); callers pass them only when there are some, so an
        object whose ``encode_chat`` takes none still serves requests without them.
        """

    def encode(self, text: str) -> list[int]:
        """Plain text as ``/v1/completions`` and ``/generate`` encode it."""


@dataclass(frozen=True, slots=True)
class ChatRules:
    """What a tokenizer rendering the model's own chat template tells
    :mod:`gateway.exact.request`, which then prepares a chat request as SGLang does before
    the template (a tokenizer without ``chat_rules`` gets the request's messages as sent).

    ``content_format``: ``"string"`` (lists of text parts joined with spaces) or
    ``"openai"`` (kept as lists), SGLang's reading of the template;
    ``bos_token_id``: dropped from the front of a continued assistant message's tokens;
    ``default_chat_template_kwargs``: the server's defaults (SGLang's
    ``--default-chat-template-kwargs``), under the request's own.
    """

    content_format: str = "string"
    bos_token_id: int | None = None
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


class HFTokenizer:
    """A model directory's ``tokenizer.json`` and chat template, as SGLang uses them.

    Needs the ``tokenizers`` and ``jinja2`` packages (the ``exact`` extra).

    * Tokenizer: ``tokenizer.json``, plus what ``transformers`` adds on load: the
      ``added_tokens_decoder`` entries and the special tokens of ``tokenizer_config.json``
      it lacks (as special added tokens, in that order), and ``split_special_tokens``.
    * Template, as SGLang picks it: ``chat_template_file`` (SGLang's ``--chat-template
      FILE.jinja``: leading and trailing newlines stripped, each literal ``\\n`` a
      newline), else the directory's (:func:`gateway.exact.chat_template.read_chat_templates`);
      among named templates the one called ``template_name`` (SGLang's
      ``--hf-chat-template-name``), else the first listed: SGLang fixes one template at
      start, it never switches to ``tool_use`` per request as ``transformers`` would.
    * Chat: rendered with the generation prompt and the special tokens; if the template
      fails with the tools as given, rendered again with each tool's bare ``function``
      object (SGLang's retry, for templates such as Mistral's); then encoded without
      special tokens when the tokenizer adds any to an empty text, else as ``encode``.
    * Text (``/v1/completions``, ``/generate``): encoded with the special tokens the
      tokenizer's post-processor adds.

    A directory with no chat template still encodes text; its chats raise ValueError.
    """

    def __init__(
        self,
        path: str,
        chat_template_file: str | None = None,
        *,
        template_name: str | None = None,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        clock: Callable[[], datetime] = datetime.now,
        render_budget_s: float | None = None,
    ) -> None:
        from gateway.exact import chat_template as ct  # jinja2: optional

        hf = importlib.import_module("tokenizers")  # optional; untyped
        directory = Path(path)
        config = _tokenizer_config(directory)
        self._tok = hf.Tokenizer.from_file(str(directory / "tokenizer.json"))
        _add_config_tokens(self._tok, config, hf.AddedToken)
        if config.get("split_special_tokens") is True:
            self._tok.encode_special_tokens = True
        specials = ct.special_tokens(config)
        source, detected_on = _engine_template(directory, chat_template_file, template_name)
        self._template: ChatTemplate | None = None
        content_format = "string"
        if source is not None:
            budget = ct.DEFAULT_RENDER_BUDGET_S if render_budget_s is None else render_budget_s
            self._template = ct.ChatTemplate(source, specials, clock, budget)
            content_format = ct.content_format(detected_on)
        self._specials_on_empty = bool(self._tok.encode("").ids)
        bos = specials.get("bos_token")
        bos_id = self._token_id(bos) if bos is not None else None
        defaults = dict(default_chat_template_kwargs or {})
        self.chat_rules = ChatRules(content_format, bos_id, defaults)

    def _token_id(self, token: str) -> int | None:
        found = self._tok.token_to_id(token)
        if found is None:
            unk = self._template.special_tokens.get("unk_token") if self._template else None
            found = self._tok.token_to_id(unk) if unk else None
        return None if found is None else int(found)

    @property
    def template(self) -> ChatTemplate | None:
        """The compiled chat template (None if the directory has none)."""
        return self._template

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text SGLang renders (generation prompt on; ``documents`` among the
        keyword arguments is the template's ``documents``); ValueError if refused."""
        if self._template is None:
            raise ValueError("the tokenizer has no chat template")
        if "add_generation_prompt" in template_kwargs:
            raise ValueError("template argument 'add_generation_prompt' given twice")
        documents = template_kwargs.pop("documents", None)
        from gateway.exact.chat_template import RenderBudgetExceeded

        try:
            return self._template.render(
                messages, tools, documents, add_generation_prompt=True, **template_kwargs
            )
        except RenderBudgetExceeded:
            raise  # no second render of a conversation the budget could not cover
        except ValueError:
            if not tools:
                raise
        bare = [t["function"] if isinstance(t, Mapping) and "function" in t else t for t in tools]
        return self._template.render(
            messages, bare, documents, add_generation_prompt=True, **template_kwargs
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        text = self.render_chat(messages, tools, **template_kwargs)
        return self._encode(text, not self._specials_on_empty)

    def encode(self, text: str) -> list[int]:
        return self._encode(text, True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: the same ids, as fast, but it releases the GIL while it
        # works, so a request tokenized in a thread leaves the event loop running
        (got,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(got.ids)


_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` ({} if absent), with a legacy ``special_tokens_map.json``
    over it when the config has no ``added_tokens_decoder`` (as ``transformers`` reads)."""
    path = directory / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    legacy = directory / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        config.update(json.loads(legacy.read_text(encoding="utf-8")))
    return config


def _add_config_tokens(tok: Any, config: Mapping[str, Any], added_token: Any) -> None:
    """Add what ``transformers`` adds on load and ``tokenizer.json`` lacks: the config's
    ``added_tokens_decoder`` entries (by id), then its special tokens (named, other
    ``*_token``, ``extra_special_tokens``/``additional_special_tokens``), as special."""
    present = {str(t.content) for t in tok.get_added_tokens_decoder().values()}
    new: list[Any] = []

    def add(token: Any) -> None:
        if token.content not in present:
            present.add(token.content)
            new.append(token)

    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, Mapping):
        for _, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            if isinstance(entry, Mapping) and isinstance(entry.get("content"), str):
                flags = {k: bool(entry[k]) for k in _TOKEN_FLAGS if k in entry}
                add(added_token(entry["content"], **flags))
    from gateway.exact.chat_template import special_tokens

    for text in special_tokens(config).values():
        add(added_token(text, special=True))
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    if isinstance(extra, list):
        for item in extra:
            content = item.get("content") if isinstance(item, Mapping) else item
            if isinstance(content, str):
                add(added_token(content, special=True))
    if new:
        tok.add_tokens(new)


def _engine_template(
    directory: Path, chat_template_file: str | None, template_name: str | None
) -> tuple[str | None, str]:
    """The template SGLang renders, and the text it reads the content format from."""
    from gateway.exact.chat_template import read_chat_templates

    if chat_template_file:
        path = Path(chat_template_file)
        if path.suffix != ".jinja":
            raise ValueError(
                f"chat template {chat_template_file}: SGLang reads a --chat-template file as "
                "a Jinja template only when its name ends in .jinja"
            )
        raw = path.read_text(encoding="utf-8").strip("\n")
        return raw.replace("\\n", "\n"), raw
    templates = read_chat_templates(directory)
    if templates is None or isinstance(templates, str):
        return templates, templates or ""
    if template_name is not None:
        if template_name not in templates:
            raise ValueError(
                f"no chat template named {template_name!r} (there are {list(templates)})"
            )
        chosen = templates[template_name]
    else:
        chosen = next(iter(templates.values()))
    return chosen, chosen


def load_tokenizer(
    spec: str, chat_template_file: str | None = None, render_budget_s: float | None = None
) -> Tokenizer:
    """``"hf:<directory>"`` or ``"python:<module>:<factory>"`` (see the module docstring);
    ``chat_template_file`` overrides an ``hf:`` directory's template; ``render_budget_s``
    bounds one chat render's CPU (default :data:`~gateway.exact.chat_template.
    DEFAULT_RENDER_BUDGET_S`). ValueError naming the problem otherwise."""
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:], chat_template_file, render_budget_s=render_budget_s)
    if chat_template_file:
        raise ValueError(f"tokenizer {spec!r}: a chat template file applies to hf: tokenizers only")
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
