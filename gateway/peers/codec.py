"""Wire formats of the shared state on Redis: compact, versionless, little-endian.

- A *record batch* (one stream entry) and an *index snapshot* share one layout: a
  sequence of ``[u16 name length][worker id, UTF-8][u32 n][n x u64 block hash]``. In a
  batch each item is one recording (a prompt's chained block hashes, in prompt order); in
  a snapshot each item is one worker's believed blocks, most recently used first, so that
  ``PrefixIndex.record`` (which touches the deepest block first) rebuilds the LRU order.
- A *load value* is ``"in_flight,queued_prefill_tokens,decoding_requests"``.
- Stream entry ids ``"<ms>-<seq>"`` compare as integer pairs (:func:`stream_id`).

Block hashes are unsigned 64-bit (``gateway.routing.hashing``); 8 bytes each, so a 4,000-token
prompt (250 blocks of 16 tokens) costs about 2 KB on the stream.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence

_HEAD = struct.Struct("<H")
_COUNT = struct.Struct("<I")
_BIG_ENDIAN = sys.byteorder == "big"

LoadFigures = tuple[int, int, int]  # in_flight, queued_prefill_tokens, decoding_requests


class CodecError(ValueError):
    """A payload that does not follow the layout (truncated or foreign)."""


def pack_items(items: Iterable[tuple[str, Sequence[int]]]) -> bytes:
    """``[(worker id, hashes), ...]`` → bytes (see the module layout)."""
    out = bytearray()
    for worker_id, hashes in items:
        name = worker_id.encode()
        values = array("Q", hashes)
        if _BIG_ENDIAN:  # pragma: no cover - x86 and arm64 are little-endian
            values.byteswap()
        out += _HEAD.pack(len(name))
        out += name
        out += _COUNT.pack(len(values))
        out += values.tobytes()
    return bytes(out)


def unpack_items(data: bytes) -> Iterator[tuple[str, list[int]]]:
    """bytes → ``(worker id, hashes)`` items; CodecError when the payload is malformed."""
    view, pos, end = memoryview(data), 0, len(data)
    while pos < end:
        try:
            (name_len,) = _HEAD.unpack_from(view, pos)
            pos += _HEAD.size
            name = bytes(view[pos : pos + name_len]).decode()
            pos += name_len
            (count,) = _COUNT.unpack_from(view, pos)
            pos += _COUNT.size
        except (struct.error, UnicodeDecodeError) as exc:
            raise CodecError(f"malformed item at byte {pos}: {exc}") from None
        size = count * 8
        if pos + size > end:
            raise CodecError(f"item of {count} hashes truncated at byte {pos}")
        values = array("Q")
        values.frombytes(view[pos : pos + size])
        if _BIG_ENDIAN:  # pragma: no cover
            values.byteswap()
        pos += size
        yield name, values.tolist()


def pack_load(figures: LoadFigures) -> str:
    return f"{figures[0]},{figures[1]},{figures[2]}"


def unpack_load(value: bytes | str) -> LoadFigures | None:
    """A load value, or None when it is not three integers."""
    text = value.decode() if isinstance(value, bytes) else value
    parts = text.split(",")
    if len(parts) != 3:
        return None
    try:
        return int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        return None


def stream_id(value: bytes | str) -> tuple[int, int]:
    """``"1700000000000-3"`` → ``(1700000000000, 3)``; a bare ``"5"`` → ``(5, 0)``."""
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
