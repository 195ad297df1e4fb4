"""The load-test harness's one copy of ports, processes and percentiles."""

from __future__ import annotations

import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import pytest

from loadtests.harness.ports import free_port, free_port_range, free_ports
from loadtests.harness.procs import NotReady, http_ok, running, stop_all, wait_until
from loadtests.harness.stats import percentile

# --- percentiles: each method is the formula its callers had before (published figures) ---


def _old_linear(values: Sequence[float], p: float) -> float:  # replay metrics' percentile
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _old_nearest(values: Sequence[float], q: float) -> float:  # bench.report's quantile
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _old_upper(values: Sequence[float], q: float) -> float:  # multi_gateway, kv_events, ...
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _old_lower(values: Sequence[float], q: float) -> float:  # micro.simulator's p99
    ordered = sorted(values)
    return ordered[int(len(ordered) * q) - 1]


@pytest.mark.parametrize("p", [50, 90, 99])
def test_percentile_methods_reproduce_the_former_copies_bit_for_bit(p: int) -> None:
    rng = random.Random(p)
    q = {50: 0.5, 90: 0.9, 99: 0.99}[p]  # the literals the callers passed
    for n in [*range(1, 260), 700, 1000, 4321]:
        values = [rng.lognormvariate(-2, 1) for _ in range(n)]
        assert percentile(values, p, "linear") == _old_linear(values, p)
        assert percentile(values, p, "nearest") == _old_nearest(values, q)
        assert percentile(values, p, "upper") == _old_upper(values, q)
        assert percentile(values, p, "lower") == _old_lower(values, q)


def test_percentile_methods_differ_where_documented() -> None:
    values = [float(v) for v in range(1, 101)]  # q*n whole: upper is one rank above nearest
    assert percentile(values, 99, "nearest") == 99.0
    assert percentile(values, 99, "upper") == 100.0
    assert percentile(values, 99, "lower") == 99.0
    assert percentile(values, 99, "linear") == pytest.approx(99.01)
    values = values[:50]  # q*n = 49.5: lower is one rank below nearest
    assert percentile(values, 99, "nearest") == percentile(values, 99, "upper") == 50.0
    assert percentile(values, 99, "lower") == 49.0


def test_percentile_edges() -> None:
    for method in ("linear", "nearest", "upper", "lower"):
        assert math.isnan(percentile([], 50, method))
        assert percentile([7.0], 90, method) == 7.0
        assert percentile([3.0, 1.0, 2.0], 100, method) == 3.0
    assert percentile([3.0, 1.0, 2.0], 0, "linear") == 1.0
    with pytest.raises(ValueError):
        percentile([1.0], 50, "median")  # type: ignore[arg-type]


# --- ports -----------------------------------------------------------------------------


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))


def test_free_port_range_is_consecutive_and_bindable() -> None:
    base = free_port_range(4)
    socks = [socket.socket() for _ in range(4)]
    try:
        for i, sock in enumerate(socks):
            sock.bind(("127.0.0.1", base + i))
    finally:
        for sock in socks:
            sock.close()


# --- processes ---------------------------------------------------------------------------

IGNORE_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def test_running_stops_by_sigterm() -> None:
    with running([sys.executable, "-c", "import time; time.sleep(60)"]) as proc:
        assert proc.poll() is None
    assert proc.returncode == -signal.SIGTERM


def test_stop_kills_what_ignores_sigterm_after_the_grace() -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", IGNORE_SIGTERM], stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    started = time.monotonic()
    stop_all(procs, grace_s=0.5)
    elapsed = time.monotonic() - started
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    assert 0.4 < elapsed < 5.0  # one shared grace period, not one per process
    for proc in procs:
        assert proc.stdout is not None
        proc.stdout.close()


def test_running_in_its_own_group_stops_the_group() -> None:
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
        "'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"  # fmt: skip
    with running(
        [sys.executable, "-c", child], group=True, stdout=subprocess.PIPE, grace_s=2.0
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        pgid = proc.pid
    with pytest.raises(ProcessLookupError):  # the whole group is gone, grandchild included
        for _ in range(50):
            os.killpg(pgid, 0)
            time.sleep(0.1)


def test_wait_until_reports_an_exit_or_the_timeout() -> None:
    with running([sys.executable, "-c", "raise SystemExit(3)"]) as proc:
        with pytest.raises(NotReady) as info:
            wait_until(lambda: False, 10.0, watch=[proc], interval_s=0.01)
        assert info.value.exited is proc and proc.returncode == 3
    with pytest.raises(NotReady) as info:
        wait_until(lambda: False, 0.05, interval_s=0.01)
    assert info.value.exited is None
    wait_until(lambda: True, 0.0)


def test_http_ok_is_false_when_nothing_listens() -> None:
    assert not http_ok(f"http://127.0.0.1:{free_port()}/health", 0.5)
