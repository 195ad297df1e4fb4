"""Passive outlier ejection: workers that fail real requests leave the candidates for a while.

Contract:
- :meth:`OutlierDetector.record` is told the outcome of every attempt: a connect error, a
  5xx, or a success (anything else). ``consecutive_connect_errors`` connect errors in a
  row, or ``consecutive_5xx`` 5xx in a row, eject the worker (``HealthFlag.EJECTED``).
- An ejection lasts ``base_ejection_s x times ejected`` (capped at ``max_ejection_s``);
  the count restarts after ``max_ejection_s`` without an ejection.
- At most ``max_ejected_share`` of the workers are ejected at once, and at least one may
  always be, so a small fleet still sheds a dead worker.
- :meth:`sweep` lifts expired ejections; it is called periodically by the app.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from gateway.config import OutlierConfig
from gateway.workers.registry import HealthFlag, Worker, WorkerRegistry

log = logging.getLogger(__name__)

OUTCOME_SUCCESS = "success"
OUTCOME_CONNECT_ERROR = "connect_error"
OUTCOME_5XX = "5xx"


class OutlierDetector:
    def __init__(
        self, config: OutlierConfig, registry: WorkerRegistry, clock: Callable[[], float]
    ) -> None:
        self._config = config
        self._registry = registry
        self._clock = clock
        self.on_eject: list[Callable[[Worker], None]] = []  # telemetry hooks

    def record(self, worker: Worker, outcome: str) -> None:
        if outcome == OUTCOME_SUCCESS:
            worker.consecutive_connect_errors = 0
            worker.consecutive_5xx = 0
            return
        if outcome == OUTCOME_CONNECT_ERROR:
            worker.consecutive_connect_errors += 1
            tripped = worker.consecutive_connect_errors >= self._config.consecutive_connect_errors
        else:
            worker.consecutive_5xx += 1
            tripped = worker.consecutive_5xx >= self._config.consecutive_5xx
        if tripped and HealthFlag.EJECTED not in worker.flags:
            self._eject(worker)

    def _may_eject(self) -> bool:
        total = len(self._registry)
        ejected = sum(1 for w in self._registry if HealthFlag.EJECTED in w.flags)
        allowed = max(1, math.floor(self._config.max_ejected_share * total))
        return ejected < allowed

    def _eject(self, worker: Worker) -> None:
        if not self._may_eject():
            return
        now = self._clock()
        cfg = self._config
        if worker.times_ejected and now - worker.last_ejected_at > cfg.max_ejection_s:
            worker.times_ejected = 0
        worker.times_ejected += 1
        duration = min(cfg.base_ejection_s * worker.times_ejected, cfg.max_ejection_s)
        worker.ejected_until = now + duration
        worker.last_ejected_at = now
        worker.flags.add(HealthFlag.EJECTED)
        worker.consecutive_connect_errors = 0
        worker.consecutive_5xx = 0
        log.warning(
            "worker %s ejected for %.0f s (ejection %d)", worker.url, duration, worker.times_ejected
        )
        for hook in self.on_eject:
            hook(worker)

    def sweep(self) -> None:
        """Return workers whose ejection expired to the candidates."""
        now = self._clock()
        for worker in self._registry:
            if HealthFlag.EJECTED in worker.flags and worker.ejected_until <= now:
                worker.flags.discard(HealthFlag.EJECTED)
                log.info("worker %s back from ejection", worker.url)
