"""One timer per event loop for many watched things, instead of one timer per request.

Both watches of the request path use it: the relay's client-stall watch (a client that
stops reading) and the upstream's idle watch (a worker that falls silent). Each member
is asked :meth:`Watched.tick` every ``period_s`` by one ``call_later`` chain that runs
only while some member is watched; a member answering False leaves. A watch with limit
``L`` checked every ``L / 4`` thus acts between 1x and 1.25x ``L`` after its condition
began, as a timer per request would have at exactly 1x, for a timer per loop rather
than a ``call_later`` and a cancel per request. Tickers are keyed by loop and period, so
members with the same period share one; a closed loop's tickers are dropped when the
next one is made (tests run many loops).

Not thread-safe; one event loop per ticker.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar, Protocol


class Watched(Protocol):
    """A member: ``tick(now)`` checks it at loop time ``now``; False: stop watching it."""

    def tick(self, now: float) -> bool: ...


class LoopTicker:
    """The members of one loop with one period (module contract)."""

    __slots__ = ("_loop", "_period", "_timer", "members")
    _running: ClassVar[dict[tuple[asyncio.AbstractEventLoop, float], LoopTicker]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop, period_s: float) -> None:
        self._loop = loop
        self._period = period_s
        self._timer: asyncio.TimerHandle | None = None
        self.members: set[Watched] = set()

    @classmethod
    def watch(cls, member: Watched, period_s: float) -> LoopTicker:
        """Watch ``member`` on the running loop's ticker of ``period_s`` (made if none)."""
        loop = asyncio.get_running_loop()
        ticker = cls._running.get((loop, period_s))
        if ticker is None:
            for key in [k for k in cls._running if k[0].is_closed()]:
                del cls._running[key]
            ticker = cls._running[(loop, period_s)] = cls(loop, period_s)
        ticker.members.add(member)
        if ticker._timer is None:
            ticker._timer = loop.call_later(period_s, ticker._tick)
        return ticker

    def discard(self, member: Watched) -> None:
        self.members.discard(member)

    def _tick(self) -> None:
        self._timer = None
        now = self._loop.time()
        for member in list(self.members):
            if member in self.members and not member.tick(now):
                self.members.discard(member)
        if self.members:
            self._timer = self._loop.call_later(self._period, self._tick)
        else:
            self._running.pop((self._loop, self._period), None)
