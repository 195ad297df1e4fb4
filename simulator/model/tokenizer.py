"""A deterministic, offline tokenizer for the simulated worker, with a ChatML template.

Real model tokenizers cannot be downloaded here, and the simulator does not need real
merges: it needs token counts that look like a real model's (≈ 4 characters per token on
English text), exact and cheap encode/decode, and the property that matters for prefix
caching: the rendered chat prompt of turn k is a token prefix of turn k+1's.

The scheme is arithmetic, so no vocabulary file is shipped:

1. Special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; ids 151643-151645,
   as in Qwen's ChatML vocabulary) are split out first; text between them is tokenized
   independently, so nothing merges across a message boundary.
2. The rest is pre-tokenized like GPT-2: ``" ?[A-Za-z]+"``, ``" ?[0-9]{1,3}"``,
   ``" ?<one other char>"``, ``"<one whitespace char>"``.
3. A letter run is cut greedily into chunks of at most 5 letters, each all-lowercase,
   Capitalized or UPPERCASE (``"Tokenization"`` → ``"Token" "izati" "on"``); a leading space
   rides on the first chunk. A chunk's id encodes (space, case, letters) in base 26.
   Digits: up to three per token. Anything else: one token per UTF-8 byte (ids 0-255), or
   one token for an ASCII punctuation character with a leading space.

The id space is sparse (letters use ids up to ≈ 74 million), so the tokenizer cannot be
exported as a ``tokenizer.json`` vocabulary; the gateway can import this module instead
(pure Python, no dependencies).

Output text for generated tokens comes from a fixed ring of pseudo-English tokens
(:meth:`SimTokenizer.pseudo_output_ids`): deterministic for a given seed and prompt,
cheap (a slice), and re-tokenizing its text gives back the same ids, so a multi-turn
conversation hits the cache through the previous assistant reply, as on a real server.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import orjson

ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
SPECIAL_TOKENS: Mapping[str, int] = {
    "<|endoftext|>": ENDOFTEXT_ID,
    "<|im_start|>": IM_START_ID,
    "<|im_end|>": IM_END_ID,
}
_SPECIAL_BY_ID = {v: k for k, v in SPECIAL_TOKENS.items()}

_SPACE_PUNCT_BASE = 256  # 256 + byte: " <ASCII punctuation>"
_DIGIT_BASE = 512  # 512 + space * 1110 + offset(len) + value
_DIGITS_PER_SPACE = 1110
_LETTER_BASE = 200_000
_MAX_CHUNK = 5
_LETTER_OFFSETS = [0]
for _length in range(1, _MAX_CHUNK + 1):
    _LETTER_OFFSETS.append(_LETTER_OFFSETS[-1] + 26**_length)
_LETTERS_PER_VARIANT = _LETTER_OFFSETS[-1]  # 12,356,630 chunks of 1..5 letters
_CASE_LOWER, _CASE_CAPITAL, _CASE_UPPER = 0, 1, 2
VOCAB_SIZE = _LETTER_BASE + 6 * _LETTERS_PER_VARIANT

_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_PIECE = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]|\s")
_ASCII_PUNCT = (
    frozenset(range(33, 127))
    - frozenset(b"0123456789")
    - frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
)


def _letter_chunk_id(chunk: str, space: bool) -> int:
    if chunk.islower():
        case = _CASE_LOWER
    elif chunk.isupper() and len(chunk) > 1:
        case = _CASE_UPPER
    else:
        case = _CASE_CAPITAL
    value = 0
    for ch in chunk.lower():
        value = value * 26 + (ord(ch) - 97)
    variant = (2 * case + space) * _LETTERS_PER_VARIANT
    return _LETTER_BASE + variant + _LETTER_OFFSETS[len(chunk) - 1] + value


def _chunk_fits(chunk: str) -> bool:
    return (
        chunk.islower()
        or chunk.isupper()
        or (chunk[0].isupper() and (len(chunk) == 1 or chunk[1:].islower()))
    )


@functools.lru_cache(maxsize=200_000)
def _encode_piece(piece: str) -> tuple[int, ...]:
    """Token ids of one pre-tokenized piece (memoized: words repeat)."""
    space = piece[0] == " " and len(piece) > 1
    body = piece[1:] if space else piece
    first = body[0]
    if first.isascii() and first.isalpha():
        ids: list[int] = []
        i, n = 0, len(body)
        while i < n:
            for length in range(min(_MAX_CHUNK, n - i), 0, -1):
                chunk = body[i : i + length]
                if _chunk_fits(chunk):
                    break
            ids.append(_letter_chunk_id(chunk, space and i == 0))
            i += length
        return tuple(ids)
    if first.isascii() and first.isdigit():
        offset = (0, 10, 110)[len(body) - 1]
        return (_DIGIT_BASE + space * _DIGITS_PER_SPACE + offset + int(body),)
    raw = body.encode("utf-8")
    if space:
        if len(raw) == 1 and raw[0] in _ASCII_PUNCT:
            return (_SPACE_PUNCT_BASE + raw[0],)
        return (32, *raw)
    return tuple(raw)


@functools.lru_cache(maxsize=200_000)
def _token_bytes(token_id: int) -> bytes:
    """UTF-8 bytes of one token (special tokens excluded)."""
    if token_id < 0:
        return b""
    if token_id < 256:
        return bytes((token_id,))
    if token_id < _DIGIT_BASE:
        return b" " + bytes((token_id - _SPACE_PUNCT_BASE,))
    if token_id < _DIGIT_BASE + 2 * _DIGITS_PER_SPACE:
        rel = token_id - _DIGIT_BASE
        space, rel = divmod(rel, _DIGITS_PER_SPACE)
        if rel < 10:
            text = str(rel)
        elif rel < 110:
            text = f"{rel - 10:02d}"
        else:
            text = f"{rel - 110:03d}"
        return (" " + text if space else text).encode()
    if _LETTER_BASE <= token_id < VOCAB_SIZE:
        rel = token_id - _LETTER_BASE
        variant, rel = divmod(rel, _LETTERS_PER_VARIANT)
        case, space = divmod(variant, 2)
        length = 1
        while rel >= _LETTER_OFFSETS[length]:
            length += 1
        value = rel - _LETTER_OFFSETS[length - 1]
        letters = []
        for _ in range(length):
            value, digit = divmod(value, 26)
            letters.append(chr(97 + digit))
        word = "".join(reversed(letters))
        if case == _CASE_UPPER:
            word = word.upper()
        elif case == _CASE_CAPITAL:
            word = word.capitalize()
        return (" " + word if space else word).encode()
    return b""  # unused id: decodes to nothing


class SimTokenizer:
    """Encode, decode, the ChatML template and pseudo-text output (see module docstring)."""

    eos_token_id = IM_END_ID
    vocab_size = VOCAB_SIZE

    def __init__(self, ring_tokens: int = 65_536, ring_seed: int = 20_240_601) -> None:
        self._ring_ids = self._build_ring(ring_tokens, ring_seed)
        self._ring_text = [self.id_to_piece(t) for t in self._ring_ids]

    # ------------------------------------------------------------------ encode/decode
    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, segment in enumerate(_SPECIAL_SPLIT.split(text)):
            if i % 2:
                ids.append(SPECIAL_TOKENS[segment])
            elif segment:
                for piece in _PIECE.findall(segment):
                    ids.extend(_encode_piece(piece))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        parts: list[bytes] = []
        for token_id in ids:
            special = _SPECIAL_BY_ID.get(token_id)
            if special is not None:
                if not skip_special_tokens:
                    parts.append(special.encode())
                continue
            parts.append(_token_bytes(token_id))
        return b"".join(parts).decode("utf-8", errors="replace")

    def id_to_piece(self, token_id: int) -> str:
        special = _SPECIAL_BY_ID.get(token_id)
        if special is not None:
            return special
        return _token_bytes(token_id).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """ChatML, append-only: each message renders independently of later ones (no
        template variables: ``template_kwargs`` are accepted and ignored)."""
        parts: list[str] = []
        rest = list(messages)
        if tools:
            system = ""
            if rest and rest[0].get("role") == "system":
                system = _content_text(rest.pop(0).get("content"))
            tool_lines = "\n".join(
                orjson.dumps(t, option=orjson.OPT_SORT_KEYS).decode() for t in tools
            )
            system = (system + "\n\n" if system else "") + (
                f"# Tools\n\nYou may call one or more functions.\n<tools>\n{tool_lines}\n</tools>"
            )
            parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
        for message in rest:
            role = str(message.get("role", "user"))
            content = _content_text(message.get("content"))
            for call in message.get("tool_calls") or ():
                function = call.get("function", call) if isinstance(call, Mapping) else {}
                arguments = function.get("arguments", {})
                if isinstance(arguments, str):
                    with contextlib.suppress(orjson.JSONDecodeError):
                        arguments = orjson.loads(arguments)
                rendered = orjson.dumps(
                    {"name": function.get("name"), "arguments": arguments},
                    option=orjson.OPT_SORT_KEYS,
                ).decode()
                content += f"\n<tool_call>\n{rendered}\n</tool_call>"
            parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt))

    def encode_chat_request(self, body: Mapping[str, Any]) -> list[int]:
        """A chat request's prompt: its ``messages`` and ``tools`` in ChatML."""
        tools = body.get("tools")
        return self.encode_chat(body["messages"], tools if isinstance(tools, list) else None)

    # ------------------------------------------------------------------ output text
    def pseudo_output_ids(self, seed: int, n: int) -> list[int]:
        """``n`` deterministic pseudo-English tokens for a request whose hash is ``seed``."""
        ring = self._ring_ids
        size = len(ring)
        start = seed % size
        if start + n <= size:
            return ring[start : start + n]
        out: list[int] = []
        while len(out) < n:
            take = min(n - len(out), size - start)
            out.extend(ring[start : start + take])
            start = 0
        return out

    @staticmethod
    def _build_ring(n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        words = _pseudo_words(rng)
        parts: list[str] = []
        chars = 0
        sentence_in_paragraph = 0
        while chars < 5 * n:
            length = rng.randint(6, 18)
            picked = [rng.choice(words) for _ in range(length)]
            picked[0] = picked[0].capitalize()
            if length > 9 and rng.random() < 0.5:
                cut = rng.randint(3, length - 3)
                picked[cut] += ","
            end = rng.choices([".", "?", "!"], weights=[90, 6, 4])[0]
            sentence = " ".join(picked) + end
            sentence_in_paragraph += 1
            if sentence_in_paragraph >= rng.randint(3, 7):
                sentence += "\n\n"
                sentence_in_paragraph = 0
            elif rng.random() < 0.999:
                sentence += " "
            parts.append(sentence)
            chars += len(sentence)
        # tokenize the text as a whole, so the ring is the canonical tokenization of its text
        ids: list[int] = []
        for piece in _PIECE.findall("".join(parts)):
            ids.extend(_encode_piece(piece))
        return ids[:n]


_COMMON_WORDS = (  # noqa: SIM905
    "the of and to a in is it you that he was for on are with as his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find model cache token server request prefix worker route queue batch memory"
).split()


def _pseudo_words(rng: random.Random) -> list[str]:
    onsets = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl gr br".split()  # noqa: SIM905
    nuclei = "a e i o u ai ea ou io ee".split()  # noqa: SIM905
    codas = ["", "", "", "n", "r", "s", "t", "l", "nd", "st", "rk"]
    made: set[str] = set()
    while len(made) < 1500:
        syllables = rng.choices([1, 2, 3], weights=[3, 5, 2])[0]
        word = "".join(
            rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas) for _ in range(syllables)
        )
        made.add(word)
    # common words appear several times so that they dominate, as in real text
    return list(_COMMON_WORDS) * 8 + sorted(made)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
        return "".join(texts)
    return str(content)


@functools.cache
def default_tokenizer() -> SimTokenizer:
    """The shared tokenizer instance (immutable after construction)."""
    return SimTokenizer()


class WorkerTokenizer(Protocol):
    """What a simulated worker asks of its tokenizer: :class:`SimTokenizer`, or a real
    model's (:class:`simulator.model.hf_tokenizer.HFWorkerTokenizer`)."""

    @property
    def eos_token_id(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...
    def id_to_piece(self, token_id: int) -> str: ...
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str: ...
    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]: ...
    def encode_chat_request(self, body: Mapping[str, Any]) -> list[int]: ...
    def pseudo_output_ids(self, seed: int, n: int) -> list[int]: ...


@functools.lru_cache(maxsize=8)
def worker_tokenizer(path: str | None, chat_template: str | None = None) -> WorkerTokenizer:
    """The arithmetic tokenizer (``path`` None), else the real one in directory ``path``
    (loaded once per process: every worker of a fleet shares it)."""
    if path is None:
        return default_tokenizer()
    from simulator.model.hf_tokenizer import HFWorkerTokenizer  # needs transformers

    return HFWorkerTokenizer(path, chat_template)
