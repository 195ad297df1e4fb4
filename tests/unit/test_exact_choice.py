"""Which tokenizer a worker's prompts get (``gateway.exact.choice``) and the ``kv_events``
settings that choose it: ``enabled: auto|true|false``, per-model tokenizers, the CLI."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import parse_config
from gateway.config import ConfigError, config_from_dict
from gateway.exact.choice import NO_TOKENIZER, TokenizerChoice, load_choice
from loadtests.harness.inprocess import SIM_TOKENIZER


class _Tok:
    def __init__(self, name: str) -> None:
        self.name = name

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        **template_kwargs: Any,
    ) -> list[int]:
        return []

    def encode(self, text: str) -> list[int]:
        return []


def test_per_model_then_default_then_the_reason() -> None:
    llama, qwen, default = _Tok("llama"), _Tok("qwen"), _Tok("default")
    choice = TokenizerChoice(default, {"llama-3": llama, "qwen": qwen}, {"broken": "why"})
    assert choice.for_models({"llama-3", "/models/llama"}) == (llama, None)
    assert choice.for_models({"/models/qwen", "qwen"}) == (qwen, None)
    assert choice.for_models({"broken"}) == (None, "why")  # never the default's ids
    assert choice.for_models({"other"}) == (default, None)
    assert choice.for_models(()) == (default, None)
    assert TokenizerChoice(None, {"llama-3": llama}).for_models({"x"}) == (None, NO_TOKENIZER)
    assert TokenizerChoice(problems={"": "bad dir"}).for_models({"x"}) == (None, "bad dir")


def test_enabled_is_auto_by_default_and_reads_yaml_booleans() -> None:
    assert config_from_dict({}).kv_events.enabled == "auto"
    for given, read in ((True, "true"), (False, "false"), ("auto", "auto")):
        cfg = config_from_dict({"kv_events": {"enabled": given, "tokenizer": SIM_TOKENIZER}})
        assert cfg.kv_events.enabled == read
    for bad in ({"enabled": "maybe"}, {"enabled": 1}, {"enabled": True},  # no tokenizer
                {"tokenizers": {"m": "gpt2"}}, {"tokenizers": {"m": 3}},
                {"chat_template": "/no/such/file.jinja", "tokenizer": "hf:/x"}):  # fmt: skip
        with pytest.raises(ConfigError, match="kv_events"):
            config_from_dict({"kv_events": bad})
    # per-model tokenizers alone satisfy `true`
    cfg = config_from_dict({"kv_events": {"enabled": True, "tokenizers": {"m": SIM_TOKENIZER}}})
    assert dict(cfg.kv_events.tokenizers) == {"m": SIM_TOKENIZER}


def test_cli_flags(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    kv_events = parse_config(["--kv-events", "off"]).kv_events
    assert kv_events.enabled == "false"
    cfg = parse_config(["--tokenizer-path", "/m/llama", "--chat-template", str(template)])
    assert cfg.kv_events.tokenizer == "hf:/m/llama" and cfg.kv_events.chat_template == str(template)
    assert cfg.kv_events.enabled == "auto"  # auto: an unloadable tokenizer is not refused
    with pytest.raises(ConfigError, match=r"--kv-events"):
        parse_config(["--kv-events", "sometimes"])
    with pytest.raises(ConfigError, match=r"could not be loaded"):
        parse_config(["--kv-events", "yes", "--tokenizer-path", str(tmp_path / "none")])


def test_load_choice_strict_or_lenient(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = f"hf:{tmp_path / 'missing'}"
    cfg = config_from_dict(
        {"kv_events": {"tokenizer": SIM_TOKENIZER, "tokenizers": {"qwen": bad}}}
    ).kv_events
    with caplog.at_level(logging.WARNING, logger="gateway.exact.choice"):
        choice = load_choice(cfg)
    assert choice.default is not None and "qwen" in choice.problems
    assert "kv_events.tokenizers.qwen" in caplog.text
    tok, why = choice.for_models({"qwen"})
    assert tok is None and why is not None and "could not be loaded" in why
    strict = config_from_dict(
        {"kv_events": {"enabled": True, "tokenizer": SIM_TOKENIZER, "tokenizers": {"qwen": bad}}}
    ).kv_events
    with pytest.raises(ConfigError, match=r"kv_events\.tokenizers\.qwen"):
        load_choice(strict)
