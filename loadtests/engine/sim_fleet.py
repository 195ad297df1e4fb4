"""The simulated SGLang fleet (``python -m simulator``) as a subprocess, stopped by PID.

Used by the real-engine benchmark to run the same workload on the simulator with a
profile calibrated to the llama.cpp workers: ``speed`` scales modelled time to wall time
(``speed = profile's prefill s/token / measured s/token``), ``capacity_tokens`` and
``max_running_requests`` stand for the llama.cpp slots (a radix cache of ``slots`` prompts'
tokens; ``slots`` requests at once).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STOP_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class SimSettings:
    """How the simulated workers are configured."""

    profile: str = "tiny-cpu"
    speed: float = 1.0
    capacity_tokens: int = 4200
    max_running_requests: int = 2

    def args(self, k: int) -> list[str]:
        return [
            sys.executable, "-m", "simulator", "--workers", str(k), "--base-port", "0",
            "--profile", self.profile, "--speed", str(self.speed),
            "--capacity-tokens", str(self.capacity_tokens),
            "--max-running-requests", str(self.max_running_requests),
            "--enable-metrics", "--enable-cache-report", "--served-model-name", "tiny-llama",
        ]  # fmt: skip


def _read_urls(stdout_path: Path, k: int) -> list[str]:
    lines = stdout_path.read_text().splitlines() if stdout_path.exists() else []
    return [line.strip() for line in lines if line.startswith("http://")][:k]


@contextlib.contextmanager
def run_sim_fleet(
    k: int, settings: SimSettings, log_dir: Path, startup_timeout_s: float = 30.0
) -> Iterator[list[str]]:
    """Start ``k`` simulated workers on ephemeral ports; yield their URLs; stop by PID."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = log_dir / "sim.out", log_dir / "sim.log"
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        process = subprocess.Popen(
            settings.args(k), stdin=subprocess.DEVNULL, stdout=out, stderr=err
        )
    try:
        deadline = time.monotonic() + startup_timeout_s
        while len(urls := _read_urls(stdout_path, k)) < k:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("simulator did not start:\n" + stderr_path.read_text()[-2000:])
            time.sleep(0.1)
        yield urls
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
