"""A stream past ``data: [DONE]`` (``gateway.forward.relay``): a worker that goes on after
it (more events, silence, a split sentinel) holds neither the lease nor the client's
response; a client that leaves after it is a complete request, one that leaves before it
a 499 with the worker aborted; shutdown does not wait on a worker's tail. Also a
client-named LoRA adapter's control characters never reach a log line raw."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
import pytest
from scripted_worker import Exchange, ScriptedWorker, StartWorker
from test_lora_red_team import LoraWorker, chat
from test_lora_red_team import gateway as lora_gateway
from test_lora_red_team import post as lora_post

from gateway.http import app_keys
from gateway.routing.decisions import DecisionOutcome
from loadtests.harness.inprocess import GatewayHandle, run_gateway

API = "/v1/chat/completions"
STREAM: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
LATE = b'data: {"choices":[{"delta":{"content":"late"}}]}\n\n'
USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":1,'
    b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
)
DONE = b"data: [DONE]\n\n"
END = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def idle(gw: GatewayHandle) -> bool:
    return all(
        w.in_flight == 0 and w.queued_prefill_tokens == 0 and w.decoding_requests == 0
        for w in gw.registry
    )


def unpenalised(gw: GatewayHandle) -> bool:
    return all(w.consecutive_connect_errors == 0 and w.consecutive_5xx == 0 for w in gw.registry)


async def open_stream(gw: GatewayHandle) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":")[-1]))
    request = orjson.dumps(STREAM)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (API.encode(), len(request), request)
    )
    await writer.drain()
    return reader, writer


async def read_until(reader: asyncio.StreamReader, mark: bytes, within_s: float) -> bytes:
    got = b""
    async with asyncio.timeout(within_s):
        while mark not in got:
            data = await reader.read(65536)
            assert data, f"closed before {mark!r}: {got[-200:]!r}"
            got += data
    return got


async def outcome(gw: GatewayHandle) -> DecisionOutcome:
    for _ in range(150):
        decisions = list(gw.app[app_keys.DECISIONS].latest(1))
        if decisions and decisions[0].outcome is not None and idle(gw):
            return decisions[0].outcome
        await asyncio.sleep(0.02)
    raise AssertionError("the request was not recorded, or its lease is still held")


def streaming_on(closed: asyncio.Event, first: bytes = EVENT + DONE) -> Any:
    """A worker that sends ``first`` and then an event every 20 ms, never ending its body."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + chunk(first))
        await writer.drain()
        try:
            while True:
                await asyncio.sleep(0.02)
                writer.write(chunk(LATE))
                await writer.drain()
        except ConnectionError:
            closed.set()
            return False

    return answer


async def test_a_worker_streaming_on_after_done_is_cut(scripted: StartWorker) -> None:
    """Before: every event after ``[DONE]`` was relayed and the lease held until the
    request's deadline (30 min by default; 30 s here)."""
    closed = asyncio.Event()
    worker = await scripted(streaming_on(closed))
    async with run_gateway([worker.url], worker_kind="sglang") as gw:
        reader, writer = await open_stream(gw)
        started = time.perf_counter()
        got = await read_until(reader, END, 3.0)  # the client's response ends
        assert time.perf_counter() - started < 2.5
        assert got.endswith(DONE + b"\r\n" + END) and b"late" not in got
        assert (await outcome(gw)).status == 200
        await asyncio.wait_for(closed.wait(), 2)  # the worker's connection was closed
        assert unpenalised(gw) and not worker.aborts
        writer.close()


async def test_events_after_done_in_its_chunk_are_not_relayed(scripted: StartWorker) -> None:
    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + chunk(EVENT + USAGE + DONE + LATE + b": comment\n\n") + END)
        await writer.drain()
        return True

    worker = await scripted(answer)
    async with run_gateway([worker.url], worker_kind="sglang") as gw:
        for _ in range(2):
            reader, writer = await open_stream(gw)
            got = await read_until(reader, END, 3.0)
            assert got.endswith(USAGE + DONE + b"\r\n" + END) and b"late" not in got
            assert (await outcome(gw)).reported_cached_tokens == 32
            writer.close()
    assert len({e.connection for e in worker.inference}) == 1  # the connection was reused


async def test_a_worker_ending_its_body_soon_after_done_keeps_its_connection(
    scripted: StartWorker,
) -> None:
    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + chunk(EVENT + DONE))
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(END)
        await writer.drain()
        return True

    worker = await scripted(answer)
    async with run_gateway([worker.url], worker_kind="sglang") as gw:
        for _ in range(2):
            reader, writer = await open_stream(gw)
            await read_until(reader, END, 3.0)
            assert (await outcome(gw)).status == 200
            writer.close()
    assert len({e.connection for e in worker.inference}) == 1


async def test_a_worker_silent_after_done_does_not_hold_the_request(
    scripted: StartWorker,
) -> None:
    """Before: held until the stream's idle timeout (120 s by default)."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + chunk(EVENT + DONE))
        await writer.drain()
        await asyncio.sleep(10)
        return False

    worker = await scripted(answer)
    async with run_gateway([worker.url], worker_kind="sglang") as gw:
        reader, writer = await open_stream(gw)
        started = time.perf_counter()
        await read_until(reader, END, 3.0)
        assert time.perf_counter() - started < 2.5
        assert (await outcome(gw)).status == 200 and unpenalised(gw)
        writer.close()


async def test_a_done_split_across_chunks_then_a_client_leaving_is_complete(
    scripted: StartWorker,
) -> None:
    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        for piece in (
            HEAD + chunk(EVENT + USAGE + b"data: [DO"),
            chunk(b"NE]\r"),
            chunk(b"\n\r\n"),
        ):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        writer.write(END)
        await writer.drain()
        return True

    worker = await scripted(answer)
    async with run_gateway([worker.url], worker_kind="sglang") as gw:
        reader, writer = await open_stream(gw)
        await read_until(reader, DONE, 3.0)
        writer.transport.abort()
        result = await outcome(gw)
        assert result.status == 200 and result.reported_cached_tokens == 32
        assert unpenalised(gw) and not worker.aborts


async def test_a_client_gone_before_done_is_a_499_and_the_worker_aborted(
    scripted: StartWorker,
) -> None:
    gone = asyncio.Event()

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + chunk(EVENT))
        await writer.drain()
        await gone.wait()
        await asyncio.sleep(0.05)
        try:
            writer.write(chunk(DONE) + END)
            await writer.drain()
        except ConnectionError:
            pass
        return True

    worker = await scripted(answer)
    async with run_gateway([worker.url], worker_kind="sglang") as gw:
        reader, writer = await open_stream(gw)
        await read_until(reader, b"content", 3.0)
        writer.transport.abort()
        gone.set()
        assert (await outcome(gw)).status == 499
        for _ in range(100):
            if worker.aborts:
                break
            await asyncio.sleep(0.02)
        assert len(worker.aborts) == 1


async def test_shutdown_does_not_wait_on_a_worker_streaming_after_done(
    scripted: StartWorker,
) -> None:
    """Before: shutdown waited twice the grace (aiohttp's two waits) on the tail."""
    closed = asyncio.Event()
    worker: ScriptedWorker = await scripted(streaming_on(closed))
    async with run_gateway([worker.url], worker_kind="sglang", server__shutdown_grace_s=5) as gw:
        reader, writer = await open_stream(gw)
        await read_until(reader, DONE, 3.0)
        stopping = time.perf_counter()
    assert time.perf_counter() - stopping < 2.5
    assert idle(gw)
    writer.close()


@pytest.mark.parametrize(
    "extra", [{"model": "m:x\r\nFORGED line\x00"}, {"lora_path": "y\nFORGED\u2028line\x85"}]
)
async def test_an_adapter_name_never_reaches_a_log_line_raw(
    extra: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the 404's message, logged as is by the error middleware, carried the
    client's CR, LF and NUL: a forged log line."""
    worker = LoraWorker(cards={"alpha": "/loras/alpha"})
    caplog.set_level(logging.INFO)
    async with lora_gateway(worker) as gw:
        status, body, _ = await lora_post(gw, chat() | extra)
    assert status == 404 and "FORGED" in body["error"]["message"]
    messages = [r.getMessage() for r in caplog.records if "FORGED" in r.getMessage()]
    assert messages
    for message in messages:
        assert not any(c in message for c in "\r\n\x00\x85\u2028")
    assert not worker.loads
