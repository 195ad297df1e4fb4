"""Child processes for tests and benchmarks: start, wait until ready, stop by PID (the one
copy).

Contract:
- :func:`running` starts a process (``subprocess.Popen``; ``log=PATH`` sends its stdout
  and stderr to a file) and stops it on exit with :func:`stop`.
- :func:`stop_all` sends SIGTERM by PID to every process still running (to its process
  group with ``group=True``, for processes started with ``start_new_session``), waits
  until ``grace_s`` after the signal, then SIGKILLs and reaps those still alive.
  :func:`stop` is the same for one process; :func:`kill` is SIGKILL at once (a crash).
- :func:`wait_until` polls a readiness check; it raises :class:`NotReady` as soon as a
  watched process exits, or when the timeout passes.
- :func:`http_get` / :func:`http_ok` probe a URL once (synchronous, bounded);
  :func:`wait_http` polls a URL from async code until it answers 200.
- :func:`cpu_seconds`, :func:`rss_mib`, :func:`open_fds` read a PID's usage (Linux /proc).

Nothing here chooses addresses: callers bind 127.0.0.1 (see :mod:`.ports`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

STOP_GRACE_S = 5.0  # SIGTERM → SIGKILL


class NotReady(RuntimeError):
    """A process did not become ready: ``exited`` is the watched process that exited
    first, or None when the timeout passed."""

    def __init__(self, message: str, exited: subprocess.Popen[Any] | None = None) -> None:
        super().__init__(message)
        self.exited = exited


def _signal(proc: subprocess.Popen[Any], signum: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)


def kill(proc: subprocess.Popen[Any], *, group: bool = False) -> None:
    """SIGKILL by PID (if still running) and reap: the process vanishes as in a crash."""
    if proc.poll() is None:
        _signal(proc, signal.SIGKILL, group)
    proc.wait()


def stop_all(
    procs: Sequence[subprocess.Popen[Any]], grace_s: float = STOP_GRACE_S, *, group: bool = False
) -> None:
    """SIGTERM to every running process, then SIGKILL to those alive ``grace_s`` later."""
    for proc in procs:
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM, group)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill(proc, group=group)


def stop(
    proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S, *, group: bool = False
) -> None:
    """SIGTERM by PID, wait up to ``grace_s``, then SIGKILL; always reaped."""
    stop_all([proc], grace_s, group=group)


@contextlib.contextmanager
def running(
    args: Sequence[str],
    *,
    log: Path | None = None,
    grace_s: float = STOP_GRACE_S,
    group: bool = False,
    **popen: Any,
) -> Iterator[subprocess.Popen[Any]]:
    """Start ``args``; yield the process; stop it by PID on exit (see :func:`stop`).

    ``group=True`` starts it in a new session and signals the whole group. ``log``
    receives stdout and stderr (``popen`` may pass any other ``Popen`` argument).
    """
    with contextlib.ExitStack() as stack:
        if log is not None:
            out = stack.enter_context(log.open("wb"))
            popen = {"stdout": out, "stderr": subprocess.STDOUT, **popen}
        proc = stack.enter_context(subprocess.Popen(list(args), start_new_session=group, **popen))
        try:
            yield proc
        finally:
            stop(proc, grace_s, group=group)


def wait_until(
    ready: Callable[[], bool],
    timeout_s: float,
    *,
    watch: Sequence[subprocess.Popen[Any]] = (),
    interval_s: float = 0.1,
) -> None:
    """Poll ``ready()`` every ``interval_s`` until it is true; raise :class:`NotReady` if a
    process of ``watch`` exits first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        for proc in watch:
            if proc.poll() is not None:
                raise NotReady(f"pid {proc.pid} exited with {proc.returncode}", proc)
        if time.monotonic() > deadline:
            raise NotReady(f"not ready within {timeout_s:g} s")
        time.sleep(interval_s)


def http_get(url: str, timeout_s: float = 2.0) -> bytes | None:
    """The body of a 2xx reply to ``GET url``; None on any other status or error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body: bytes = response.read()
            return body
    except (urllib.error.URLError, OSError):
        return None


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """``GET url`` answers 2xx (urllib raises for every other status)."""
    return http_get(url, timeout_s) is not None


async def wait_http(
    url: str, timeout_s: float, *, interval_s: float = 0.2, request_timeout_s: float = 2.0
) -> bool:
    """Poll ``GET url`` until it answers 200 (True) or ``timeout_s`` passes (False)."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                timeout = aiohttp.ClientTimeout(total=request_timeout_s)
                async with session.get(url, timeout=timeout) as resp:
                    if resp.status == 200:
                        return True
            await asyncio.sleep(interval_s)
    return False


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (Linux /proc; OSError elsewhere)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid`` (Linux /proc)."""
    return len(os.listdir(f"/proc/{pid}/fd"))
