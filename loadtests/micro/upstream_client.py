"""The request path's HTTP client, measured: the gateway's pool (llhttp via httptools)
against aiohttp's ``ClientSession``, per request, on one event loop.

    python -m loadtests.micro.upstream_client [--requests 20000] [--concurrency 16]

A canned worker on 127.0.0.1 (a bare ``asyncio.Protocol``: it answers each request head
with fixed bytes, far cheaper than either client) answers a non-streamed JSON body
(``Content-Length``) and an SGLang-like stream (chunked, 10 events). The process's CPU
time over ``--requests`` requests, at ``--concurrency`` in flight, is divided by the
requests; the worker's share is the same in every column, so the difference is the
clients'. uvloop when installed, as the gateway runs. Used to choose the parser for
issue 16 (BENCHMARKS.md, "Upstream parser").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp

from gateway.forward.upstream import UpstreamPool

_JSON = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"content":"hi"}}]}'
_EVENTS = [b'data: {"choices":[{"delta":{"content":"tok%d"}}]}\n\n' % i for i in range(9)]
_EVENTS.append(b"data: [DONE]\n\n")


def _answers() -> dict[bytes, bytes]:
    plain = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    stream = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    stream += b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in _EVENTS) + b"0\r\n\r\n"
    return {b"/plain": plain % (len(_JSON), _JSON), b"/stream": stream}


class _Canned(asyncio.Protocol):
    """Answers every request (head, then a Content-Length body) with canned bytes."""

    answers = _answers()

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end]
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            path = head.split(b" ", 2)[1]
            assert self.transport is not None
            self.transport.write(self.answers[path])


async def _run(
    one: Callable[[], Awaitable[None]], requests: int, concurrency: int
) -> tuple[float, float]:
    """(CPU µs per request, requests per second)."""
    for _ in range(200):  # warm-up: connections opened, caches filled
        await one()
    left = requests

    async def loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu * 1e6 / requests, requests / wall


async def _measure(args: argparse.Namespace) -> list[tuple[str, str, float, float]]:
    server = await asyncio.get_running_loop().create_server(_Canned, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    headers = [("Content-Type", "application/json"), ("x-request-id", "r" * 32)]
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    pool = UpstreamPool(5.0, read_idle_timeout_s=120.0)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=256),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
    )
    rows = []
    try:
        for path in ("/plain", "/stream"):

            async def ours(path: str = path) -> None:
                deadline = asyncio.get_running_loop().time() + 30
                resp = await pool.request(url, path, headers, body, deadline)
                while await resp.readany():
                    pass

            async def theirs(path: str = path) -> None:
                async with session.post(url + path, data=body, headers=dict(headers)) as resp:
                    async for _ in resp.content.iter_any():
                        pass

            for name, one in (
                ("gateway pool (httptools)", ours),
                ("aiohttp ClientSession", theirs),
            ):
                cpu, rps = await _run(one, args.requests, args.concurrency)
                rows.append((name, path.strip("/"), cpu, rps))
    finally:
        await pool.close()
        await session.close()
        server.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.micro.upstream_client")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        import uvloop

        runner: Callable[..., list[tuple[str, str, float, float]]] = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        runner = asyncio.run
    rows = runner(_measure(args))
    print("| client | answer | CPU µs/request (client + canned worker) | requests/s |")
    print("|---|---|---|---|")
    for name, kind, cpu, rps in rows:
        print(f"| {name} | {kind} | {cpu:,.0f} | {rps:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
