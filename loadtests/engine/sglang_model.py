"""Write a tiny random-weights Llama as a Hugging Face model directory, for real SGLang.

The directory holds what ``sglang.launch_server --model-path DIR`` and the gateway's
``--kv-events-tokenizer hf:DIR`` read, all written here, nothing downloaded:

* ``config.json`` and ``model.safetensors``: ``transformers.LlamaConfig`` (4 layers,
  hidden 256, FFN 768, 4 heads of 64, ``max_position_embeddings`` 32,768, embeddings
  tied) with random weights (``LlamaForCausalLM`` initialised under a fixed seed), saved
  in bfloat16 (about 5 MB). Text is gibberish: use ``temperature: 0``.
* ``tokenizer.json``: a byte-level BPE trained here (``tokenizers``) on a fixed corpus:
  the project's consonant-vowel-consonant pseudo-text syllables (``" bak"``, one token
  each once trained) and the English words of :mod:`loadtests.engine.tiny_model`.
  Specials: ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2, EOS).
* ``tokenizer_config.json`` with a ChatML ``chat_template`` (the one the llama.cpp tiny
  model embeds), ``generation_config.json``.

Two halves, so each runs where its packages are: :func:`write_tokenizer` needs only
``tokenizers`` (the project's ``exact`` extra); :func:`write_weights` needs ``torch`` and
``transformers`` and runs in SGLang's own venv (:mod:`loadtests.engine.sglang_install`).
:func:`ensure_sglang_model` writes the tokenizer here and asks SGLang's venv for the
weights.

Contract: the output depends only on the seed (and :data:`MODEL_VERSION`): the same seed
writes the same tokenizer and weights; the directory appears atomically (built in a
temporary sibling, then renamed), so concurrent builders never see half a model.

CLI (SGLang's venv python, run from the repository root)::

    python -m loadtests.engine.sglang_model --out DIR [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtests.engine.workload import SYLLABLES

# Bump when the written files change for a given seed: cache directory names include it.
MODEL_VERSION = 1
DEFAULT_SEED = 0
SERVED_MODEL_NAME = "tiny-llama-hf"

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = range(3)
VOCAB_SIZE = 3072

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class HFModelShape:
    """Hyperparameters of the generated model (``transformers.LlamaConfig`` fields)."""

    num_hidden_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def training_corpus(seed: int) -> list[str]:
    """The BPE training text: every syllable 40 times in seeded order, then the words.

    Each syllable is far more frequent than any pair of them could be (the byte-level
    pre-tokenizer splits at spaces, so merges never cross a syllable), so the trained
    vocabulary holds all of them as single tokens.
    """
    rng = random.Random(f"sglang-tokenizer:{seed}")
    syllables = list(SYLLABLES) * 40
    rng.shuffle(syllables)
    lines = ["".join(syllables[i : i + 64]) for i in range(0, len(syllables), 64)]
    from loadtests.engine.tiny_model import WORDS  # imports gguf: only where it is installed

    words = list(WORDS)
    lines += [" " + " ".join(words)] * 20
    lines += [" ".join(str(n) for n in range(100)), "{}[]().,;:!?'\"-_/\\<>=+*&%$#@~`|^\n\t"]
    return lines


def build_tokenizer(seed: int = DEFAULT_SEED) -> Any:
    """A trained byte-level BPE ``tokenizers.Tokenizer`` (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    return tok


def write_tokenizer(directory: Path, seed: int = DEFAULT_SEED) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``."""
    tok = build_tokenizer(seed)
    tok.save(str(directory / "tokenizer.json"))
    specials = {
        str(i): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": specials,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": HFModelShape().max_position_embeddings,
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_weights(
    directory: Path, seed: int = DEFAULT_SEED, shape: HFModelShape | None = None
) -> None:
    """Write ``config.json`` and ``model.safetensors`` (needs torch and transformers).

    The vocabulary size is read from ``directory/tokenizer.json`` (write it first).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = shape or HFModelShape()
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    n_vocab = len(vocab)
    config = LlamaConfig(
        vocab_size=n_vocab,
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        **asdict(shape),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(directory), safe_serialization=True)


def write_model(out: Path, seed: int = DEFAULT_SEED) -> Path:
    """Write the whole model directory at ``out`` (atomically); needs torch/transformers."""

    def fill(directory: Path) -> None:
        write_tokenizer(directory, seed)
        write_weights(directory, seed)

    return _atomic_dir(out, fill)


def _atomic_dir(out: Path, fill: Callable[[Path], None]) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(out)
        except OSError:  # another builder won the race: theirs is identical
            if not (out / "model.safetensors").exists():
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def model_dir_name(seed: int = DEFAULT_SEED) -> str:
    """The cache directory name of the model for ``seed``."""
    return f"tiny-llama-hf-v{MODEL_VERSION}-seed{seed}"


def ensure_sglang_model(cache_dir: Path, python: Path, seed: int = DEFAULT_SEED) -> Path:
    """Return ``cache_dir/<model_dir_name>``, writing it first with ``python`` (an
    interpreter that has torch and transformers: SGLang's venv) if it is absent."""
    out = cache_dir / model_dir_name(seed)
    if (out / "model.safetensors").exists():
        return out
    repo_root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo_root), "TOKENIZERS_PARALLELISM": "false"}
    module = "loadtests.engine.sglang_model"
    subprocess.run(
        [str(python), "-m", module, "--out", str(out), "--seed", str(seed)],
        check=True,
        cwd=repo_root,
        env=env,
        timeout=600,
    )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point: write the model directory and print its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weights seed")
    args = parser.parse_args(argv)
    if (args.out / "model.safetensors").exists():
        print(args.out)
        return
    print(write_model(args.out, args.seed))


if __name__ == "__main__":
    main()
