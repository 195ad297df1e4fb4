"""Admission control: a concurrency limit with a bounded FIFO queue and a queue timeout.

Contract: ``async with admission.slot():`` (or ``acquire()`` ... ``release()`` when
``limited``) holds one of ``max_concurrent_requests`` slots for the body of the block.
When none is free the request waits in FIFO order; when ``queue_size`` requests already
wait it is refused at once with 429, and when it waited ``queue_timeout_s`` it is refused
with 503; both carry ``Retry-After``. A limit of 0 (or
-1) disables admission entirely: the fast path costs one comparison. A slot freed while
requests wait is handed straight to the oldest waiter, so the count never overshoots.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from gateway.config import AdmissionConfig
from gateway.errors import GatewayError

REJECT_QUEUE_FULL = "queue_full"
REJECT_QUEUE_TIMEOUT = "queue_timeout"


class Admission:
    def __init__(self, config: AdmissionConfig) -> None:
        self._limit = max(0, config.max_concurrent_requests)
        self._queue_size = config.queue_size
        self._timeout = config.queue_timeout_s
        self._active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.rejected: dict[str, int] = {REJECT_QUEUE_FULL: 0, REJECT_QUEUE_TIMEOUT: 0}

    @property
    def limited(self) -> bool:
        """False when admission is off: callers may skip it entirely."""
        return bool(self._limit)

    @property
    def active(self) -> int:
        return self._active

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if not self._limit:
            yield
            return
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        """Take a slot (waiting in the queue); GatewayError 429/503 when refused."""
        if self._active < self._limit and not self._waiters:
            self._active += 1
            return
        if len(self._waiters) >= self._queue_size:
            self.rejected[REJECT_QUEUE_FULL] += 1
            raise GatewayError(
                429, "too many requests: the gateway's queue is full", retry_after=1.0
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self._timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted as we gave up: pass the slot on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                self.rejected[REJECT_QUEUE_TIMEOUT] += 1
                raise GatewayError(
                    503,
                    "the gateway is at capacity: timed out waiting in its queue",
                    retry_after=max(1.0, self._timeout / 10),
                ) from None
            raise

    def release(self) -> None:
        """Give back a slot taken with :meth:`acquire`."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; _active is unchanged
                return
        self._active -= 1
