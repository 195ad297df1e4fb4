"""Fixtures of the hostile tests (``scripted_worker`` holds the worker itself)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from scripted_worker import Answer, ScriptedWorker, StartWorker


@pytest.fixture
async def scripted() -> AsyncIterator[StartWorker]:
    """``await scripted(answer)`` starts a scripted worker; all are stopped at the end."""
    workers: list[ScriptedWorker] = []

    async def start(answer: Answer) -> ScriptedWorker:
        worker = ScriptedWorker(answer)
        worker.server = await asyncio.start_server(worker._serve, "127.0.0.1", 0)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        assert worker.server is not None
        worker.server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2):
                await worker.server.wait_closed()
