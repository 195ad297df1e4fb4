"""Chained block hashes of a prompt: the keys of the prefix index.

Contract:
- The prompt is cut into fixed-size blocks of ``block_chars`` *bytes* of its UTF-8
  encoding (for ASCII text, bytes are characters; token ids arrive here packed as 4 bytes
  per id, so a 64-byte block is 16 ids). The **trailing partial block is not hashed**: a
  worker's cache holds whole prompts, but routing on a fragment shorter than a block
  would only add noise, and leaving it out keeps ``block_hashes(p)`` a prefix of
  ``block_hashes(p + more)`` for every extension ``more``.
- Hash ``i`` depends on blocks ``0..i`` and on their positions, so equal hash ``i``
  implies (up to 64-bit collisions) an equal prefix of ``i + 1`` blocks: a hit on block
  ``i`` implies a hit on the whole prefix up to ``i``.
- ``seed`` namespaces the chain (model, cache salt, extra key, LoRA): two namespaces
  never share a hash, as a worker never shares cache across them.

Construction: ``h_i = xxh3_64(block_i, seed=seed + i)`` and ``H_i = h_0 ^ ... ^ h_i``.
Seeding each block with its position makes the fold order-sensitive; folding with XOR
lets the whole chain run in C (``map`` + ``itertools.accumulate``) instead of one Python
call per block, which is what brings a 512,000-character prompt (8,000 blocks) to about
1 ms on one slow core (see BENCHMARKS.md, "Prefix index cost"). One pass over the text.
"""

from __future__ import annotations

import struct
from itertools import accumulate
from operator import xor

from xxhash import xxh3_64_intdigest

# Seeds live in 63 bits so that ``seed + block position`` stays a valid 64-bit seed.
_SEED_MASK = (1 << 63) - 1
# Blocks are cut by struct in batches of this many: one C call per batch.
_BATCH = 256


def block_hashes(text: str | bytes, block_chars: int = 64, seed: int = 0) -> list[int]:
    """Chained hashes of the full ``block_chars``-byte blocks of ``text`` (see module)."""
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    data = text.encode() if isinstance(text, str) else text
    blocks = _cut(data, block_chars)
    base = seed & _SEED_MASK
    return list(accumulate(map(xxh3_64_intdigest, blocks, range(base, base + len(blocks))), xor))


def _cut(data: bytes, block_chars: int) -> list[bytes]:
    n = len(data) // block_chars
    out: list[bytes] = []
    full, rest = divmod(n, _BATCH)
    if full:
        fmt = f"{block_chars}s" * _BATCH  # struct caches compiled formats itself
        step = block_chars * _BATCH
        for k in range(full):
            out.extend(struct.unpack_from(fmt, data, k * step))
    if rest:
        out.extend(struct.unpack_from(f"{block_chars}s" * rest, data, full * _BATCH * block_chars))
    return out


def seed_for(model: str | None, namespace: str | None) -> int:
    """The chain seed for a model and a cache namespace (salt / extra key / LoRA joined).

    ``None`` and ``""`` are the same namespace; the separator keeps ``("a", "bc")`` apart
    from ``("ab", "c")``.
    """
    key = f"{model or ''}\x00{namespace or ''}".encode()
    return xxh3_64_intdigest(key) & _SEED_MASK
