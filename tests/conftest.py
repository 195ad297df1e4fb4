"""Shared test configuration: a simulated fleet and a client session, in-process on
loopback (the gateway itself is started per test with
``loadtests.harness.inprocess.run_gateway``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
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
