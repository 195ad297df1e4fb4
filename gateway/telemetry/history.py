"""The gateway's own ring of recent dashboard figures, so the page opens on the recent past.

The dashboard draws request rate and TTFT p90 per worker over time. Without a ring on the
gateway those charts start empty and fill only while a page is open and polling.
:class:`FigureRing` samples the same figures every ``period_s`` (default
:data:`PERIOD_S`, the page's own polling period) into a bounded ring of :data:`SIZE`
samples (three minutes); ``GET /dashboard/data?history=1`` serves it and the page draws it
on first paint.

Contract: a sample holds, per worker telemetry has figures for, the cumulative request
count and the TTFT p90 of the recent window (the rule of :func:`ttft_percentiles`, the
one the dashboard's table uses), stamped with wall-clock time like ``/dashboard/data``.
Rates are not stored: the page derives them from successive counts, as it does live.
Sampling costs one sort of at most ``TelemetryConfig.ttft_window`` floats per worker per
period, off the request path. Event loop thread only, like the rest of telemetry.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from gateway.telemetry.series import WorkerStats

PERIOD_S = 1.5  # the dashboard polls at this period too: one chart point per sample
SIZE = 120  # samples kept: the page's chart width (3 minutes at PERIOD_S)
QUANTILES = (50, 90, 99)


def ttft_percentiles(
    ws: WorkerStats | None, window_s: float, now: float | None = None
) -> dict[str, float | None]:
    """TTFT p50/p90/p99 of ``ws``'s recent samples younger than ``window_s`` (monotonic
    ``now``, default the current time); ``None`` each when there are none. The ``q``-th
    percentile is the sorted sample at index ``n * q // 100`` (clamped to the last)."""
    if ws is None:
        return {f"p{q}": None for q in QUANTILES}
    horizon = (time.monotonic() if now is None else now) - window_s
    values = sorted(v for t, v in ws.ttft_recent if t >= horizon)
    if not values:
        return {f"p{q}": None for q in QUANTILES}
    last = len(values) - 1
    return {f"p{q}": values[min(last, (len(values) * q) // 100)] for q in QUANTILES}


class FigureRing:
    """Recent per-worker chart figures, sampled by :meth:`run` (or :meth:`sample`).

    ``stats`` returns telemetry's per-worker figures (``Telemetry.worker_stats``);
    ``window_s`` is the TTFT window (``TelemetryConfig.ttft_window_s``). ``wall`` and
    ``mono`` are the clocks (injected by tests)."""

    def __init__(
        self,
        stats: Callable[[], Mapping[str, WorkerStats]],
        window_s: float,
        *,
        period_s: float = PERIOD_S,
        size: int = SIZE,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        if period_s <= 0 or size < 1:
            raise ValueError(f"period_s must be > 0 and size >= 1, got {period_s}, {size}")
        self._stats = stats
        self._window_s = window_s
        self.period_s = period_s
        self._wall = wall
        self._mono = mono
        self._samples: deque[dict[str, Any]] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._samples)

    def sample(self) -> None:
        """Append one sample of every worker's figures now (the oldest goes when full)."""
        now = self._mono()
        workers = [
            {
                "worker": worker,
                "requests": ws.requests,
                "ttft_p90": ttft_percentiles(ws, self._window_s, now)["p90"],
            }
            for worker, ws in self._stats().items()
        ]
        self._samples.append({"time": self._wall(), "workers": workers})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready ring, oldest sample first: ``{"period_s", "samples": [{"time",
        "workers": [{"worker", "requests", "ttft_p90"}]}]}``."""
        return {"period_s": self.period_s, "samples": list(self._samples)}

    async def run(self) -> None:
        """Sample now and then every ``period_s``, until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.period_s)
