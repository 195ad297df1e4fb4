"""Several gateway processes on one host: ``server.processes`` (``--processes N``) > 1.

One Python process routes on one core. With N > 1 the command starts a parent that forks
N children, each a whole gateway (``gateway.cli`` runs it), all listening on the same
host and port with ``SO_REUSEPORT``: the kernel spreads incoming connections over them
(by a hash of the connection's addresses, so one kept-alive connection stays with one
process). They share the prefix index, the per-worker load and the worker set through
the Redis shared state (``docs/SHARED_STATE.md``), which is why N > 1 needs ``redis.url``
(the configuration refuses it otherwise); each child is its own gateway there, with the
id ``<redis.gateway_id or a random one>-<i>`` (i = 0..N-1).

Contract:
- :func:`supervise` is called in the parent before any event loop or thread exists (a
  fork is safe then, uvloop included: each child builds its own loop after the fork).
  It blocks SIGINT, SIGTERM, SIGHUP and SIGCHLD in the parent and waits for them with
  ``sigtimedwait``; each child restores the signal mask at once and runs ``run(i,
  config_i)``, leaving with its return value (``os._exit``: it never returns into the
  parent's code). Before forking, the parent collects garbage and freezes what is left
  (``gc.freeze``): objects made at start-up are then never walked by the children's
  collectors, and their memory pages stay shared.
- SIGTERM or SIGINT to the parent is passed to every child, which drains as a single
  gateway does (``server.shutdown_grace_s``); the parent waits for them up to the grace
  plus :data:`STOP_MARGIN_S`, SIGKILLs any still running, and returns 0 when every child
  exited 0, else 1. SIGHUP is passed on (each child re-reads its policy section).
- A child that dies (any exit while the parent is not stopping) is reported (a warning
  naming its index, PID and exit status) and restarted with the same index and gateway
  id; after more than :data:`MAX_RESTARTS` deaths within :data:`RESTART_WINDOW_S` (a
  child that cannot start: the port taken, Redis refusing), the parent stops the others
  and returns 1.

Linux only (``SO_REUSEPORT``'s spreading, ``sigtimedwait``). Per process, not shared:
``/metrics`` and ``/debug/decisions`` (a scrape or a call reaches one process: the one
its connection landed on), admission limits, rate limits, health probes and load polls
(each process probes every worker).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from gateway.config import GatewayConfig

log = logging.getLogger(__name__)

MAX_RESTARTS = 5  # deaths tolerated within RESTART_WINDOW_S, then the parent gives up
RESTART_WINDOW_S = 60.0
STOP_MARGIN_S = 5.0  # beyond the children's shutdown grace, before SIGKILL
_POLL_S = 1.0  # sigtimedwait's bound: children are reaped at least this often
_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD})

ChildMain = Callable[[int, GatewayConfig], int]


def child_configs(config: GatewayConfig, base_id: str | None = None) -> list[GatewayConfig]:
    """One config per process: the same, each with its own ``redis.gateway_id``."""
    base = config.redis.gateway_id or base_id or uuid.uuid4().hex[:8]
    return [
        replace(config, redis=replace(config.redis, gateway_id=f"{base}-{i}"))
        for i in range(config.server.processes)
    ]


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


class _Supervisor:
    """The parent's state: which PID runs which child, and when children died."""

    def __init__(self, configs: list[GatewayConfig], run: ChildMain, mask: set[int]) -> None:
        self._configs = configs
        self._run = run
        self._mask = mask  # the signal mask before the parent blocked its signals
        self.children: dict[int, int] = {}  # pid -> index
        self._deaths: deque[float] = deque()
        self._failed = False  # a child exited non-zero, or was killed, while stopping

    def spawn(self, index: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
                code = self._run(index, self._configs[index])
            except KeyboardInterrupt:
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                log.exception("gateway process %d failed", index)
            finally:
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.children[pid] = index

    def signal_all(self, signum: int) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def reap(self, stopping: bool) -> bool:
        """Collect exited children; unless ``stopping``, report and restart each one.
        False when they die too often (the caller then stops)."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                break
            if pid == 0:
                break
            index = self.children.pop(pid, None)
            if index is None:
                continue
            if stopping:
                if status != 0:
                    self._failed = True
                    log.warning("gateway process %d (pid %d): %s", index, pid, _status(status))
                continue
            now = time.monotonic()
            self._deaths.append(now)
            while self._deaths and now - self._deaths[0] > RESTART_WINDOW_S:
                self._deaths.popleft()
            if len(self._deaths) > MAX_RESTARTS:
                log.error(
                    "gateway process %d (pid %d) died (%s): %d deaths within %.0f s, "
                    "stopping the others",
                    index, pid, _status(status), len(self._deaths), RESTART_WINDOW_S,
                )  # fmt: skip
                return False
            log.warning(
                "gateway process %d (pid %d) died (%s); restarting it", index, pid, _status(status)
            )
            self.spawn(index)
        return True

    def stop(self, signum: int, grace_s: float) -> int:
        """Pass ``signum`` on, wait for every child (then SIGKILL), return the exit code."""
        self.signal_all(signum)
        deadline = time.monotonic() + grace_s + STOP_MARGIN_S
        while self.children:
            self.reap(stopping=True)
            left = deadline - time.monotonic()
            if not self.children or left <= 0:
                break
            signal.sigtimedwait({signal.SIGCHLD}, min(left, _POLL_S))
        if self.children:
            log.error("gateway processes %s still running: SIGKILL", sorted(self.children))
            self._failed = True
            self.signal_all(signal.SIGKILL)
            while self.children:
                pid, _ = os.waitpid(-1, 0)
                self.children.pop(pid, None)
        return 1 if self._failed else 0


def supervise(config: GatewayConfig, run: ChildMain) -> int:
    """Fork ``server.processes`` children running ``run`` and look after them until a
    signal stops them (module contract); returns the parent's exit code."""
    if not hasattr(signal, "sigtimedwait") or not hasattr(socket, "SO_REUSEPORT"):
        log.error("server.processes > 1 (--processes) needs Linux (sigtimedwait, SO_REUSEPORT)")
        return 2
    configs = child_configs(config)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        gc.collect()
        gc.freeze()
        supervisor = _Supervisor(configs, run, mask)
        for index in range(len(configs)):
            supervisor.spawn(index)
        log.info(
            "%d gateway processes on http://%s:%d (pids %s), gateway ids %s",
            len(configs),
            config.server.host,
            config.server.port,
            " ".join(str(pid) for pid in supervisor.children),
            " ".join(c.redis.gateway_id or "" for c in configs),
        )
        while True:
            info = signal.sigtimedwait(_SIGNALS, _POLL_S)
            signum = None if info is None else info.si_signo
            if signum in (signal.SIGTERM, signal.SIGINT):
                log.info("%s: stopping the gateway processes", signal.Signals(signum).name)
                return supervisor.stop(signum, config.server.shutdown_grace_s)
            if signum == signal.SIGHUP:
                supervisor.signal_all(signal.SIGHUP)
            if not supervisor.reap(stopping=False):
                supervisor.stop(signal.SIGTERM, config.server.shutdown_grace_s)
                return 1
    finally:
        # a signal still pending (a second SIGTERM while stopping) must not end the
        # parent once unblocked: it has been answered
        while signal.sigtimedwait(_SIGNALS, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
