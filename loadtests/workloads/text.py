"""Deterministic English-like pseudo-text with a known token count.

Text is a sequence of *pieces*, each a space and a consonant-vowel-consonant syllable
(``" bak"``, ``" tem"``): four characters that a word-level or a ~4-chars-per-token
tokenizer reads as one token, so ``n`` pieces are ``n`` tokens to the simulated worker.
The piece sequence for ``(seed, n)`` is a pure function of the seed; a shorter sequence
with the same seed is a prefix of a longer one (truncated trace blocks rely on this).

Cost: one PRNG seeding and one ``getrandbits`` per sequence, then a table look-up per
piece: about 10 µs per 512 pieces, plus about 20 µs to render them as text.
"""

from __future__ import annotations

import hashlib
import random
import sys
from array import array

PIECE_CHARS = 4
_ONSETS = "bcdfghklmnprstvw"
_VOWELS = "aeiou"
_CODAS = "bdgklmnprstvxyzf"


def _build_pieces() -> tuple[str, ...]:
    pieces = [f" {o}{v}{c}" for o in _ONSETS for v in _VOWELS for c in _CODAS]
    return tuple(pieces[:1024])


PIECES: tuple[str, ...] = _build_pieces()  # immutable: 1,024 pieces, 10 bits each
VOCAB_SIZE = len(PIECES)
_HIGH_BYTE_MASK = bytes(b & 0x03 for b in range(256))
_LITTLE_ENDIAN = sys.byteorder == "little"


def _swap16(raw: bytearray) -> bytearray:
    swapped = bytearray(len(raw))
    swapped[0::2], swapped[1::2] = raw[1::2], raw[0::2]
    return swapped


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from ``parts``, stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def piece_ids(seed: int, n: int) -> array[int]:
    """The first ``n`` piece indices (0..1023) of the sequence seeded by ``seed``."""
    if n <= 0:
        return array("H")
    words = (n + 1) // 2  # whole 32-bit PRNG outputs keep shorter sequences prefixes
    raw = bytearray(random.Random(seed).getrandbits(32 * words).to_bytes(4 * words, "little"))
    del raw[2 * n :]
    raw[1::2] = raw[1::2].translate(_HIGH_BYTE_MASK)  # keep 10 bits of each 16
    ids = array("H")
    ids.frombytes(bytes(raw) if _LITTLE_ENDIAN else bytes(_swap16(raw)))
    return ids


def render(ids: array[int] | list[int]) -> str:
    """The text of a piece sequence."""
    return "".join([PIECES[i] for i in ids])


def pseudo_text(seed: int, n_tokens: int) -> str:
    """``n_tokens`` pieces of deterministic pseudo-text (``4 * n_tokens`` characters)."""
    return render(piece_ids(seed, n_tokens))
