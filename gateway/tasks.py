"""Background tasks the app owns: kept referenced while they run, cancelled at shutdown.

Contract: :meth:`TaskSet.spawn` starts a coroutine and holds a reference until it ends (so
fire-and-forget work such as ``/abort_request`` is never garbage-collected mid-flight);
:meth:`TaskSet.close` cancels whatever still runs and waits for it. Exceptions of loops
are logged, never silently lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()


async def gather_contained(coros: list[Coroutine[Any, Any, Any]], what: str) -> None:
    """Run ``coros`` together; one that raises is logged (``what``: e.g. "health probe")
    and the others still finish, so one worker's unexpected answer cannot end a loop
    that serves the whole fleet. Cancellation still propagates."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for result in results:
        if isinstance(result, asyncio.CancelledError):
            raise result
        if isinstance(result, BaseException):
            seen = (what, type(result).__name__)
            first = seen not in _REPORTED
            _REPORTED.add(seen)  # logged in full once per kind, then quietly
            log.log(logging.ERROR if first else logging.DEBUG, "%s failed: %r", what,
                    result, exc_info=result if first else None)  # fmt: skip


_REPORTED: set[tuple[str, str]] = set()  # (what, exception type) already logged in full
