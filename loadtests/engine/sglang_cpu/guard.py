"""Run SGLang's server in this process; take its whole process group down with the parent.

Run by :mod:`loadtests.engine.sglang_fleet` with SGLang's venv interpreter, by path and
with ``-P`` (so this directory, which holds the ``sgl_kernel`` stand-in's source, is not
put on ``sys.path``)::

    python -P guard.py PARENT_PID [sglang.launch_server arguments...]

The process is started as the leader of a new process group (``start_new_session``);
SGLang's scheduler and detokenizer processes inherit the group. A daemon thread polls
``getppid()`` once a second: when ``PARENT_PID`` (the test run or benchmark that started
the server) is gone, it sends SIGTERM to the group, then SIGKILL 10 s later, so a crashed
run leaves no idle scheduler polling the CPU. Stdlib only (it runs in SGLang's venv).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

KILL_AFTER_S = 10.0


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)
    time.sleep(KILL_AFTER_S)
    os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> None:
    """``argv``: ``[PARENT_PID, *launch_server_args]``; runs until the server exits."""
    if len(argv) < 1 or not argv[0].isdigit():
        sys.exit("usage: guard.py PARENT_PID [launch_server args...]")
    threading.Thread(target=_watch_parent, args=(int(argv[0]),), daemon=True).start()
    sys.argv = ["sglang.launch_server", *argv[1:]]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
