"""Per-principal token buckets: requests per second with a burst, refused with 429.

Contract: :meth:`RateLimiter.take` spends one token of ``principal``'s bucket and returns
``None``, or returns the seconds until a token will be there (the caller answers 429 with
that as ``Retry-After``). A bucket holds at most ``burst`` tokens and refills at
``rate_per_s``; a principal seen for the first time starts full. A rate of 0 disables the
limiter (``enabled`` is False, :meth:`take` always admits). Memory is bounded: past
``max_buckets`` principals, buckets that are full again (idle long enough to have
refilled) are dropped, which loses nothing since a new bucket starts full.
:meth:`RateLimiter.wait` looks without spending (the gateway's bound on failed key checks
spends only on a failure, and looks before every check).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RateLimiter:
    __slots__ = ("_buckets", "_burst", "_clock", "_max", "_rate")

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        max_buckets: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_per_s < 0 or burst < 1:
            raise ValueError("rate_per_s must be >= 0 and burst >= 1")
        self._rate = rate_per_s
        self._burst = float(burst)
        self._max = max_buckets
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # principal -> (tokens, at)

    @property
    def enabled(self) -> bool:
        return self._rate > 0

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, principal: str) -> float | None:
        """Spend a token; None when admitted, else seconds until one is available."""
        if not self._rate:
            return None
        now = self._clock()
        tokens, at = self._buckets.get(principal, (self._burst, now))
        tokens = min(self._burst, tokens + (now - at) * self._rate)
        if tokens >= 1.0:
            self._buckets[principal] = (tokens - 1.0, now)
            if len(self._buckets) > self._max:
                self._prune(now)
            return None
        self._buckets[principal] = (tokens, now)
        return (1.0 - tokens) / self._rate

    def wait(self, principal: str) -> float | None:
        """Like :meth:`take` but spends nothing: None when a token is there (or the
        principal is unknown), else the seconds until one is."""
        entry = self._buckets.get(principal) if self._rate else None
        if entry is None:
            return None
        tokens, at = entry
        tokens = min(self._burst, tokens + (self._clock() - at) * self._rate)
        return None if tokens >= 1.0 else (1.0 - tokens) / self._rate

    def _prune(self, now: float) -> None:
        full_after = self._burst / self._rate
        stale = [p for p, (_, at) in self._buckets.items() if now - at >= full_after]
        for principal in stale:
            del self._buckets[principal]
