"""Token buckets: burst, refill, Retry-After, per principal, bounded memory."""

from __future__ import annotations

import pytest

from gateway.http.ratelimit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refill() -> None:
    clock = Clock()
    limiter = RateLimiter(2.0, 3, clock=clock)
    assert [limiter.take("a") for _ in range(3)] == [None, None, None]
    wait = limiter.take("a")
    assert wait == pytest.approx(0.5)
    assert limiter.take("b") is None  # buckets are per principal
    clock.now += 0.5
    assert limiter.take("a") is None
    assert limiter.take("a") is not None


def test_disabled_admits_everything() -> None:
    limiter = RateLimiter(0.0, 1)
    assert not limiter.enabled
    assert all(limiter.take("a") is None for _ in range(1000))


def test_memory_is_bounded() -> None:
    clock = Clock()
    limiter = RateLimiter(10.0, 5, max_buckets=100, clock=clock)
    for i in range(1000):
        limiter.take(f"p{i}")
        clock.now += 0.01  # 0.5 s (time to refill a burst) later, a bucket is droppable
    assert len(limiter) <= 101


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError):
        RateLimiter(-1.0, 1)
    with pytest.raises(ValueError):
        RateLimiter(1.0, 0)
