"""Plain-Python pieces of the Locust load test (no Locust import, so tests can use them).

* :class:`ScriptQueue`: hands a workload's requests out to Locust users as *scripts*:
  a multi-turn session's turns (in order, one user at a time) or a single request;
  it cycles when the workload is exhausted.
* :class:`PrefixStats`: the cached-token fraction (``usage.prompt_tokens_details``) and
  the spread of requests over workers (``x-gateway-worker``), summed over the run.
* :func:`parse_sse_usage`: the ``usage`` object of one streamed ``data:`` line, if any.
"""

from __future__ import annotations

import csv
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtests.workloads.base import Workload, WorkloadRequest


def scripts_of(workload: Workload) -> list[tuple[WorkloadRequest, ...]]:
    """Requests grouped into scripts: one per multi-turn session, else one per request.

    Scripts are ordered by their first request's arrival.
    """
    if workload.name != "multi-turn":
        return [(r,) for r in workload.requests]
    sessions: dict[str, list[WorkloadRequest]] = {}
    for r in workload.requests:
        sessions.setdefault(r.session_id or f"r{r.index}", []).append(r)
    return sorted((tuple(s) for s in sessions.values()), key=lambda s: s[0].arrival_s)


class ScriptQueue:
    """Thread/greenlet-safe round-robin over a workload's scripts."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self._scripts = scripts_of(workload)
        if not self._scripts:
            raise ValueError(f"workload {workload.name!r} has no requests")
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> tuple[WorkloadRequest, ...]:
        with self._lock:
            script = self._scripts[self._next % len(self._scripts)]
            self._next += 1
            return script


def parse_sse_usage(line: bytes) -> tuple[bool, dict[str, Any] | None]:
    """``(is_event, usage)`` of one SSE line: ``is_event`` for any ``data:`` payload but
    ``[DONE]``; ``usage`` when that event carries one."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return False, None
    data = line[5:].strip()
    if not data or data == b"[DONE]":
        return False, None
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return True, None
    usage = event.get("usage") if isinstance(event, dict) else None
    return True, usage if isinstance(usage, dict) else None


@dataclass
class PrefixStats:
    """Cached prompt tokens and worker spread, summed over a run."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    responses_with_usage: int = 0
    workers: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, usage: dict[str, Any] | None, worker: str | None) -> None:
        with self._lock:
            if usage is not None:
                details = usage.get("prompt_tokens_details") or {}
                self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                self.cached_tokens += int(details.get("cached_tokens") or 0)
                self.responses_with_usage += 1
            self.workers[worker or "(no x-gateway-worker header)"] += 1

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.cached_tokens = self.responses_with_usage = 0
            self.workers.clear()

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def rows(self) -> list[tuple[str, str]]:
        """``(metric, value)`` rows: the fraction, token totals, then requests per worker."""
        total = sum(self.workers.values())
        out = [
            ("cached_fraction", f"{self.cached_fraction:.4f}"),
            ("prompt_tokens", str(self.prompt_tokens)),
            ("cached_tokens", str(self.cached_tokens)),
            ("responses_with_usage", str(self.responses_with_usage)),
        ]
        for worker, n in sorted(self.workers.items()):
            out.append((f"worker_share {worker}", f"{n} ({n / total:.1%})"))
        return out

    def summary(self, workload: str) -> str:
        lines = [f"prefix summary ({workload}):"]
        lines += [f"  {k}: {v}" for k, v in self.rows()]
        return "\n".join(lines)

    def write_csv(self, path: Path, workload: str) -> None:
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["workload", "metric", "value"])
            writer.writerows([workload, k, v] for k, v in self.rows())
