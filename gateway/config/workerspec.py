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


# A worker with data-parallel ranks (SGLang ``dp_size > 1``) is routed to per rank: each
# rank has its own radix cache, so each is a routing target with an id of its own.
RANK_MARK: Final = "@dp"
# DP ranks routed to separately per worker, at most; a worker with more is one target
MAX_ROUTED_DP_RANKS: Final = 64


def routed_ranks(dp_size: int) -> int:
    """How many rank targets a worker of ``dp_size`` ranks has (0: it is one target)."""
    return dp_size if 1 < dp_size <= MAX_ROUTED_DP_RANKS else 0


def rank_target_id(worker_id: str, rank: int) -> str:
    """The routing target id of ``worker_id``'s DP rank ``rank`` (``h-1@dp2``). Worker
    ids never hold ``@`` (``gateway.workers.registry.worker_id_for``), so it is unique."""
    return f"{worker_id}{RANK_MARK}{rank}"


def split_target_id(target_id: str) -> tuple[str, int | None]:
    """``"h-1@dp2"`` → (``"h-1"``, 2); a worker's own id → (the id, None)."""
    worker_id, sep, rank = target_id.rpartition(RANK_MARK)
    if sep and rank.isdigit() and worker_id:
        return worker_id, int(rank)
    return target_id, None
