"""Shared test configuration: a simulated fleet and a client session, in-process on
loopback (the gateway itself is started per test with
``loadtests.harness.inprocess.run_gateway``), and ``eventually``, which waits on a
condition with a wide, bounded margin (the machine is shared)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
import pytest

if TYPE_CHECKING:
    from simulator.fleet import SimulatedFleet


@pytest.fixture
async def fleet() -> AsyncIterator[SimulatedFleet]:
    """Three simulated SGLang workers at speed 50."""
    from simulator.fleet import SimConfig, SimulatedFleet

    async with await SimulatedFleet.start(3, SimConfig(speed=50.0)) as f:
        yield f


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


Check = Callable[[], bool | Awaitable[bool]]
Eventually = Callable[..., Awaitable[None]]


@pytest.fixture
def eventually() -> Eventually:
    """``await eventually(check, within_s, what)``: see :func:`wait_until`."""
    return wait_until


async def wait_until(check: Check, within_s: float = 5.0, what: str = "") -> None:
    """Poll ``check`` every 20 ms until it holds; fail after ``within_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert loop.time() < deadline, f"condition never held within {within_s} s: {what}"
        await asyncio.sleep(0.02)
