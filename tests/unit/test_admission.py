"""Admission: concurrency limit, FIFO queue, 429 when full, 503 after the timeout."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import AdmissionConfig
from gateway.errors import GatewayError
from gateway.http.admission import Admission


async def _hold(adm: Admission, entered: list[int], i: int, release: asyncio.Event) -> None:
    async with adm.slot():
        entered.append(i)
        await release.wait()


async def test_unlimited_by_default() -> None:
    adm = Admission(AdmissionConfig())
    async with adm.slot(), adm.slot():
        assert adm.active == 0  # the fast path counts nothing


async def test_limit_queue_and_fifo() -> None:
    adm = Admission(AdmissionConfig(max_concurrent_requests=2, queue_size=5, queue_timeout_s=10))
    release = asyncio.Event()
    entered: list[int] = []
    tasks = [asyncio.create_task(_hold(adm, entered, i, release)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert entered == [0, 1] and adm.active == 2 and adm.waiting == 3
    release.set()
    await asyncio.gather(*tasks)
    assert entered == [0, 1, 2, 3, 4]
    assert adm.active == 0 and adm.waiting == 0


async def test_queue_full_is_429_with_retry_after() -> None:
    adm = Admission(AdmissionConfig(max_concurrent_requests=1, queue_size=1, queue_timeout_s=10))
    release = asyncio.Event()
    entered: list[int] = []
    tasks = [asyncio.create_task(_hold(adm, entered, i, release)) for i in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(GatewayError) as info:
        async with adm.slot():
            pass
    assert info.value.status == 429 and info.value.retry_after
    release.set()
    await asyncio.gather(*tasks)
    assert adm.rejected["queue_full"] == 1


async def test_queue_timeout_is_503_and_frees_the_place() -> None:
    adm = Admission(AdmissionConfig(max_concurrent_requests=1, queue_size=1, queue_timeout_s=0.05))
    release = asyncio.Event()
    holder = asyncio.create_task(_hold(adm, [], 0, release))
    await asyncio.sleep(0.01)
    with pytest.raises(GatewayError) as info:
        async with adm.slot():
            pass
    assert info.value.status == 503 and info.value.retry_after
    assert adm.waiting == 0
    release.set()
    await holder
    assert adm.active == 0
    async with adm.slot():
        assert adm.active == 1


async def test_cancelled_waiter_leaves_queue() -> None:
    adm = Admission(AdmissionConfig(max_concurrent_requests=1, queue_size=2, queue_timeout_s=10))
    release = asyncio.Event()
    holder = asyncio.create_task(_hold(adm, [], 0, release))
    await asyncio.sleep(0.01)
    waiter = asyncio.create_task(_hold(adm, [], 1, asyncio.Event()))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.waiting == 0
    release.set()
    await holder
    assert adm.active == 0
