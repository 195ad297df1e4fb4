"""Operator routes: ``/metrics``, ``/debug/decisions``, ``/debug/index``, ``/dashboard``.

:func:`add_telemetry_routes` adds them to the gateway's application, with every
dependency passed in (no globals, no app keys needed). All handlers are read-only, take
one fleet snapshot at most, and never expose prompt text. ``/dashboard/data?history=1``
adds the gateway's ring of recent chart figures (:class:`FigureRing`, sampled by a task
these routes run for the application's lifetime), so the page opens on the recent past.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.routing.decisions import DecisionSource
from gateway.telemetry import history
from gateway.telemetry.history import FigureRing, ttft_percentiles
from gateway.telemetry.hub import Telemetry
from gateway.telemetry.series import Tally, WorkerStats
from gateway.telemetry.snapshot import WorkerSnapshot

DEFAULT_DECISIONS_LIMIT = 50
MAX_DECISIONS_LIMIT = 1000
DASHBOARD_DECISIONS = 20


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message, "type": "invalid_request_error"}}, status)


def _ratio(num: int, den: int) -> float | None:
    return None if den <= 0 else num / den


def _capped(rate: float | None) -> float | None:
    return None if rate is None else min(1.0, rate)


def _hit_rates(ws: Tally | None) -> dict[str, Any]:
    if ws is None:
        return dict.fromkeys(
            ("requests", "errors", "prompt_tokens", "predicted_tokens", "reported_tokens"), 0
        ) | {"predicted_hit_rate": None, "reported_hit_rate": None}
    return {
        "requests": ws.requests,
        "errors": ws.errors,
        "prompt_tokens": ws.prompt_tokens,
        "predicted_tokens": ws.predicted_tokens,
        "reported_tokens": ws.reported_tokens,
        # Prompt tokens are the gateway's estimate (characters / ratio), which can fall
        # short of the worker's count: rates are capped at 1.
        "predicted_hit_rate": _capped(_ratio(ws.predicted_tokens, ws.prompt_tokens)),
        "reported_hit_rate": _capped(_ratio(ws.reported_tokens, ws.reported_prompt_tokens)),
    }


def _index_doc(w: WorkerSnapshot, ws: WorkerStats | None) -> dict[str, Any]:
    idx = w.index
    doc: dict[str, Any] = {"worker": w.worker, "url": w.url}
    if idx is not None:
        doc.update(
            blocks=idx.blocks,
            bytes=idx.approx_bytes,
            index_predicted_tokens=idx.predicted_tokens,
            index_reported_tokens=idx.reported_tokens,
            fidelity=_ratio(idx.reported_tokens, idx.predicted_tokens),
            chars_per_token=idx.chars_per_token,
        )
    doc.update(_hit_rates(ws))
    return doc


def dashboard_data(telemetry: Telemetry, decisions: DecisionSource) -> dict[str, Any]:
    """The JSON document the dashboard polls: one snapshot plus push figures."""
    snap = telemetry.snapshot()
    stats = telemetry.worker_stats()
    window = telemetry.config.ttft_window_s
    workers = []
    for w in snap.workers:
        ws = stats.get(w.worker)
        doc = w.to_dict()
        doc.update(_index_doc(w, ws))
        doc["ttft_s"] = ttft_percentiles(ws, window)
        workers.append(doc)
    reasons: dict[str, int] = {}
    for (_, reason), n in telemetry.reason_counts.items():
        reasons[reason] = reasons.get(reason, 0) + n
    return {
        "time": time.time(),
        "policy": snap.policy,
        "admission_in_flight": snap.admission_in_flight,
        "admission_queued": snap.admission_queued,
        "requests_total": sum(s.requests for s in stats.values()),
        "workers": workers,
        "reasons": reasons,
        "decisions": [r.to_dict() for r in decisions.latest(DASHBOARD_DECISIONS)],
        # available / captured / delivered (gateway_prefix_tokens), and the requests behind
        "routing_capture": telemetry.capture.summary(),
        # per `model` label (gateway_model_*): requests, hit rates, routing capture
        "models": [
            {"model": name, **_hit_rates(ms), "routing_capture": ms.capture.summary()}
            for name, ms in sorted(telemetry.model_stats().items())
            if ms.requests
        ],
        "tuning": telemetry.tuning.summary(),
    }


def _dashboard_html() -> bytes:
    return resources.files("gateway").joinpath("dashboard/index.html").read_bytes()


def add_telemetry_routes(
    app: web.Application,
    *,
    telemetry: Telemetry,
    decisions: DecisionSource,
    metrics_path: str = "/metrics",
    history_period_s: float | None = None,
) -> None:
    """Add the telemetry routes to ``app`` (before it starts), and the sampling of the
    recent figures while it runs (every ``history_period_s``, default
    :data:`gateway.telemetry.history.PERIOD_S`)."""
    page = _dashboard_html()
    ring = FigureRing(
        telemetry.worker_stats,
        telemetry.config.ttft_window_s,
        period_s=history.PERIOD_S if history_period_s is None else history_period_s,
    )

    async def sampling(_: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(ring.run(), name="dashboard-history")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=telemetry.render_prometheus(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def list_decisions(request: web.Request) -> web.Response:
        raw = request.query.get("limit", str(DEFAULT_DECISIONS_LIMIT))
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_DECISIONS_LIMIT:
            return _error(f"limit: expected an integer 1..{MAX_DECISIONS_LIMIT}, got {raw!r}")
        records = decisions.latest(int(raw))
        return _json({"decisions": [r.to_dict() for r in records]})

    async def index(_: web.Request) -> web.Response:
        stats = telemetry.worker_stats()
        snap = telemetry.snapshot()
        workers = [_index_doc(w, stats.get(w.worker)) for w in snap.workers]
        return _json({"workers": workers, "chars_per_token": dict(snap.chars_per_token)})

    async def dashboard(_: web.Request) -> web.Response:
        return web.Response(
            body=page, content_type="text/html", headers={"Cache-Control": "no-cache"}
        )

    async def data(request: web.Request) -> web.Response:
        doc = dashboard_data(telemetry, decisions)
        if request.query.get("history") == "1":
            doc["history"] = ring.to_dict()
        return _json(doc)

    app.router.add_get(metrics_path, metrics)
    app.router.add_get("/debug/decisions", list_decisions)
    app.router.add_get("/debug/index", index)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/dashboard/data", data)
    app.cleanup_ctx.append(sampling)
