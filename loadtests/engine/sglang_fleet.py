"""Start K real SGLang 0.5.23 servers on the CPU, on 127.0.0.1, and stop them by PID.

Each server is ``python -P sglang_cpu/guard.py PARENT sglang.launch_server ARGS`` run by
SGLang's own venv (:mod:`loadtests.engine.sglang_install`), as the leader of a new process
group: SGLang runs three processes per server (HTTP/tokenizer, scheduler, detokenizer),
so it is stopped as a group (SIGTERM, then SIGKILL after ``STOP_GRACE_S``); the guard
also takes the group down by itself when the starting process dies. The flags are the
ones that serve on a CPU-only machine (``docs/REAL_ENGINE.md``, "Real SGLang on the
CPU")::

    --device cpu --page-size 16 --mem-fraction-static 0.05 --max-total-tokens N
    --disable-cuda-graph --disable-overlap-schedule --attention-backend torch_native
    --sampling-backend pytorch            (and SGLANG_USE_CPU_ENGINE=1)

plus ``--enable-metrics --enable-cache-report`` (what the gateway reads) and, when asked,
``--kv-events-config`` with a publisher on a free port. A server takes about 20-30 s to
be ready (``GET /health`` → 200, which runs a real one-token generation), about 2.2 GB
of RAM, and its idle scheduler polls: keep at most two running on this machine, and stop
them as soon as they are not needed.

Python API (synchronous; from async code start it before the loop or in a thread)::

    env = ensure_sglang()
    model = ensure_sglang_model(cache_dir, env.python)
    with SGLangFleet.start(2, SGLangSettings(env.python, model)) as fleet:
        fleet.urls          # ['http://127.0.0.1:41234', ...], every /health answered 200
        fleet.servers[0].kv_port

CLI (Ctrl-C stops)::

    python -m loadtests.engine.sglang_fleet --servers 2 [--max-total-tokens 8192] [--kv-events]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loadtests.harness.ports import LOOPBACK, free_ports
from loadtests.harness.procs import NotReady, http_ok, stop_all, wait_until

STOP_GRACE_S = 15.0  # SIGTERM → SIGKILL, per group
DEFAULT_STARTUP_TIMEOUT_S = 240.0
SERVED_MODEL_NAME = "tiny-llama-hf"
GUARD = Path(__file__).resolve().parent / "sglang_cpu" / "guard.py"
# The flags that serve on a CPU without CUDA (besides --max-total-tokens and the port).
CPU_FLAGS: tuple[str, ...] = (
    "--device", "cpu",
    "--mem-fraction-static", "0.05",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SGLangSettings:
    """How every server of a fleet is configured.

    ``kv_events``: None (no publisher), ``"bind"`` (the publisher binds
    ``tcp://127.0.0.1:PORT`` with ``"bind": true``, plus a replay ROUTER) or ``"connect"``
    (``"endpoint": "tcp://127.0.0.1:PORT"`` without ``bind``: SGLang then *connects* its
    PUB socket there, so a subscriber must bind that address).
    """

    python: Path
    model_path: Path
    max_total_tokens: int = 8192
    page_size: int = 16
    served_model_name: str = SERVED_MODEL_NAME
    kv_events: str | None = None
    kv_topic: str = "kv"
    extra_args: tuple[str, ...] = ()

    def kv_events_config(self, port: int, replay_port: int) -> str | None:
        """The ``--kv-events-config`` JSON for a server publishing on ``port``."""
        if self.kv_events is None:
            return None
        endpoint = f"tcp://{LOOPBACK}:{port}"
        config: dict[str, Any] = {"publisher": "zmq", "endpoint": endpoint, "topic": self.kv_topic}
        if self.kv_events == "bind":
            config["bind"] = True
            config["replay_endpoint"] = f"tcp://{LOOPBACK}:{replay_port}"
        elif self.kv_events != "connect":
            raise ValueError(f"kv_events must be None, 'bind' or 'connect', not {self.kv_events!r}")
        return json.dumps(config, separators=(",", ":"))

    def server_args(self, port: int, kv_port: int, replay_port: int) -> list[str]:
        """``sglang.launch_server`` arguments for one server."""
        args = [
            "--model-path", str(self.model_path),
            "--served-model-name", self.served_model_name,
            "--host", LOOPBACK, "--port", str(port),
            "--page-size", str(self.page_size),
            "--max-total-tokens", str(self.max_total_tokens),
            *CPU_FLAGS,
            "--enable-metrics", "--enable-cache-report",
            "--log-level", "warning",
        ]  # fmt: skip
        kv = self.kv_events_config(kv_port, replay_port)
        if kv is not None:
            args += ["--kv-events-config", kv]
        return [*args, *self.extra_args]


def server_env() -> dict[str, str]:
    """The environment of a server: ours plus ``SGLANG_USE_CPU_ENGINE=1``, one thread for
    tokenizers, and no ``PYTHONPATH`` (the project must not shadow SGLang's imports)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SGLANG_USE_CPU_ENGINE="1", TOKENIZERS_PARALLELISM="false")
    return env


@dataclass(slots=True)
class SGLangServer:
    """One running server: its process group leader, URL, ports and log file."""

    process: subprocess.Popen[bytes]
    url: str
    port: int
    kv_port: int
    replay_port: int
    log_path: Path
    kv_events_config: str | None

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass(slots=True)
class SGLangFleet:
    """K running SGLang servers. Build with :meth:`start`; ``urls`` are all healthy."""

    settings: SGLangSettings
    servers: list[SGLangServer] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @classmethod
    @contextlib.contextmanager
    def start(
        cls,
        k: int,
        settings: SGLangSettings,
        *,
        log_dir: Path | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        per_server: Sequence[SGLangSettings] | None = None,
    ) -> Iterator[SGLangFleet]:
        """Start ``k`` servers at once, wait for every ``GET /health`` → 200, yield the
        fleet, stop every server's process group on exit.

        ``per_server`` (length ``k``) overrides ``settings`` server by server (say one
        binding KV-event publisher and one connecting). Logs go to ``log_dir/server-i.log``
        (a temporary directory, removed afterwards, when None). Raises ``RuntimeError``
        with the log's tail if a server exits or is not ready within
        ``startup_timeout_s``; the servers already started are stopped first.
        """
        if per_server is not None and len(per_server) != k:
            raise ValueError("per_server must have one settings object per server")
        with contextlib.ExitStack() as stack:
            if log_dir is None:
                log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sglang-")))
            log_dir.mkdir(parents=True, exist_ok=True)
            fleet = cls(settings)
            stack.callback(fleet.stop)
            ports = free_ports(3 * k)
            for i in range(k):
                own = per_server[i] if per_server is not None else settings
                http, kv, replay = ports[3 * i : 3 * i + 3]
                fleet.servers.append(_spawn(own, http, kv, replay, log_dir / f"server-{i}.log"))
            deadline = time.monotonic() + startup_timeout_s
            for server in fleet.servers:
                _wait_ready(server, deadline)
            yield fleet

    def stop(self) -> None:
        """Stop every server by process group: SIGTERM, then SIGKILL after the grace."""
        stop_all([s.process for s in self.servers], STOP_GRACE_S, group=True)


def _spawn(
    settings: SGLangSettings, port: int, kv_port: int, replay_port: int, log_path: Path
) -> SGLangServer:
    args = [str(settings.python), "-P", str(GUARD), str(os.getpid())]
    args += settings.server_args(port, kv_port, replay_port)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(),
            cwd=log_path.parent,
            start_new_session=True,  # one group per server: stopped together
        )
    return SGLangServer(
        process=process,
        url=f"http://{LOOPBACK}:{port}",
        port=port,
        kv_port=kv_port,
        replay_port=replay_port,
        log_path=log_path,
        kv_events_config=settings.kv_events_config(kv_port, replay_port),
    )


def _wait_ready(server: SGLangServer, deadline: float) -> None:
    try:
        wait_until(
            lambda: http_ok(server.url + "/health", 10.0),
            max(0.0, deadline - time.monotonic()),
            watch=[server.process],
            interval_s=0.5,
        )
    except NotReady as exc:
        state = f"exited with {server.process.returncode}" if exc.exited else "not ready in time"
        raise RuntimeError(
            f"SGLang server pid {server.pid} {state}:\n" + log_tail(server.log_path)
        ) from None


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a server log (long lines cut), for error messages."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return "\n".join(line[:400] for line in text)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: install if needed, start the servers, print their URLs, run until Ctrl-C."""
    from loadtests.engine.sglang_install import ensure_sglang
    from loadtests.engine.sglang_model import ensure_sglang_model
    from loadtests.engine.tiny_model import default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--kv-events", choices=("bind", "connect"), default=None)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    env = ensure_sglang()
    model = ensure_sglang_model(default_cache_dir(), env.python)
    settings = SGLangSettings(env.python, model.resolve(), args.max_total_tokens)
    settings = replace(settings, kv_events=args.kv_events)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with SGLangFleet.start(args.servers, settings, log_dir=args.log_dir) as fleet:
        for s in fleet.servers:
            print(f"{s.url} pid={s.pid} kv={s.kv_events_config} log={s.log_path}", flush=True)
        print(f"model: {model.resolve()}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
