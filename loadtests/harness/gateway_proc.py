"""Run a router as a subprocess in front of given workers, stopped by PID.

``gateway``: the project's gateway, ``python -m gateway --worker-urls ... --policy P``;
``sglang-router``: sglang-router's ``python -m sglang_router.launch_router`` with the same
flags (for the side-by-side benchmark). Both on 127.0.0.1; ready when ``GET /health``
answers 200 (and, if the JSON body says how many workers are healthy, when all are). A
subprocess rather than the in-process app keeps the router's event loop and CPU apart
from the load generator's, as in a real deployment.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from loadtests.harness.ports import free_port
from loadtests.harness.procs import NotReady, http_get, running, wait_until

ROUTER_MODULES: Mapping[str, str] = MappingProxyType(
    {"gateway": "gateway", "sglang-router": "sglang_router.launch_router"}
)


@dataclass(frozen=True, slots=True)
class GatewayProcess:
    """A running gateway: its URL, PID and log file."""

    url: str
    pid: int
    log_path: Path


def router_ready(url: str, workers: int, path: str = "/health") -> bool:
    """``path`` answers 200 and, where its JSON counts them, every worker is healthy (a
    router registers its workers after it starts listening)."""
    body = http_get(url + path, 2.0)
    if body is None:
        return False
    try:
        healthy = json.loads(body).get("healthy_workers", workers)
    except (ValueError, AttributeError):
        return True
    return bool(healthy == workers)


@contextlib.contextmanager
def run_gateway(
    worker_urls: Sequence[str],
    policy: str,
    log_path: Path,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 30.0,
    router: str = "gateway",
) -> Iterator[GatewayProcess]:
    """Start the router, wait until it is ready, yield it, stop it (SIGTERM, SIGKILL).

    ``router`` is a key of ``ROUTER_MODULES``. Raises ``RuntimeError`` with the log's
    tail if it exits or is not ready in time.
    """
    port = free_port()
    args = [sys.executable, "-m", ROUTER_MODULES[router], "--host", "127.0.0.1",
            "--port", str(port), "--policy", policy, "--worker-urls", *worker_urls,
            *extra_args]  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with running(args, log=log_path, stdin=subprocess.DEVNULL) as process:
        try:
            wait_until(
                lambda: router_ready(url, len(worker_urls)), startup_timeout_s, watch=[process]
            )
        except NotReady:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"{router} ({policy}) did not become ready:\n{tail}") from None
        yield GatewayProcess(url=url, pid=process.pid, log_path=log_path)
