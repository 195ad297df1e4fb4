"""The generated model: deterministic in its seed, and the shape the engine tests assume."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="needs the engine extra: pip install -e '.[engine]'")

import gguf

from loadtests.engine.tiny_model import IM_END_ID, SPACE, build_vocab, write_tiny_model

pytestmark = pytest.mark.e2e


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", seed=3)
    b = write_tiny_model(tmp_path / "b.gguf", seed=3)
    c = write_tiny_model(tmp_path / "c.gguf", seed=4)
    assert digest(a) == digest(b) != digest(c)
    assert 25e6 < a.stat().st_size < 35e6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]


def test_metadata_and_tensors(tmp_path: Path) -> None:
    reader = gguf.GGUFReader(write_tiny_model(tmp_path / "m.gguf"))
    fields = reader.fields

    def scalar(key: str) -> object:
        return fields[key].contents()

    assert scalar("general.architecture") == "llama"
    assert scalar("llama.block_count") == 4
    assert scalar("llama.embedding_length") == 512
    assert scalar("llama.feed_forward_length") == 1536
    assert scalar("llama.attention.head_count") == 8
    assert scalar("tokenizer.ggml.model") == "llama"
    assert scalar("tokenizer.ggml.eos_token_id") == IM_END_ID
    assert "<|im_start|>" in str(scalar("tokenizer.chat_template"))
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert q.tensor_type == gguf.GGMLQuantizationType.F16
    assert 0.015 < float(q.data.astype("float32").std()) < 0.025


def test_vocabulary() -> None:
    vocab = build_vocab()
    assert vocab.tokens[:5] == ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    assert vocab.tokens[5:261] == [f"<0x{b:02X}>" for b in range(256)]
    assert len(set(vocab.tokens)) == len(vocab.tokens)
    assert {SPACE + "the", SPACE + "th", SPACE + "bak", "a", "~"} <= set(vocab.tokens)
    assert len(vocab.tokens) == len(vocab.scores) == len(vocab.types)
