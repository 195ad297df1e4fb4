"""The simulated fleet (``python -m simulator``) as a subprocess, stopped by PID.

Used by the real-engine benchmark to run the same workload on the simulator with a
profile calibrated to the llama.cpp workers: ``speed`` scales modelled time to wall time
(``speed = profile's prefill s/token / measured s/token``).

With ``engine="llamacpp"`` (``loadtests.engine.bench``'s default) the workers are
simulated llama.cpp servers with the real fleet's geometry: ``slots`` slots of
``ctx_per_slot`` tokens, one prompt per slot, no KV shared between slots, and the same
``/metrics`` counters, so the benchmark reads the cached fraction from the engines as on
the real fleet. ``engine="sglang"`` (the default here, used by other benchmarks and tests)
is the earlier stand-in: SGLang workers whose ``capacity_tokens`` and
``max_running_requests`` stand for the slots (a radix cache of ``slots`` prompts' tokens;
``slots`` requests at once), their cached fraction read from ``usage``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtests.harness.procs import NotReady, running, wait_until


@dataclass(frozen=True, slots=True)
class SimSettings:
    """How the simulated workers are configured."""

    profile: str = "tiny-cpu"
    speed: float = 1.0
    engine: str = "sglang"  # or "llamacpp" (the real-engine benchmark's default)
    slots: int = 2  # llamacpp: n_parallel
    ctx_per_slot: int = 4096  # llamacpp: as LlamaFleet's default
    capacity_tokens: int = 4200  # sglang only
    max_running_requests: int | None = 2  # sglang only; None: SGLang's formula
    page_size: int = 1  # sglang only
    # prefill/decode disaggregation (sglang only, docs/PD.md section 8): "null", "prefill"
    # or "decode"; a prefill fleet's worker i serves its bootstrap server on
    # bootstrap_port + i (0: ephemeral, as /server_info then reports); a decode's is the
    # prefill port it assumes for a request whose bootstrap_port is null (0: SGLang's 8998)
    disaggregation_mode: str = "null"
    bootstrap_port: int = 0
    transfer_profile: str = ""  # the simulated KV link ("": the simulator's default)

    def args(self, k: int) -> list[str]:
        common = [
            sys.executable, "-m", "simulator", "--workers", str(k), "--base-port", "0",
            "--profile", self.profile, "--speed", str(self.speed),
            "--enable-metrics", "--served-model-name", "tiny-llama",
        ]  # fmt: skip
        if self.engine == "llamacpp":
            context = self.slots * self.ctx_per_slot
            return [
                *common, "--engine", "llamacpp", "--slots", str(self.slots),
                "--context-length", str(context),
            ]  # fmt: skip
        if self.engine != "sglang":
            raise ValueError(f"unknown simulator engine {self.engine!r}")
        running = (
            [] if self.max_running_requests is None
            else ["--max-running-requests", str(self.max_running_requests)]
        )  # fmt: skip
        return [
            *common, "--capacity-tokens", str(self.capacity_tokens), *running,
            "--page-size", str(self.page_size), "--enable-cache-report", *self._pd_args(),
        ]  # fmt: skip

    def _pd_args(self) -> list[str]:
        if self.disaggregation_mode == "null":
            return []
        args = ["--disaggregation-mode", self.disaggregation_mode]
        if self.bootstrap_port or self.disaggregation_mode == "prefill":
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if self.transfer_profile:
            args += ["--transfer-profile", self.transfer_profile]
        return args


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
    with (
        stdout_path.open("wb") as out,
        stderr_path.open("wb") as err,
        running(settings.args(k), stdin=subprocess.DEVNULL, stdout=out, stderr=err) as process,
    ):
        try:
            wait_until(
                lambda: len(_read_urls(stdout_path, k)) >= k, startup_timeout_s, watch=[process]
            )
        except NotReady:
            raise RuntimeError(
                "simulator did not start:\n" + stderr_path.read_text()[-2000:]
            ) from None
        yield _read_urls(stdout_path, k)
