"""Outlier ejection: consecutive failures, growing back-off, share cap, expiry."""

from __future__ import annotations

from gateway.config import OutlierConfig
from gateway.workers.outlier import (
    OUTCOME_5XX,
    OUTCOME_CONNECT_ERROR,
    OUTCOME_SUCCESS,
    OutlierDetector,
)
from gateway.workers.registry import HealthFlag, Worker, WorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _setup(n: int, **cfg: float) -> tuple[OutlierDetector, list[Worker], Clock]:
    clock = Clock()
    reg = WorkerRegistry(0.5, clock)
    workers = [reg.add(f"http://127.0.0.1:{i + 1}")[0] for i in range(n)]
    for w in workers:
        w.flags.clear()
    config = OutlierConfig(**cfg)  # type: ignore[arg-type]
    return OutlierDetector(config, reg, clock), workers, clock


def test_connect_errors_eject_at_threshold() -> None:
    det, (w, _, _), _ = _setup(3, consecutive_connect_errors=2)
    det.record(w, OUTCOME_CONNECT_ERROR)
    assert w.healthy
    det.record(w, OUTCOME_CONNECT_ERROR)
    assert HealthFlag.EJECTED in w.flags


def test_success_resets_the_count() -> None:
    det, (w, _, _), _ = _setup(3, consecutive_5xx=3)
    for _ in range(2):
        det.record(w, OUTCOME_5XX)
    det.record(w, OUTCOME_SUCCESS)
    for _ in range(2):
        det.record(w, OUTCOME_5XX)
    assert w.healthy
    det.record(w, OUTCOME_5XX)
    assert not w.healthy


def test_backoff_grows_with_times_ejected_and_expires() -> None:
    det, (w, _, _), clock = _setup(3, base_ejection_s=10.0, max_ejection_s=25.0)
    durations = []
    for _ in range(3):
        det.record(w, OUTCOME_CONNECT_ERROR)
        durations.append(w.ejected_until - clock.now)
        clock.now = w.ejected_until - 0.1
        det.sweep()
        assert HealthFlag.EJECTED in w.flags
        clock.now = w.ejected_until
        det.sweep()
        assert w.healthy
    assert durations == [10.0, 20.0, 25.0]
    # calm for longer than max_ejection_s: the count restarts
    clock.now += 100.0
    det.record(w, OUTCOME_CONNECT_ERROR)
    assert w.ejected_until - clock.now == 10.0


def test_max_ejected_share_keeps_workers() -> None:
    det, workers, _ = _setup(4, max_ejected_share=0.5)
    for w in workers:
        det.record(w, OUTCOME_CONNECT_ERROR)
    assert sum(HealthFlag.EJECTED in w.flags for w in workers) == 2


def test_at_least_one_may_be_ejected() -> None:
    det, workers, _ = _setup(2, max_ejected_share=0.1)
    for w in workers:
        det.record(w, OUTCOME_CONNECT_ERROR)
    assert sum(HealthFlag.EJECTED in w.flags for w in workers) == 1


def test_eject_hook_called() -> None:
    det, (w, _), _ = _setup(2)
    seen: list[str] = []
    det.on_eject.append(lambda worker: seen.append(worker.id))
    det.record(w, OUTCOME_CONNECT_ERROR)
    assert seen == [w.id]
