"""Scrape-time gauges: computed from a :class:`FleetSnapshot`, never on the request path.

:class:`FleetCollector` is a prometheus-client custom collector. Each scrape calls the
snapshot provider once, hands the snapshot to ``on_snapshot`` (telemetry prunes the push
series of removed workers there), and yields one family per figure. A worker that is no
longer in the snapshot simply has no sample, so these series need no removal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.telemetry.snapshot import HEALTH_FLAGS, FleetSnapshot, SnapshotProvider

_W = ["worker"]
INDEX_MODES = ("exact", "approximate", "degraded")  # gateway.exact.manager.MODES
_WM = ["worker", "mode"]


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=_W if labels is None else labels)


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    return {
        "in_flight": _gauge(
            "gateway_worker_in_flight_requests", "Requests this gateway has in flight."
        ),
        "queued": _gauge(
            "gateway_worker_queued_requests", "In-flight requests still awaiting a first byte."
        ),
        "queued_tokens": _gauge(
            "gateway_worker_queued_prefill_tokens",
            "Uncached prompt tokens dispatched whose first byte has not come back.",
        ),
        "healthy": _gauge("gateway_worker_healthy", "1 when the worker has no health flag set."),
        "flag": _gauge(
            "gateway_worker_health_flag", "1 when the health flag is set.", ["worker", "flag"]
        ),
        "running": _gauge(
            "gateway_worker_engine_running_requests", "Running requests the worker reports."
        ),
        "waiting": _gauge(
            "gateway_worker_engine_waiting_requests", "Queued requests the worker reports."
        ),
        "usage": _gauge(
            "gateway_worker_engine_token_usage_ratio", "KV token usage the worker reports, 0..1."
        ),
        "mode": _gauge(
            "gateway_index_mode",
            "1 for the worker's prefix index mode (exact, approximate, degraded), else 0.",
            ["worker", "mode"],
        ),
        "blocks": _gauge("gateway_prefix_index_blocks", "Blocks the prefix index holds."),
        "bytes": _gauge("gateway_prefix_index_bytes", "Approximate prefix index memory."),
        "idx_pred": CounterMetricFamily(
            "gateway_prefix_index_predicted_cached_tokens",
            "Cached tokens the prefix index predicted (its own count).",
            labels=_W,
        ),
        "cpt": _gauge(
            "gateway_worker_chars_per_token",
            "Prompt characters per engine token, learnt from the worker's prompt_tokens.",
        ),
        "idx_rep": CounterMetricFamily(
            "gateway_prefix_index_reported_cached_tokens",
            "Cached tokens workers reported, as the prefix index counted them.",
            labels=_W,
        ),
    }


def _fill(fams: dict[str, GaugeMetricFamily | CounterMetricFamily], snap: FleetSnapshot) -> None:
    for w in snap.workers:
        lv = [w.worker]
        fams["in_flight"].add_metric(lv, w.in_flight)
        fams["queued"].add_metric(lv, w.queued)
        fams["queued_tokens"].add_metric(lv, w.queued_prefill_tokens)
        fams["healthy"].add_metric(lv, 1.0 if w.healthy else 0.0)
        for flag in HEALTH_FLAGS:
            fams["flag"].add_metric([w.worker, flag], 1.0 if w.health_flags.get(flag) else 0.0)
        if w.engine_running is not None:
            fams["running"].add_metric(lv, w.engine_running)
        if w.engine_waiting is not None:
            fams["waiting"].add_metric(lv, w.engine_waiting)
        if w.engine_token_usage is not None:
            fams["usage"].add_metric(lv, w.engine_token_usage)
        if w.index_mode is not None:
            for mode in INDEX_MODES:
                fams["mode"].add_metric([w.worker, mode], 1.0 if w.index_mode == mode else 0.0)
        if w.index is not None:
            fams["blocks"].add_metric(lv, w.index.blocks)
            fams["bytes"].add_metric(lv, w.index.approx_bytes)
            fams["idx_pred"].add_metric(lv, w.index.predicted_tokens)
            fams["idx_rep"].add_metric(lv, w.index.reported_tokens)
            if w.index.chars_per_token is not None:
                fams["cpt"].add_metric(lv, w.index.chars_per_token)


def _mode_fidelity(snap: FleetSnapshot) -> Iterator[Metric]:
    """Predicted vs reported cached tokens by index mode (only once there are any)."""
    fams = (
        CounterMetricFamily(
            "gateway_index_mode_predicted_cached_tokens",
            "Cached tokens predicted at dispatch, by the worker's index mode then.",
            labels=_WM,
        ),
        CounterMetricFamily(
            "gateway_index_mode_true_predicted_cached_tokens",
            "Predicted cached tokens the worker confirmed (min of predicted and reported).",
            labels=_WM,
        ),
        CounterMetricFamily(
            "gateway_index_mode_reported_cached_tokens",
            "Cached tokens workers reported, by the index mode at dispatch.",
            labels=_WM,
        ),
    )
    any_sample = False
    for w in snap.workers:
        for mode, _, predicted, true_predicted, reported in w.mode_fidelity:
            any_sample = True
            for fam, value in zip(fams, (predicted, true_predicted, reported), strict=True):
                fam.add_metric([w.worker, mode], value)
    if any_sample:
        yield from fams


def _admission(snap: FleetSnapshot) -> Iterator[Metric]:
    if snap.admission_in_flight is not None:
        yield GaugeMetricFamily(
            "gateway_admission_in_flight_requests",
            "Requests admitted and not finished.",
            value=snap.admission_in_flight,
        )
    if snap.admission_queued is not None:
        yield GaugeMetricFamily(
            "gateway_admission_queued_requests",
            "Requests waiting for admission.",
            value=snap.admission_queued,
        )
    if snap.admission_rejections is not None:
        fam = _rejections()
        for reason, count in snap.admission_rejections.items():
            fam.add_metric([reason], count)
        yield fam


def _rejections() -> CounterMetricFamily:
    return CounterMetricFamily(
        "gateway_admission_rejections", "Requests refused by admission.", labels=["reason"]
    )


class FleetCollector:
    """Yields the pull-style families from one snapshot per scrape."""

    def __init__(
        self,
        snapshot: SnapshotProvider,
        on_snapshot: Callable[[FleetSnapshot], None] | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._on_snapshot = on_snapshot

    def describe(self) -> Iterator[Metric]:
        """The families' names, for duplicate detection at registration (no snapshot)."""
        yield from _families().values()
        yield GaugeMetricFamily("gateway_admission_in_flight_requests", "", value=0)
        yield GaugeMetricFamily("gateway_admission_queued_requests", "", value=0)
        yield _rejections()

    def collect(self) -> Iterator[Metric]:
        """One snapshot, all families."""
        snap = self._snapshot()
        if self._on_snapshot is not None:
            self._on_snapshot(snap)
        fams = _families()
        _fill(fams, snap)
        yield from fams.values()
        yield from _mode_fidelity(snap)
        yield from _admission(snap)
