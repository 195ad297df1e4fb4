"""Worker specs in the configuration: ``URL`` or ``URL#kind``, and the kind names.

Contract: :func:`parse_worker_spec` splits a spec and refuses an unknown kind
(ValueError naming it); :func:`configured_kind` turns the ``worker_kind`` setting into a
kind or None (``auto``: discover it). The kinds' behaviour lives in
``gateway.workers.kinds``; only their names are configuration.
"""

from __future__ import annotations

from typing import Final

SGLANG: Final = "sglang"
LLAMACPP: Final = "llamacpp"
VLLM: Final = "vllm"
OPENAI: Final = "openai"
AUTO: Final = "auto"
KIND_NAMES: Final = (SGLANG, LLAMACPP, VLLM, OPENAI)


def parse_worker_spec(spec: str) -> tuple[str, str | None]:
    """``"http://h:1#llamacpp"`` → (``"http://h:1"``, ``"llamacpp"``); no ``#``: kind None.

    Raises ValueError for a kind that is not one of :data:`KIND_NAMES` (``auto`` is
    accepted and means None: discover it).
    """
    url, sep, kind = spec.partition("#")
    if not sep:
        return spec, None
    kind = kind.strip().lower()
    if kind == AUTO:
        return url, None
    if kind not in KIND_NAMES:
        raise ValueError(f"unknown worker kind {kind!r} (expected one of {', '.join(KIND_NAMES)})")
    return url, kind


def configured_kind(worker_kind: str) -> str | None:
    """The ``worker_kind`` setting as a kind for ``WorkerRegistry.add`` (``auto``: None)."""
    return worker_kind if worker_kind in KIND_NAMES else None
