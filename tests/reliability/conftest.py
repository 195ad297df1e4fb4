"""Fault-injection helpers that wait on a condition with a wide, bounded margin (the
machine is shared); the fleet and client fixtures are tests/conftest.py's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

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
