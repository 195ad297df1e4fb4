"""Hugging Face chat templates, rendered as ``transformers``' ``apply_chat_template`` does.

A model's chat template is a Jinja program; the engine (SGLang, through ``transformers``)
renders it and tokenizes the text, and exact mode must produce the same text to the
character. This module is a second, independent implementation of those rules (checked
against ``transformers`` itself by ``tests/unit/test_chat_template_oracle.py`` on 70 real
templates), so the gateway needs ``jinja2`` but never ``transformers``:

* the environment: ``jinja2``'s ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
  ``lstrip_blocks`` (every other option at Jinja's default: no autoescape, one trailing
  newline of the source dropped), the ``loopcontrols`` extension (``break``/``continue``)
  and a ``{% generation %}...{% endgeneration %}`` block, rendered through (the engine
  asks for no assistant mask);
* ``tojson`` as ``transformers`` redefines it: ``json.dumps`` with ``ensure_ascii=False``
  by default, and the ``indent``, ``separators`` and ``sort_keys`` arguments passed on (no
  HTML escaping, unlike Jinja's own filter);
* globals ``raise_exception(message)`` (a ``TemplateError``) and ``strftime_now(format)``
  (the local time now; :class:`ChatTemplate` takes the clock, so tests can fix it);
* variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
  tokenizer's special tokens (:func:`special_tokens`) and the caller's keyword arguments,
  which win over the special tokens;
* ``continue_final_message``: the last message rendered open-ended (``transformers``'
  marker rule: a tag appended to its text, the render cut at the tag).

Where the template comes from (:func:`read_chat_templates`, :func:`pick_template`): the
directory's ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` (how
``transformers`` 5 saves them) before ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of named templates); among named templates ``transformers`` takes the
one named by the caller, else ``tool_use`` when tools are given, else ``default``.

Every failure of a template (a syntax error at compile time; ``raise_exception``, an
undefined value used, a type error while rendering) surfaces as :class:`ChatTemplateError`,
a ``ValueError``: a conversation the template refuses gets no tokens, never a crash.

:func:`content_format` is SGLang's reading of a template (whether it iterates over a
message's content parts), which decides how SGLang hands list contents to it.

Cost: one compile per template (at load); a render is the template's own work (tens of
microseconds for a short chat, linear in the conversation).
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

# The named special tokens ``transformers`` hands every template (``special_tokens_map``).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# What ``continue_final_message`` appends to the final message, to find where it ends.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# CPU bound of one render (seconds), unless the caller gives another: the gateway renders
# on its event loop, and a template may be quadratic or worse in the conversation.
DEFAULT_RENDER_BUDGET_S = 0.1


class ChatTemplateError(ValueError):
    """The template failed to compile, refused the conversation, or failed rendering it."""


class RenderBudgetExceeded(ChatTemplateError):
    """A render used more than its CPU budget (checked at every attribute, item and call
    the template makes and every ``range`` step): abandoned, never retried."""


class _Budget(Exception):
    """Raised inside Jinja when the deadline passed (no TypeError/LookupError: nothing in
    the sandbox swallows it); :meth:`ChatTemplate.render` turns it into
    :class:`RenderBudgetExceeded`."""


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with a budget checked on every attribute, item and call. The budget
    is the rendering thread's own (renders of one template may run at once in several
    threads: requests tokenized off the event loop) and counts the CPU time that thread
    spent rendering: a render descheduled on a busy host is not cut for the time other
    work took. Checked on the cheap wall clock; the thread's CPU clock (~8x dearer) is
    read only once the wall deadline passed, and moves that deadline on if the CPU
    budget is not spent."""

    _local = threading.local()

    @property
    def deadline(self) -> float:
        at: float = getattr(self._local, "deadline", math.inf)
        return at

    def start(self, budget_s: float | None) -> None:
        """Arm the budget for a render in this thread (None: disarm)."""
        if budget_s is None:
            self._local.deadline = self._local.cpu_deadline = math.inf
        else:
            self._local.deadline = time.perf_counter() + budget_s
            self._local.cpu_deadline = time.thread_time() + budget_s

    def tick(self) -> None:
        if time.perf_counter() > self.deadline:
            left = self._local.cpu_deadline - time.thread_time()
            if left <= 0:
                raise _Budget
            self._local.deadline = time.perf_counter() + left

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.tick()
        return super().call(__context, __obj, *args, **kwargs)


class _Range(Sequence[int]):
    """The sandbox's ``range`` (at most 100,000 items), checking the deadline per step."""

    def __init__(self, env: _BudgetedEnvironment, r: range) -> None:
        self._env, self._r = env, r

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i: Any) -> Any:
        got = self._r[i]
        return _Range(self._env, got) if isinstance(got, range) else got

    def __iter__(self) -> Iterator[int]:
        for i in self._r:
            self._env.tick()
            yield i


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: the body, rendered in place."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _environment(clock: Callable[[], datetime]) -> _BudgetedEnvironment:
    env = _BudgetedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: clock().strftime(fmt)
    env.globals["range"] = lambda *args: _Range(env, safe_range(*args))
    return env


class ChatTemplate:
    """One chat template, compiled once; :meth:`render` as ``apply_chat_template(...,
    tokenize=False)`` renders it.

    ``special_tokens`` are the tokenizer's (:func:`special_tokens`); ``clock`` is what
    ``strftime_now`` reads (the local time by default); ``budget_s`` bounds one render's
    CPU (:class:`RenderBudgetExceeded` beyond it; None: unbounded).
    """

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        clock: Callable[[], datetime] = datetime.now,
        budget_s: float | None = DEFAULT_RENDER_BUDGET_S,
    ) -> None:
        self.source = source
        self.budget_s = budget_s
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._env = _environment(clock)
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text; :class:`ChatTemplateError` if the template refuses it."""
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt are mutually exclusive"
            )
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("tools must be JSON schemas (mappings)")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise ChatTemplateError("documents must be mappings")
        chat: Sequence[Mapping[str, Any]] = messages
        field = ""
        final_text = ""
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            chat, final_text = self._tag_final_message(messages, field)
        variables = {**self.special_tokens, **kwargs}
        for name in ("messages", "tools", "documents", "add_generation_prompt"):
            if name in variables:
                raise ChatTemplateError(f"template argument {name!r} given twice")
        self._env.start(self.budget_s)
        try:
            text = self._template.render(
                messages=chat,
                tools=None if tools is None else list(tools),
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except ChatTemplateError:
            raise
        except _Budget:
            raise RenderBudgetExceeded(
                f"chat template render exceeded its {self.budget_s:g} s budget"
            ) from None
        except Exception as exc:  # TemplateError, UndefinedError, TypeError, ...: a refusal
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            self._env.start(None)
        if continue_final_message:
            text = self._cut_at_tag(text, final_text)
        return text

    def _tag_final_message(
        self, messages: Sequence[Mapping[str, Any]], field: str
    ) -> tuple[list[Any], str]:
        chat: list[Any] = copy.deepcopy(list(messages))
        final = chat[-1].get(field)
        if final is None:
            raise ChatTemplateError(f"continue_final_message: the final message has no {field!r}")
        if field not in self.source:
            raise ChatTemplateError(f"continue_final_message: the template never reads {field!r}")
        if isinstance(final, list | tuple):
            for block in reversed(final):
                if "text" in block:
                    text = str(block["text"])
                    block["text"] = block["text"] + _CONTINUE_TAG
                    return chat, text
            raise ChatTemplateError("continue_final_message: no text in the final message")
        try:
            chat[-1][field] = final + _CONTINUE_TAG
        except TypeError as exc:
            raise ChatTemplateError(f"continue_final_message: {exc}") from None
        return chat, str(final)

    @staticmethod
    def _cut_at_tag(text: str, final_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in text or tag not in text:
            raise ChatTemplateError(
                "continue_final_message: the template dropped part of the final message"
            )
        at = text.rindex(tag)
        if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the message's trailing space

    def content_format(self) -> str:
        """``"openai"`` if SGLang hands this template content as a list of parts, else
        ``"string"`` (SGLang 0.5.23's detection, after vLLM's)."""
        return content_format(self.source, self._env)


def content_format(source: str, env: jinja2.Environment | None = None) -> str:
    """SGLang's reading: a template naming images, audio, video or vision, or looping over
    ``message.content`` (``msg``/``m`` too; through filters, tests or slices), takes
    ``"openai"`` content (lists of parts); any other, or one that does not parse,
    ``"string"`` (a list of text parts is joined with spaces before it)."""
    if any(word in source for word in ("image", "audio", "video", "vision")):
        return "openai"
    try:
        ast = (env or _environment(datetime.now)).parse(source)
    except jinja2.TemplateError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        if _reads_content(loop.iter):
            return "openai"
    return "string"


def _reads_content(node: jinja2.nodes.Node | None) -> bool:
    while (isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None) or (
        isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
    ):
        node = node.node  # through filters, tests and slices
    if isinstance(node, jinja2.nodes.Getitem):
        key, base = node.arg, node.node
        named = isinstance(key, jinja2.nodes.Const) and key.value == "content"
    elif isinstance(node, jinja2.nodes.Getattr):
        base, named = node.node, node.attr == "content"
    else:
        return False
    return (
        named
        and isinstance(base, jinja2.nodes.Name)
        and base.ctx == "load"
        and base.name in ("message", "msg", "m")
    )


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The template's special-token variables from a ``tokenizer_config.json``, as
    ``transformers``' ``special_tokens_map``: the named ones (``bos_token``, ``eos_token``,
    ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``: a string or
    an AddedToken object, whose ``content`` counts), then the other ``*_token`` keys, those
    given as objects marked ``"__type": "AddedToken"`` before those given as strings, then
    the ``extra_special_tokens`` mapping (the order ``transformers`` adds missing ones to
    the vocabulary in); null or absent ones are left out."""
    out: dict[str, str] = {}
    for key in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(key), marked=False)
        if text is not None:
            out[key] = text
    others = [k for k in config if k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES]
    for key in sorted(others, key=lambda k: isinstance(config[k], str)):  # stable
        text = _token_text(config[key], marked=True)
        if text is not None:
            out[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            text = _token_text(value, marked=False)
            if text is not None:
                out[str(key)] = text
    return out


def _token_text(value: Any, marked: bool) -> str | None:
    if isinstance(value, str):
        return value
    if (
        isinstance(value, Mapping)
        and isinstance(value.get("content"), str)
        and (not marked or value.get("__type") == "AddedToken")
    ):
        return str(value["content"])
    return None


def read_chat_templates(directory: Path) -> str | dict[str, str] | None:
    """The chat template(s) of a model directory, as ``transformers`` 5 loads them: the
    files (``chat_template.jinja`` as ``"default"``, ``additional_chat_templates/NAME.jinja``)
    win over ``tokenizer_config.json``'s ``chat_template``; one template is a string,
    several a name → source mapping (in the order they were listed); None if there is
    none."""
    files: dict[str, str] = {}
    single = directory / CHAT_TEMPLATE_FILE
    if single.is_file():
        files["default"] = single.read_text(encoding="utf-8")
    extra_dir = directory / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    value = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(value, list):
        named = {}
        for item in value:
            if not (isinstance(item, Mapping) and isinstance(item.get("template"), str)):
                raise ChatTemplateError(f"{config_path}: a named chat template is malformed")
            named[str(item.get("name"))] = str(item["template"])
        return named
    return value if isinstance(value, str) else None


def pick_template(
    templates: str | Mapping[str, str],
    tools: Sequence[Any] | None = None,
    name: str | None = None,
) -> str:
    """``transformers``' choice among named templates: ``name`` if given (and known), else
    ``tool_use`` when ``tools`` is not None and there is one, else ``default``."""
    if isinstance(templates, str):
        return templates
    if name is not None and name in templates:
        return templates[name]
    if name is None:
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
    raise ChatTemplateError(
        f"no chat template named {name or 'default'!r} (there are {sorted(templates)})"
    )
