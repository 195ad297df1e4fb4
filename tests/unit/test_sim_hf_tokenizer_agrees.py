"""The simulated worker's chat path (``simulator.model.hf_tokenizer``, through
``transformers``) and the gateway's (``gateway.exact``) give the same ids on the cases the
simulator claims: a continued final assistant message whatever its content's shape, a
capitalised role with tool calls, and a ``--chat-template`` file read as SGLang reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.exact.request import request_tokens
from gateway.exact.tokenizer import load_tokenizer
from loadtests.engine.sglang_model import write_tokenizer

pytest.importorskip("transformers")
from simulator.model.hf_tokenizer import HFWorkerTokenizer

TEMPLATE = (
    "\n{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}\n"
)
CASES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "hi there"}]},
    "continued parts": {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Sure, "}]},
        ],
        "continue_final_message": True,
    },
    "continued null": {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
        "continue_final_message": True,
    },
    "capitalised role": {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "Assistant",
                "content": None,
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "user", "content": "ok"},
        ]
    },
}


@pytest.mark.parametrize("with_file", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_simulator_and_the_gateway_agree(tmp_path: Path, case: str, with_file: bool) -> None:
    write_tokenizer(tmp_path)
    template = None
    if with_file:
        (tmp_path / "t.jinja").write_text(TEMPLATE)
        template = str(tmp_path / "t.jinja")
    gateway = load_tokenizer(f"hf:{tmp_path}", template)
    worker = HFWorkerTokenizer(str(tmp_path), template)
    ids, _ = request_tokens("chat", orjson.dumps(CASES[case]), gateway)
    assert ids is not None
    assert ids == worker.encode_chat_request(CASES[case])


def test_a_template_file_that_is_not_jinja_is_refused(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    (tmp_path / "t.json").write_text("{}")
    with pytest.raises(ValueError, match="jinja"):
        HFWorkerTokenizer(str(tmp_path), str(tmp_path / "t.json"))
