"""A fleet-wide loop survives one worker's unexpected exception."""

from __future__ import annotations

import asyncio

import pytest

from gateway.tasks import gather_contained


async def test_one_failure_does_not_stop_the_others() -> None:
    done: list[int] = []

    async def ok(i: int) -> None:
        await asyncio.sleep(0)
        done.append(i)

    async def bad() -> None:
        raise OverflowError("a worker's figure")

    await gather_contained([ok(1), bad(), ok(2)], "load poll")  # does not raise
    assert sorted(done) == [1, 2]


async def test_cancellation_still_propagates() -> None:
    async def cancelled() -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await gather_contained([cancelled()], "health probe")
