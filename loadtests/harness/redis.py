"""Redis helpers for tests and benchmarks of the shared state (beside ``inprocess``).

Contract:
- :func:`redis_answers` tells whether a Redis server answers at a URL (bounded wait).
- :func:`delete_prefix` removes every key of a ``--redis-prefix`` (tests clean up).
- :class:`PrivateRedis` runs a throw-away ``redis-server`` on a free loopback port with
  no persistence; ``kill()`` stops it by PID (SIGKILL), ``start()`` starts it again on the
  same port. Always ``stop()`` it (the async context manager does).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from types import TracebackType

import redis.asyncio as aioredis

from loadtests.harness.ports import free_port
from loadtests.harness.procs import kill


async def redis_answers(url: str, timeout_s: float = 0.5) -> bool:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout_s)
    try:
        return bool(await asyncio.wait_for(client.ping(), timeout_s))
    except (OSError, TimeoutError, aioredis.RedisError):
        return False
    finally:
        await client.aclose()


async def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under the shared state's hash tag for ``prefix``."""
    client = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match="{" + prefix + "}*", count=500)]
        if keys:
            await client.delete(*keys)
        return len(keys)
    finally:
        await client.aclose()


class PrivateRedis:
    """A private ``redis-server`` subprocess on 127.0.0.1 (see the module contract)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def _spawn(self) -> None:
        args = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--loglevel", "warning",
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def start(self, ready_within_s: float = 5.0) -> None:
        """Start the server (again, on the same port) and wait until it answers."""
        self._spawn()
        deadline = asyncio.get_running_loop().time() + ready_within_s
        while not await redis_answers(self.url, 0.2):
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL by PID and reap: the server vanishes as in a crash."""
        proc, self._proc = self._proc, None
        if proc is not None:
            kill(proc)

    def stop(self) -> None:
        self.kill()

    async def __aenter__(self) -> PrivateRedis:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
