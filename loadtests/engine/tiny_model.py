"""Write a tiny random-weights Llama-architecture GGUF, with its own tokenizer.

The model gives real prefill and decode compute and real KV-cache reuse in llama.cpp;
its text is gibberish (use temperature 0). Shape: 4 layers, hidden 512, FFN 1536,
8 heads, matrices drawn from N(0, 0.02), norm weights 1, output projection tied to the
token embeddings, F16 (about 30 MB).

The tokenizer is a self-contained SentencePiece-style ("llama") vocabulary stored in
the GGUF metadata: ``<unk> <s> </s> <|im_start|> <|im_end|>``, 256 ``<0xXX>``
byte-fallback tokens, printable ASCII, a few hundred English word pieces and the 1,280
consonant-vowel-consonant syllables of the project's pseudo-text. llama.cpp's SPM
tokenizer merges adjacent symbols only when the merged string is itself a token, so
every word piece comes with all of its prefixes (``▁t``, ``▁th``, ``▁the``). A ChatML
chat template is embedded and ``<|im_end|>`` is the end-of-sequence token.

Contract: the output depends only on the seed (and this module's version): the same
seed writes a byte-identical file. Writing is atomic (temp file, then rename), so
concurrent builders of the same path do not see a half-written model.

CLI: ``python -m loadtests.engine.tiny_model --out PATH [--seed S]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from loadtests.engine.workload import CODAS, ONSETS, VOWELS

# Bump when the written bytes change for a given seed: cache file names include it.
MODEL_VERSION = 2
DEFAULT_SEED = 0
SPACE = "\u2581"  # SentencePiece's visible space

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK_ID, BOS_ID, EOS_ID_PLAIN, IM_START_ID, IM_END_ID = range(5)

# Common English words and suffixes: enough to bring English-like text to ~2-3 chars/token.
_WORD_TEXT = """
the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there one all we their has been if more when will would
who so no out up into do any time only new some could these two may first then than like
other over such our also use made after many before must through back years where much
your way well down should because each just those people how too little state good very
make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right
used take three system data model request worker cache token prefix server policy route
load user session query answer document context memory latency throughput batch queue
prompt response stream client service network value number result table report language
question information process example number point group problem fact hand part place case
week company government program thing every might next around however home small large
order water room area money story month lot study book eye job word business issue side
kind head house friend father power hour game line end member law car city community name
president team minute idea kid body back parent face others level office door health
person art war history party within result change morning reason research girl guy moment
air teacher force education foot boy age policy everything process music market sense
nation plan college interest death experience effect class control care field development
role effort rate heart drug show leader light voice wife police mind price report decision
son view relationship town road arm difference value building action model season society
tax director position player record paper space ground form event official matter center
couple site project activity star table need court oil situation cost industry figure
street image phone data picture practice piece land product doctor wall patient worker news
test movie north love support technology step baby computer type attention film tree source
organization hair window evidence population site training surface analysis section
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
# Consonant-vowel-consonant syllables (ONSETS x VOWELS x CODAS): the project's
# pseudo-text workloads are made of `` bak``-like pieces meant to be one token each; with
# these in the vocabulary they are one token each to the real engine too.
SUFFIXES: tuple[str, ...] = (
    "ing", "ed", "er", "ers", "es", "ly", "tion", "tions", "ment", "ness", "al", "ity",
    "able", "ive", "ous", "est", "ful", "less", "ize", "ized",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Hyperparameters of the generated model."""

    n_layers: int = 4
    n_embd: int = 512
    n_ff: int = 1536
    n_head: int = 8
    context_length: int = 32768
    init_std: float = 0.02


@dataclass(frozen=True, slots=True)
class Vocab:
    """A SentencePiece-style vocabulary: parallel lists of pieces, scores and types."""

    tokens: list[str]
    scores: list[float]
    types: list[int]


def _with_prefixes(piece: str, min_len: int) -> list[str]:
    return [piece[:n] for n in range(min_len, len(piece) + 1)]


def build_vocab() -> Vocab:
    """The fixed vocabulary: specials, byte fallback, printable ASCII, word pieces.

    Scores favour longer pieces, so SPM's highest-score-first merging builds whole
    words when it can. Ids 0..4 are the special tokens in ``SPECIAL_TOKENS`` order.
    """
    tokens: list[str] = list(SPECIAL_TOKENS)
    scores: list[float] = [0.0] * len(tokens)
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * (len(tokens) - 1)
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        scores.append(0.0)
        types.append(gguf.TokenType.BYTE)
    seen = set(tokens)
    chars = [SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    pieces: list[str] = []
    for word in sorted(set(WORDS)):
        pieces.extend(_with_prefixes(SPACE + word, 2))
    for syllable in (o + v + c for o in ONSETS for v in VOWELS for c in CODAS):
        pieces.extend(_with_prefixes(SPACE + syllable, 2))
    for suffix in SUFFIXES:
        pieces.extend(_with_prefixes(suffix, 2))
    for piece in chars + pieces:
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        scores.append(float(len(piece)) - len(tokens) * 1e-4)
        types.append(gguf.TokenType.NORMAL)
    return Vocab(tokens=tokens, scores=scores, types=[int(t) for t in types])


def _add_metadata(writer: gguf.GGUFWriter, shape: ModelShape, vocab: Vocab) -> None:
    writer.add_name("prefix-gateway tiny random llama")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(IM_END_ID)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def _tensor_shapes(shape: ModelShape, n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names with numpy shapes (rows = output features)."""
    d, f = shape.n_embd, shape.n_ff
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, d))]
    for i in range(shape.n_layers):
        b = f"blk.{i}"
        out += [
            (f"{b}.attn_norm.weight", (d,)),
            (f"{b}.attn_q.weight", (d, d)),
            (f"{b}.attn_k.weight", (d, d)),
            (f"{b}.attn_v.weight", (d, d)),
            (f"{b}.attn_output.weight", (d, d)),
            (f"{b}.ffn_norm.weight", (d,)),
            (f"{b}.ffn_gate.weight", (f, d)),
            (f"{b}.ffn_up.weight", (f, d)),
            (f"{b}.ffn_down.weight", (d, f)),
        ]
    # No output.weight: llama.cpp ties the output projection to token_embd when absent.
    out.append(("output_norm.weight", (d,)))
    return out


def _add_tensors(
    writer: gguf.GGUFWriter, shape: ModelShape, n_vocab: int, rng: np.random.Generator
) -> None:
    """Matrices N(0, init_std) in F16; 1-D norm weights are ones in F32 (as llama.cpp expects)."""
    for name, dims in _tensor_shapes(shape, n_vocab):
        if len(dims) == 1:
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
            continue
        values = rng.standard_normal(dims, dtype=np.float32) * np.float32(shape.init_std)
        writer.add_tensor(name, values.astype(np.float16))


def write_tiny_model(out: Path, seed: int = DEFAULT_SEED, shape: ModelShape | None = None) -> Path:
    """Write the model to ``out`` atomically and return ``out``. Deterministic in ``seed``."""
    shape = shape or ModelShape()
    vocab = build_vocab()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp_name, "llama")
        _add_metadata(writer, shape, vocab)
        _add_tensors(writer, shape, len(vocab.tokens), np.random.default_rng(seed))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, out)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return out


def default_cache_dir() -> Path:
    """``$PREFIX_GATEWAY_CACHE`` if set, else ``.cache/`` under the current directory."""
    return Path(os.environ.get("PREFIX_GATEWAY_CACHE", ".cache"))


def ensure_tiny_model(cache_dir: Path | None = None, seed: int = DEFAULT_SEED) -> Path:
    """Return the cached model for ``seed``, writing it first if it is absent."""
    directory = cache_dir if cache_dir is not None else default_cache_dir()
    path = directory / f"tiny-llama-v{MODEL_VERSION}-seed{seed}.gguf"
    if not path.exists():
        write_tiny_model(path, seed)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point: write the model and print its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="where to write the .gguf")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weights seed")
    args = parser.parse_args(argv)
    print(write_tiny_model(args.out, args.seed))


if __name__ == "__main__":
    main()
