"""The chat-template renderer's rules, the ``hf:`` tokenizer's loading, and SGLang's
preparation of a chat request (:mod:`gateway.exact.request`), on small inline templates.

The equality with ``transformers`` on real templates is
``tests/unit/test_chat_template_oracle.py``; here each rule is pinned on its own, with
expected values written out by hand (from ``transformers`` 5.19's and SGLang 0.5.23's
sources).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import orjson
import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors, trainers

from gateway.exact.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    content_format,
    pick_template,
    read_chat_templates,
    special_tokens,
)
from gateway.exact.request import SGLangChat, request_tokens, sglang_chat
from gateway.exact.tokenizer import ChatRules, HFTokenizer, load_tokenizer

USER = [{"role": "user", "content": "hi"}]


def render(source: str, messages: list[dict[str, Any]] | None = None, **kw: Any) -> str:
    return ChatTemplate(source).render(messages or USER, **kw)


# ------------------------------------------------------------------ the environment


def test_blocks_are_trimmed_and_stripped() -> None:
    source = "  {% for m in messages %}\n[{{ m.content }}]\n  {% endfor %}\nend\n"
    # lstrip_blocks: the indent before a tag goes; trim_blocks: the newline after it;
    # one trailing newline of the source is dropped (Jinja's keep_trailing_newline=False)
    assert render(source) == "[hi]\nend"


def test_tojson_is_transformers_own() -> None:
    value = {"b": "<é 日本 😀>", "a": [1, 2]}
    assert render("{{ v | tojson }}", v=value) == '{"b": "<é 日本 😀>", "a": [1, 2]}'
    assert render("{{ v | tojson(sort_keys=true) }}", v=value).startswith('{"a": [1, 2]')
    assert render("{{ v | tojson(indent=2) }}", v={"a": 1}) == '{\n  "a": 1\n}'
    compact = render("{{ v | tojson(separators=(',', ':')) }}", v=value)
    assert compact == '{"b":"<é 日本 😀>","a":[1,2]}'
    assert render("{{ v | tojson(ensure_ascii=true) }}", v="é") == '"\\u00e9"'


def test_loop_controls_and_generation_blocks() -> None:
    source = (
        "{% for m in messages %}{% if loop.index == 2 %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    )
    messages = [{"role": "user", "content": str(i)} for i in range(6)]
    assert render(source, messages) == "<0><2>"


def test_raise_exception_and_failures_are_value_errors() -> None:
    with pytest.raises(ChatTemplateError, match="no system"):
        render("{{ raise_exception('no system') }}")
    with pytest.raises(ValueError, match="UndefinedError"):
        render("{{ nothing.here }}")
    with pytest.raises(ValueError, match="TypeError"):  # json.dumps(Undefined)
        render("{{ nothing | tojson }}")
    with pytest.raises(ValueError, match="SecurityError"):  # the sandbox is immutable
        render("{% set xs = [] %}{{ xs.append(1) }}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    assert issubclass(ChatTemplateError, ValueError)


def test_strftime_now_reads_the_clock() -> None:
    template = ChatTemplate("{{ strftime_now('%d %b %Y') }}", clock=lambda: datetime(2024, 7, 26))
    assert template.render(USER) == "26 Jul 2024"


def test_variables_special_tokens_and_kwargs() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{{ messages | length }}{{ tools | length }}{{ documents[0].title }}"
        "{{ add_generation_prompt }}{{ eos_token }}{{ extra }}",
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
    text = template.render(
        USER,
        tools=[{"name": "f"}],
        documents=[{"title": "T"}],
        add_generation_prompt=True,
        extra="!",
        eos_token="<e>",  # the caller's wins
    )
    assert text == "<s>11TTrue<e>!"
    with pytest.raises(ChatTemplateError):
        template.render([])
    with pytest.raises(ChatTemplateError):
        template.render(USER, documents=["not a mapping"])  # type: ignore[list-item]


def test_continue_final_message() -> None:
    source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    messages = [*USER, {"role": "assistant", "content": "Once upon "}]
    assert (
        render(source, messages, continue_final_message=True)
        == "<user>hi</user><assistant>Once upon "
    )
    trimmed = source.replace("m.content", "m.content | trim")
    assert render(trimmed, messages, continue_final_message=True).endswith("<assistant>Once upon")
    parts: list[dict[str, Any]] = [
        *USER,
        {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
    ]
    listing = "{% for m in messages %}{% for p in m.content %}{{ p.text }}|{% endfor %}{% endfor %}"
    assert render(listing, [parts[1]], continue_final_message=True) == "a"
    with pytest.raises(ChatTemplateError):
        render(source, messages, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError):  # the template drops the message
        render("{{ messages[0].content }}", messages, continue_final_message=True)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['content'] %}{% endfor %}{% endfor %}", "openai"),
        (
            "{% for message in x %}{% for p in message.content|reverse %}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for p in msg.content[1:] %}{% endfor %}", "openai"),
        ("{% for p in other.content %}{% endfor %}", "string"),
        ("{{ '<image>' }}", "openai"),  # a word is enough
        ("{% for %}", "string"),  # does not parse
    ],
)
def test_content_format_as_sglang_reads_it(source: str, expected: str) -> None:
    assert content_format(source) == expected


# ------------------------------------------------------------------ files and tokens


def test_special_tokens_from_a_config() -> None:
    config = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "pad_token": None,
        "image_token": "<image>",
        "marked_token": {"__type": "AddedToken", "content": "<m>"},
        "unmarked_token": {"content": "<u>"},  # transformers ignores an unmarked object
        "add_bos_token": True,
        "extra_special_tokens": {"video_token": "<video>"},
    }
    assert special_tokens(config) == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "marked_token": "<m>",
        "image_token": "<image>",
        "video_token": "<video>",
    }
    assert list(special_tokens(config))[2:4] == ["marked_token", "image_token"]


def test_templates_in_files_win_over_the_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "C"}))
    assert read_chat_templates(tmp_path) == "C"
    (tmp_path / "chat_template.jinja").write_text("J\n")
    assert read_chat_templates(tmp_path) == "J\n"
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("T")
    found = read_chat_templates(tmp_path)
    assert found == {"default": "J\n", "tool_use": "T"}
    assert pick_template(found, tools=[{}]) == "T"
    assert pick_template(found) == "J\n"
    with pytest.raises(ChatTemplateError):
        pick_template({"rag": "R"})
    assert read_chat_templates(tmp_path / "nowhere") is None


def make_model(
    directory: Path,
    template: Any = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}",
    bos_processor: bool = False,
    **config: Any,
) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["hello world once upon a time"] * 5, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "<|im_start|>")])
    if bos_processor:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos)]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": "<s>", "chat_template": template, **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def test_a_chat_template_file_is_read_as_sglang_reads_it(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    file = tmp_path / "t.jinja"
    file.write_text("\n\n[{{ messages[0].content }}]\\n{{ bos_token }}\n\n")
    tok = HFTokenizer(str(model), str(file))
    assert tok.template is not None
    assert tok.template.render(USER) == "[hi]\n<s>"  # newlines stripped, each \n literal a newline
    assert load_tokenizer(f"hf:{model}", str(file)).encode_chat(USER, None) == tok.encode_chat(
        USER, None
    )
    other = tmp_path / "t.txt"
    other.write_text("x")
    with pytest.raises(ValueError, match=r"\.jinja"):
        HFTokenizer(str(model), str(other))
    with pytest.raises(ValueError, match="hf:"):
        load_tokenizer("python:simulator.model.tokenizer:default_tokenizer", str(file))


def test_sglang_takes_the_first_named_template_or_the_one_asked_for(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    model = make_model(tmp_path, template=named)
    assert HFTokenizer(str(model)).render_chat(USER, [{"type": "function"}]) == "T"
    assert HFTokenizer(str(model), template_name="default").render_chat(USER) == "D"
    with pytest.raises(ValueError, match="rag"):
        HFTokenizer(str(model), template_name="rag")


def test_without_a_template_text_still_encodes(tmp_path: Path) -> None:
    model = make_model(tmp_path, template=None)
    tok = HFTokenizer(str(model))
    assert tok.encode("hello") and tok.template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat(USER, None)


def test_template_arguments_cannot_be_given_twice(tmp_path: Path) -> None:
    tok = HFTokenizer(str(make_model(tmp_path)))
    with pytest.raises(ValueError):
        tok.render_chat(USER, None, add_generation_prompt=False)


def test_a_failing_template_is_retried_with_bare_function_tools(tmp_path: Path) -> None:
    model = make_model(tmp_path, template="{% for t in tools %}{{ t.name.upper() }}{% endfor %}")
    tool = {"type": "function", "function": {"name": "get"}}
    assert HFTokenizer(str(model)).render_chat(USER, [tool]) == "GET"
    with pytest.raises(ValueError):
        HFTokenizer(str(model)).render_chat(USER, [{"type": "function"}])


def test_bos_is_not_doubled(tmp_path: Path) -> None:
    """A tokenizer that adds BOS to every text (even an empty one): the chat is encoded
    without it (the template writes its own), plain text with it."""
    model = make_model(
        tmp_path, template="{{ bos_token }}{{ messages[0].content }}", bos_processor=True
    )
    tok = HFTokenizer(str(model))
    bos = tok.chat_rules.bos_token_id
    assert bos is not None
    chat = tok.encode_chat(USER, None)
    assert chat[0] == bos and chat.count(bos) == 1
    assert tok.encode("hi")[0] == bos


def test_config_special_tokens_missing_from_the_vocabulary_are_added(tmp_path: Path) -> None:
    model = make_model(tmp_path, eos_token="<|end|>", split_special_tokens=False)
    tok = HFTokenizer(str(model))
    assert len(tok.encode("<|end|>")) == 1
    split = HFTokenizer(str(make_model(tmp_path / "split", split_special_tokens=True)))
    assert len(split.encode("<|im_start|>")) > 1


# ------------------------------------------------------------------ SGLang's preparation

RULES = ChatRules()
TOOL = {"type": "function", "function": {"description": "d", "name": "f", "strict": True}}


def prep(rules: ChatRules = RULES, **body: Any) -> SGLangChat:
    return sglang_chat({"messages": USER, **body}, rules)


def test_messages_are_dumped_as_sglang_models_dump_them() -> None:
    chat = prep(
        messages=[
            {"role": "System", "content": "s", "extra": 1},
            {"role": "user", "content": "u", "name": "ignored"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "r",
                "tool_calls": [{"function": {"name": "f", "arguments": '{"a": [1]}'}}],
            },
            {
                "role": "tool",
                "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
            },
            {"role": "user", "content": "again"},
        ]
    )
    assert chat.messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "r",
            "tool_calls": [
                {
                    "id": None,
                    "index": None,
                    "type": "function",
                    "function": {"name": "f", "arguments": {"a": [1]}},
                }
            ],
        },
        {"role": "tool", "content": "x y"},
        {"role": "user", "content": "again"},
    ]
    assert chat.tools is None and chat.template_kwargs == {} and chat.assistant_prefix is None


def test_content_lists_follow_the_template_format() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "x": 1}]
    messages = [
        {
            "role": "user",
            "content": parts,
        },
        {"role": "tool", "content": parts, "name": "t"},
    ]
    as_string = prep(messages=messages).messages
    assert as_string == [
        {"role": "user", "content": "a b"},
        {"role": "tool", "content": "a b", "name": "t"},
    ]
    as_parts = prep(ChatRules(content_format="openai"), messages=messages).messages
    assert as_parts[0] == {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert list(as_parts[1]) == ["role", "name", "content"] and as_parts[1]["content"] == "a b"
    with pytest.raises(ValueError):
        prep(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
            ]
        )


def test_tools_are_dumped_with_sglang_defaults_and_the_client_order() -> None:
    chat = prep(
        tools=[
            TOOL,
            {"function": {"parameters": {"type": "object"}, "name": "g"}, "defer_loading": True},
        ]
    )
    assert chat.tools == [
        {
            "type": "function",
            "function": {"description": "d", "name": "f", "strict": True, "parameters": None},
            "defer_loading": None,
        },
        {
            "type": "function",
            "function": {
                "parameters": {"type": "object"},
                "name": "g",
                "description": None,
                "defer_loading": True,
            },
            "defer_loading": True,
        },
    ]
    assert [list(t["function"]) for t in chat.tools] == [
        ["description", "name", "strict", "parameters"],
        ["parameters", "name", "description", "defer_loading"],
    ]


def test_tool_choice_decides_which_tools_reach_the_template() -> None:
    assert prep(tools=[TOOL], tool_choice="none").tools is None
    assert prep(tools=[TOOL], tool_choice="required").tools is not None
    second = {"type": "function", "function": {"name": "g"}}
    named = prep(tools=[TOOL, second], tool_choice={"type": "function", "function": {"name": "g"}})
    assert [t["function"]["name"] for t in named.tools or []] == ["g"]
    with pytest.raises(ValueError):
        prep(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError):
        prep(tool_choice="required")
    hosted = [{"role": "system", "content": "s", "tools": [TOOL]}, *USER]
    only_hosted = prep(messages=hosted)  # tool_choice defaults to auto, no request tools
    assert (
        only_hosted.tools is None and only_hosted.messages[0]["tools"][0]["function"]["name"] == "f"
    )
    with pytest.raises(ValueError):  # unique names across request and message tools
        prep(messages=hosted, tools=[TOOL])
    with pytest.raises(ValueError):  # SGLang would rewrite "varchar" to "string"
        prep(
            tools=[
                {
                    "function": {
                        "name": "v",
                        "parameters": {"type": "object", "properties": {"c": {"type": "varchar"}}},
                    }
                }
            ]
        )


def test_the_final_assistant_message() -> None:
    messages = [*USER, {"role": "assistant", "content": "Once", "name": "a"}]
    assert prep(messages=messages).messages[-1] == {"role": "user", "content": "Once"}
    continued = prep(messages=messages, continue_final_message=True)
    assert continued.messages == USER and continued.assistant_prefix == "Once"
    listed = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]
    assert (
        prep(ChatRules(content_format="openai"), messages=listed).messages[-1]["role"]
        == "assistant"
    )


def test_reasoning_and_template_kwargs() -> None:
    assert prep(reasoning_effort="high").template_kwargs == {
        "reasoning_effort": "high",
        "thinking": True,
        "enable_thinking": True,
    }
    assert prep(reasoning={"effort": "none"}).template_kwargs == {
        "reasoning_effort": "none",
        "thinking": False,
        "enable_thinking": False,
    }
    assert prep(reasoning={"enabled": "yes"}).template_kwargs == {
        "thinking": True,
        "enable_thinking": True,
    }
    assert prep(reasoning_effort=0).template_kwargs["reasoning_effort"] == 0.0
    kwargs = prep(
        chat_template_kwargs={"enable_thinking": False, "documents": []}, reasoning_effort="low"
    )
    assert kwargs.template_kwargs == {
        "reasoning_effort": "low",
        "enable_thinking": False,
        "documents": [],
        "thinking": True,
    }
    defaults = ChatRules(
        default_chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "max", "x": 1}
    )
    assert prep(defaults, chat_template_kwargs={"x": 2}).template_kwargs == {
        "reasoning_effort": "max",
        "x": 2,
        "enable_thinking": False,
    }
    for refused in ({"chat_template": "x"}, {"tokenize": True}, {"continue_final_message": True}):
        with pytest.raises(ValueError):
            prep(chat_template_kwargs=refused)
    assert prep(chat_template_kwargs={"padding": True}).template_kwargs == {}
    for bad in (True, "0.5", 2.0):
        with pytest.raises(ValueError):
            prep(reasoning_effort=bad)


def called(arguments: str) -> dict[str, Any]:
    call = {"function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "USER", "content": "x"}]},
        {"messages": [{"role": "user"}]},
        {"messages": [called("{bad"), *USER]},
        {"messages": [called("[1]"), *USER]},
        {"messages": USER, "continue_final_message": "yes"},
        {"messages": USER, "tool_choice": "sometimes"},
    ],
)
def test_what_sglang_refuses_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        sglang_chat(body, RULES)


def test_input_ids_are_taken_as_given() -> None:
    assert prep(input_ids=[5, 6]).input_ids == [5, 6]
    with pytest.raises(ValueError):
        prep(input_ids=[True])


# ------------------------------------------------------------------ request_tokens


class Recorder:
    """A tokenizer with ``chat_rules`` that records what the template would get."""

    chat_rules = ChatRules(bos_token_id=1)

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, dict[str, Any]]] = []

    def encode_chat(self, messages: Any, tools: Any, **kwargs: Any) -> list[int]:
        self.calls.append((messages, tools, kwargs))
        return [7]

    def encode(self, text: str) -> list[int]:
        return [1, len(text)]


def test_request_tokens_prepares_chats_for_template_tokenizers() -> None:
    tok = Recorder()
    body = {
        "messages": [*USER, {"role": "assistant", "content": "abc"}],
        "continue_final_message": True,
    }
    ids, _ = request_tokens("chat", orjson.dumps(body), tok)
    assert ids == [7, 3]  # the prefix encoded, its BOS dropped
    assert tok.calls == [(USER, None, {})]
    ids, _ = request_tokens(
        "chat", orjson.dumps({"messages": USER, "reasoning_effort": "none"}), tok
    )
    assert tok.calls[-1][2] == {
        "reasoning_effort": "none",
        "thinking": False,
        "enable_thinking": False,
    }
    assert request_tokens("chat", orjson.dumps({"messages": USER, "input_ids": [9]}), tok)[0] == [9]
    refused = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert request_tokens("chat", orjson.dumps(refused), tok)[0] is None


class Plain:
    """A python: tokenizer without chat_rules: gets the request's messages as sent."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.seen: list[Any] = []

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        **template_kwargs: Any,
    ) -> list[int]:
        if template_kwargs:  # as a python: tokenizer whose encode_chat takes none would fail
            raise TypeError(f"unexpected template kwargs: {sorted(template_kwargs)}")
        if self.error is not None:
            raise self.error
        self.seen.append((messages, tools))
        return [1]

    def encode(self, text: str) -> list[int]:
        return [2]


def test_python_tokenizers_get_the_messages_as_sent_and_their_errors_are_caught() -> None:
    tok = Plain()
    body = {"messages": [{"role": "assistant", "content": None, "x": 1}], "tools": [TOOL]}
    assert request_tokens("chat", orjson.dumps(body), tok)[0] == [1]
    assert tok.seen == [(body["messages"], body["tools"])]
    for error in (jinja2.TemplateError("refused"), KeyError("k"), ValueError("v")):
        assert request_tokens("chat", orjson.dumps(body), Plain(error)) == (
            None,
            (None, None, None),
        )
