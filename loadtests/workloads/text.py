"""Deterministic English-like pseudo-text with a known token count.

Text is a sequence of *pieces*, each a space and a consonant-vowel-consonant syllable
(``" bak"``, ``" tem"``): four characters that a word-level or a ~4-chars-per-token
tokenizer reads as one token, so ``n`` pieces are ``n`` tokens to the simulated worker.
The piece sequence for ``(seed, n)`` is a pure function of the seed; a shorter sequence
with the same seed is a prefix of a longer one (truncated trace blocks rely on this).

Cost: one SHAKE-128 digest per sequence, then a table look-up per piece: a few µs per
512 pieces with :class:`PieceCodec` (numpy), about 40 µs to render them as ``str``.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Any

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


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from ``parts``, stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def raw_piece_ids(seed: int, n: int) -> bytes:
    """The first ``n`` piece indices as little-endian uint16 bytes (``2 * n`` bytes).

    SHAKE-128 of the seed is the random stream: an extendable-output function, so a
    shorter sequence is always a prefix of a longer one with the same seed.
    """
    if n <= 0:
        return b""
    raw = bytearray(hashlib.shake_128(seed.to_bytes(8, "little")).digest(2 * n))
    raw[1::2] = raw[1::2].translate(_HIGH_BYTE_MASK)  # keep 10 bits of each 16
    return bytes(raw)


def piece_ids(seed: int, n: int) -> array[int]:
    """The first ``n`` piece indices (0..1023) of the sequence seeded by ``seed``."""
    ids = array("H")
    ids.frombytes(raw_piece_ids(seed, n))
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


class PieceCodec:
    """Piece sequences → concatenated fixed-width byte values, one value per piece.

    ``PieceCodec([p.encode() for p in PIECES])`` gives the text's bytes; a table of
    4-byte token ids gives a radix-cache key. Uses numpy when it is installed (about 7x
    faster on 512 pieces), else ``bytes.join``; both give the same bytes.
    """

    def __init__(self, values: list[bytes]) -> None:
        if len(values) != VOCAB_SIZE or len({len(v) for v in values}) != 1:
            raise ValueError("one value of one fixed width per piece")
        self._values = list(values)
        self._table: Any = None
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy is in the bench extra
            return
        width = len(values[0])
        self._table = np.frombuffer(b"".join(values), dtype=f"S{width}")

    def encode(self, seed: int, n: int) -> bytes:
        raw = raw_piece_ids(seed, n)
        if self._table is not None:
            import numpy as np

            return bytes(self._table[np.frombuffer(raw, dtype="<u2")].tobytes())
        return b"".join(map(self._values.__getitem__, piece_ids(seed, n)))


def render(ids: array[int] | list[int]) -> str:
    """The text of a piece sequence."""
    return "".join([PIECES[i] for i in ids])


def pseudo_text(seed: int, n_tokens: int) -> str:
    """``n_tokens`` pieces of deterministic pseudo-text (``4 * n_tokens`` characters)."""
    return render(piece_ids(seed, n_tokens))
