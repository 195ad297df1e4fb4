"""Start K llama.cpp workers (``xllamacpp``), each in its own subprocess, on 127.0.0.1.

``xllamacpp.Server`` runs llama.cpp's HTTP server inside the Python process that creates
it, so each worker is a child ``python -m loadtests.engine.llama_fleet serve`` process,
stopped by PID (SIGTERM, then SIGKILL after a grace period). A child also exits on its own
when its parent dies, so a crashed test run leaves no worker burning CPU.

Cache capacity is set on purpose: ``cache_ram_mib=0`` (no host-RAM prompt cache) and
``slots`` parallel slots, so a worker holds exactly ``slots`` prompts, one per slot (a
request takes the slot with the longest common prefix, else the least recently used).
``n_ctx = slots * ctx_per_slot`` (not unified: each slot owns ``ctx_per_slot`` tokens).
One compute thread per worker: the machine has 2 cores shared by everyone.

Python API (synchronous; from async code call it before the loop or via a thread)::

    with LlamaFleet.start(4, model_path, slots=2, ctx_per_slot=4096) as fleet:
        fleet.urls  # ['http://127.0.0.1:41234', ...], every /health answered 200

CLI::

    python -m loadtests.engine.llama_fleet --workers 4 [--base-port 8100] [--model PATH]
    python -m loadtests.engine.llama_fleet serve --port 8100 --model PATH   # one worker
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.harness.procs import NotReady, http_ok, stop_all, wait_until

LOOPBACK = "127.0.0.1"
STOP_GRACE_S = 5.0  # SIGTERM → SIGKILL
DEFAULT_STARTUP_TIMEOUT_S = 60.0
MODEL_ALIAS = "tiny-llama"


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """How each llama.cpp worker is configured. Defaults: 2 slots of 4,096 tokens, 1 thread."""

    model_path: Path
    slots: int = 2
    ctx_per_slot: int = 4096
    threads: int = 1
    cache_ram_mib: int = 0  # 0: a worker holds exactly `slots` prompts
    alias: str = MODEL_ALIAS

    def serve_args(self, port: int, url_file: Path) -> list[str]:
        """Command line of the child process serving one worker on ``port`` (0: any)."""
        return [
            sys.executable, "-m", "loadtests.engine.llama_fleet", "serve",
            "--port", str(port), "--model", str(self.model_path),
            "--slots", str(self.slots), "--ctx-per-slot", str(self.ctx_per_slot),
            "--threads", str(self.threads), "--cache-ram-mib", str(self.cache_ram_mib),
            "--alias", self.alias, "--url-file", str(url_file),
        ]  # fmt: skip


@dataclass(slots=True)
class FleetWorker:
    """One running worker: its child process, its URL once known, its log file."""

    process: subprocess.Popen[bytes]
    url_file: Path
    log_path: Path
    url: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass(slots=True)
class LlamaFleet:
    """K running llama.cpp workers. Build with :meth:`start`; ``urls`` are all healthy."""

    settings: WorkerSettings
    workers: list[FleetWorker] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @classmethod
    def start(
        cls,
        k: int,
        model_path: Path | str,
        *,
        slots: int = 2,
        ctx_per_slot: int = 4096,
        threads: int = 1,
        cache_ram_mib: int = 0,
        base_port: int | None = None,
        log_dir: Path | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> contextlib.AbstractContextManager[LlamaFleet]:
        """Start ``k`` workers, wait for every ``/health``, yield the fleet, stop it on exit.

        See :meth:`launch`; this spells the worker settings as keyword arguments.
        """
        settings = WorkerSettings(
            Path(model_path).resolve(), slots, ctx_per_slot, threads, cache_ram_mib
        )
        return cls.launch(settings, k, base_port, log_dir, startup_timeout_s)

    @classmethod
    @contextlib.contextmanager
    def launch(
        cls,
        settings: WorkerSettings,
        k: int,
        base_port: int | None = None,
        log_dir: Path | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> Iterator[LlamaFleet]:
        """Start ``k`` workers, wait for every ``/health``, yield the fleet, stop it on exit.

        Ports are ``base_port + i``, or chosen by the OS when ``base_port`` is None (no
        race: each worker binds port 0 and reports the address it got). Worker logs go to
        ``log_dir`` (a temporary directory, removed afterwards, when None). Raises
        ``RuntimeError`` if a worker exits or is not healthy within ``startup_timeout_s``;
        the workers already started are stopped first.
        """
        with contextlib.ExitStack() as stack:
            if log_dir is None:
                log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llama-")))
            log_dir.mkdir(parents=True, exist_ok=True)
            fleet = cls(settings)
            stack.callback(fleet.stop)
            for i in range(k):
                port = 0 if base_port is None else base_port + i
                fleet.workers.append(_spawn(settings, port, log_dir / f"worker-{i}"))
            deadline = time.monotonic() + startup_timeout_s
            for worker in fleet.workers:
                _wait_healthy(worker, deadline)
            yield fleet

    def stop(self) -> None:
        """Stop every worker by PID: SIGTERM to all, then SIGKILL to those still alive."""
        stop_all([worker.process for worker in self.workers], STOP_GRACE_S)


def _spawn(settings: WorkerSettings, port: int, stem: Path) -> FleetWorker:
    url_file = stem.with_suffix(".url")
    log_path = stem.with_suffix(".log")
    url_file.unlink(missing_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            settings.serve_args(port, url_file),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C reaches the parent, which stops us
        )
    return FleetWorker(process=process, url_file=url_file, log_path=log_path)


def _wait_healthy(worker: FleetWorker, deadline: float) -> None:
    """Wait for the worker's URL file, then for ``GET /health`` → 200."""

    def healthy() -> bool:
        if not worker.url and worker.url_file.exists():
            worker.url = worker.url_file.read_text().strip()
        return bool(worker.url) and http_ok(worker.url + "/health", 2.0)

    try:
        wait_until(healthy, max(0.0, deadline - time.monotonic()), watch=[worker.process])
    except NotReady as exc:
        state = f"exited with {worker.process.returncode}" if exc.exited else "not healthy in time"
        raise RuntimeError(
            f"llama.cpp worker pid {worker.pid} {state}:\n" + _log_tail(worker.log_path)
        ) from None


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def engine_params(settings: WorkerSettings, port: int) -> object:
    """The ``xllamacpp.CommonParams`` for one worker (field names of xllamacpp 2026.10.11549)."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(settings.model_path)
    params.model_alias = {settings.alias}
    params.n_parallel = settings.slots
    params.n_ctx = settings.slots * settings.ctx_per_slot
    params.kv_unified = False
    params.cache_prompt = True
    params.cache_ram_mib = settings.cache_ram_mib
    params.cpuparams.n_threads = settings.threads
    params.cpuparams_batch.n_threads = settings.threads
    params.n_threads_http = settings.slots + 4  # /health, /metrics stay responsive when busy
    params.endpoint_metrics = True
    params.endpoint_slots = True
    params.endpoint_props = True
    params.ui = False
    params.hostnames = [LOOPBACK]
    params.port = port
    return params


def serve(settings: WorkerSettings, port: int, url_file: Path | None) -> None:
    """Run one worker in this process until SIGTERM/SIGINT or until the parent dies.

    Once listening, writes ``http://127.0.0.1:PORT`` to ``url_file`` (atomically). Exits
    with ``os._exit`` so no native destructor can hang the shutdown.
    """
    import xllamacpp

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    parent = os.getppid()
    server = xllamacpp.Server(engine_params(settings, port))
    url = str(server.listening_address)
    if url_file is not None:
        tmp = url_file.with_suffix(".tmp")
        tmp.write_text(url + "\n")
        tmp.replace(url_file)
    print(f"llama.cpp worker listening on {url}", flush=True)
    while not stop.wait(1.0) and os.getppid() == parent:
        pass
    sys.stdout.flush()
    os._exit(0)


def _run_fleet(
    settings: WorkerSettings, k: int, base_port: int | None, log_dir: Path | None
) -> None:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with LlamaFleet.launch(settings, k, base_port, log_dir) as fleet:
        for worker in fleet.workers:
            print(f"{worker.url} pid={worker.pid} log={worker.log_path}", flush=True)
        print("workers: " + ",".join(fleet.urls), flush=True)
        stop.wait()
    print("stopped", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: a fleet (default) or, with ``serve``, one worker in this process."""
    from loadtests.engine.cli import parse_fleet_args

    args = parse_fleet_args(sys.argv[1:] if argv is None else list(argv))
    settings = WorkerSettings(
        Path(args.model).resolve(),
        args.slots,
        args.ctx_per_slot,
        args.threads,
        args.cache_ram_mib,
        args.alias,
    )
    if args.command == "serve":
        serve(settings, args.port, args.url_file)
    else:
        _run_fleet(settings, args.workers, args.base_port, args.log_dir)


if __name__ == "__main__":
    main()
