"""``python -m gateway --processes 2`` as a real process tree in front of simulated
workers, sharing state on the Redis at 127.0.0.1:6379 (a key prefix of its own, deleted
afterwards): requests succeed on one port, both processes route some of them (each
publishes its recordings to the shared index stream under its own gateway id), a child
killed by PID is restarted, and SIGTERM to the parent stops every process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import redis.asyncio as aioredis

from loadtests.harness.ports import free_port
from loadtests.harness.redis import delete_prefix, redis_answers
from simulator.fleet import SimulatedFleet

pytestmark = pytest.mark.redis

REDIS_URL = "redis://127.0.0.1:6379/0"
Eventually = Callable[..., Awaitable[None]]  # the ``eventually`` fixture (tests/conftest.py)
Entries = list[tuple[bytes, dict[bytes, bytes]]]  # XRANGE's reply
# long enough for several 64-character blocks: recorded in the index, hence published
TEXT = "Explain, step by step and with care, how a prefix cache saves prefill. " * 6


@dataclass
class Tree:
    parent: asyncio.subprocess.Process
    url: str
    prefix: str
    log: Path


def _children(pid: int) -> set[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return set()
    return {int(p) for p in text.split()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "X"


async def _ready(url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, OSError):
        async with (
            aiohttp.ClientSession() as s,
            s.get(url + "/readiness", timeout=aiohttp.ClientTimeout(total=2)) as r,
        ):
            return r.status == 200
    return False


@pytest.fixture
async def tree(
    fleet: SimulatedFleet, tmp_path: Path, eventually: Eventually
) -> AsyncIterator[Tree]:
    if not await redis_answers(REDIS_URL):
        pytest.skip("no Redis on 127.0.0.1:6379")
    prefix = f"itest-mp-{uuid.uuid4().hex[:10]}"
    port = free_port()
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        parent = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "--processes", "2", "--port", str(port),
            "--redis-url", REDIS_URL, "--redis-prefix", prefix, "--policy", "min_ttft",
            "--worker-urls", *fleet.urls,
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    pids: set[int] = set()
    try:
        await eventually(lambda: len(_children(parent.pid)) == 2, 20.0, "two children")
        pids = _children(parent.pid)
        await eventually(lambda: _ready(url), 20.0, "readiness")
        yield Tree(parent, url, prefix, log)
    finally:
        pids |= _children(parent.pid)
        if parent.returncode is None:
            parent.send_signal(signal.SIGKILL)
            await parent.wait()
        for pid in pids:  # by PID: only this test's processes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await delete_prefix(REDIS_URL, prefix)


async def _send(url: str, n: int, tag: str) -> list[int]:
    """``n`` chat requests, each on a new connection (the kernel spreads connections)."""
    statuses = []
    for i in range(n):
        body: dict[str, Any] = {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"{tag} {i}: {TEXT}"}],
        }
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as s,
            s.post(url + "/v1/chat/completions", json=body) as r,
        ):
            await r.read()
            statuses.append(r.status)
    return statuses


async def _publishers(prefix: str) -> set[str]:
    """Gateway ids that published recordings to the shared index stream."""
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        entries = cast(Entries, await client.xrange("{" + prefix + "}:index"))
    finally:
        await client.aclose()
    return {fields[b"g"].decode() for _, fields in entries}


async def test_two_processes_serve_one_port_and_stop_on_sigterm(
    tree: Tree, eventually: Eventually
) -> None:
    assert await _send(tree.url, 24, "first") == [200] * 24
    publishers: set[str] = set()

    async def both_published() -> bool:
        publishers.update(await _publishers(tree.prefix))
        return len(publishers) == 2

    await eventually(both_published, 10.0, "recordings from both processes")
    assert {p.rsplit("-", 1)[1] for p in publishers} == {"0", "1"}
    assert len({p.rsplit("-", 1)[0] for p in publishers}) == 1  # one parent's ids

    children = _children(tree.parent.pid)
    assert len(children) == 2
    tree.parent.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(tree.parent.wait(), 30.0) == 0
    await eventually(lambda: not any(_alive(pid) for pid in children), 10.0, "children gone")
    assert "SIGTERM: stopping the gateway processes" in tree.log.read_text()


async def test_a_killed_process_is_restarted(tree: Tree, eventually: Eventually) -> None:
    before = _children(tree.parent.pid)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        now = _children(tree.parent.pid)
        return len(now) == 2 and victim not in now

    await eventually(replaced, 20.0, "a new child in place of the killed one")
    await eventually(lambda: _ready(tree.url), 20.0, "readiness")
    assert await _send(tree.url, 12, "after") == [200] * 12
    text = tree.log.read_text()
    assert f"(pid {victim}) died (killed by SIGKILL); restarting it" in text
