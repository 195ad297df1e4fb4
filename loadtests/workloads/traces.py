"""Trace workloads: Mooncake (JSONL with chained block ids) and Azure 2023 (CSV).

Mooncake: each row becomes a :class:`TracePrompt` of its ``hash_ids`` (512-token blocks,
the last one partial), sent as one user message; each id renders as deterministic
pseudo-text seeded by the id, so equal ids are equal text. Azure rows carry no prefix
information: each request gets fresh block ids, so nothing is ever reused (a load-only
baseline). Arrival times are the trace's, relative to its first row, divided by
``speed``; ``limit`` keeps the first rows.
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

import orjson

from loadtests.workloads.base import (
    TRACE_BLOCK_TOKENS,
    TracePrompt,
    Workload,
    WorkloadRequest,
    finish,
)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
MOONCAKE_CONVERSATION = DATA_DIR / "mooncake_conversation.jsonl"
MOONCAKE_SYNTHETIC = DATA_DIR / "mooncake_synthetic.jsonl"
AZURE_CONV = DATA_DIR / "azure_2023_conv.csv"


def _check_speed(speed: float) -> None:
    if speed <= 0:
        raise ValueError("speed must be positive")


def mooncake_trace(
    path: str = str(MOONCAKE_CONVERSATION),
    speed: float = 1.0,
    limit: int = 0,
    seed: int = 0,
    session_block: int = -1,
) -> Workload:
    """Read a Mooncake JSONL trace (``timestamp`` in ms).

    The trace names no sessions. ``session_block >= 0`` derives one: the id of block
    ``session_block`` (or the last block, if shorter) becomes ``session_id``, so a
    conversation's turns share it (block 1 for the conversation trace, whose block 0 every
    request shares; block 0 for the synthetic trace). Only key-affinity policies read it.
    """
    _check_speed(speed)
    requests: list[WorkloadRequest] = []
    with open(path, "rb") as f:
        for line in f:
            if limit and len(requests) >= limit:
                break
            if not line.strip():
                continue
            row = orjson.loads(line)
            prompt = TracePrompt(tuple(row["hash_ids"]), int(row["input_length"]), seed=seed)
            session = None
            if session_block >= 0:
                session = f"b{prompt.hash_ids[min(session_block, len(prompt.hash_ids) - 1)]}"
            requests.append(
                WorkloadRequest(
                    len(requests),
                    float(row["timestamp"]) / 1000.0,
                    max(1, int(row["output_length"])),
                    trace=prompt,
                    session_id=session,
                )
            )
    start = min((r.arrival_s for r in requests), default=0.0)
    shifted = [_shift(r, start, speed) for r in requests]
    params = dict(path=path, speed=speed, limit=limit, seed=seed, session_block=session_block)
    return finish("mooncake", shifted, params)


def _shift(req: WorkloadRequest, start: float, speed: float) -> WorkloadRequest:
    return WorkloadRequest(
        req.index,
        (req.arrival_s - start) / speed,
        req.max_tokens,
        req.messages,
        req.trace,
        req.session_id,
        req.group,
    )


def _parse_timestamp(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (any fraction digits)."""
    whole, _, fraction = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float(f"0.{fraction}") if fraction else 0.0)


def azure_trace(
    path: str = str(AZURE_CONV), speed: float = 1.0, limit: int = 0, seed: int = 0
) -> Workload:
    """Read the Azure 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    _check_speed(speed)
    requests: list[WorkloadRequest] = []
    next_id = 1
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if limit and len(requests) >= limit:
                break
            tokens = max(1, int(row["ContextTokens"]))
            blocks = -(-tokens // TRACE_BLOCK_TOKENS)
            ids = tuple(-(next_id + k) for k in range(blocks))  # negative: never a Mooncake id
            next_id += blocks
            requests.append(
                WorkloadRequest(
                    len(requests),
                    _parse_timestamp(row["TIMESTAMP"]),
                    max(1, int(row["GeneratedTokens"])),
                    trace=TracePrompt(ids, tokens, seed=seed),
                )
            )
    start = min((r.arrival_s for r in requests), default=0.0)
    shifted = [_shift(r, start, speed) for r in requests]
    return finish("azure", shifted, dict(path=path, speed=speed, limit=limit, seed=seed))
