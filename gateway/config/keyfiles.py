"""API key files: one key a line, blank lines and ``#`` comments skipped.

Contract: :func:`read_key_file` returns the keys, or raises ValueError naming the file
(never a key). Read at startup by config validation and by the authenticator.
"""

from __future__ import annotations

from pathlib import Path


def read_key_file(path: str) -> list[str]:
    """Keys in ``path``, one a line; blank lines and ``#`` comments skipped.
    ValueError (naming the file, never a key) when it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read API key file {path}: {exc.__class__.__name__}") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
