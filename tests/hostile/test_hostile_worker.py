"""A worker that misbehaves on cue, in front of the real gateway: framing, lengths, interim
and bodiless statuses, early closes, slow drips, huge heads, redirects, encodings, CRLF
event streams, split sentinels, bytes after the answer (issue 16, items 2-6, 8-11)."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession, ClientTimeout
from scripted_worker import (
    Exchange,
    ScriptedWorker,
    StartWorker,
    chunked,
    http_response,
    replies,
)

from gateway.http import app_keys
from loadtests.harness.inprocess import GatewayHandle, run_gateway

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAM: dict[str, Any] = {**CHAT, "stream": True}
API = "/v1/chat/completions"
DONE = b"data: [DONE]\n\n"


@asynccontextmanager
async def gateway(workers: list[ScriptedWorker], **overrides: Any) -> AsyncIterator[GatewayHandle]:
    async with run_gateway([w.url for w in workers], worker_kind="sglang", **overrides) as gw:
        yield gw


async def post(gw: GatewayHandle, body: dict[str, Any], **kw: Any) -> tuple[int, bytes]:
    async with (
        ClientSession(timeout=ClientTimeout(total=10)) as client,
        client.post(gw.url + API, json=body, **kw) as resp,
    ):
        return resp.status, await resp.read()


def unpenalised(gw: GatewayHandle) -> bool:
    return all(w.consecutive_connect_errors == 0 and w.consecutive_5xx == 0 for w in gw.registry)


# --- item 2: bytes after Content-Length -------------------------------------------------


async def test_bytes_after_the_answer_never_reach_the_next_client(scripted: StartWorker) -> None:
    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        extra = http_response(b'{"n":"stolen"}') if n == 1 else b""
        writer.write(http_response(b'{"n":%d}' % n) + extra)
        await writer.drain()
        return True

    worker = await scripted(answer)
    async with gateway([worker]) as gw:
        assert await post(gw, CHAT) == (200, b'{"n":1}')
        assert await post(gw, CHAT) == (200, b'{"n":2}')
        assert await post(gw, CHAT) == (200, b'{"n":3}')
    assert worker.posts == 3


async def test_bytes_arriving_while_idle_drop_the_connection(scripted: StartWorker) -> None:
    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(http_response(b'{"n":%d}' % n))
        await writer.drain()
        if n == 1:
            await asyncio.sleep(0.05)  # the gateway pooled it: now a stray answer
            writer.write(http_response(b'{"n":"stolen"}'))
            await writer.drain()
        return True

    worker = await scripted(answer)
    async with gateway([worker]) as gw:
        assert await post(gw, CHAT) == (200, b'{"n":1}')
        await asyncio.sleep(0.2)
        assert await post(gw, CHAT) == (200, b'{"n":2}')


# --- item 3: event streams by the spec --------------------------------------------------


@pytest.mark.parametrize("end", [b"\r\n", b"\r", b"\n"], ids=["crlf", "cr", "lf"])
async def test_event_stream_line_ends(scripted: StartWorker, end: bytes) -> None:
    events = [b'data: {"a":1}', b'data: {"b":2}', b"data: [DONE]"]
    worker = await scripted(replies(chunked([e + end + end for e in events])))
    async with gateway([worker]) as gw:
        status, body = await post(gw, STREAM)
        assert status == 200
        assert body == b'data: {"a":1}\n\ndata: {"b":2}\n\n' + DONE
        assert unpenalised(gw)


async def test_crlf_split_across_reads_is_one_line_end(scripted: StartWorker) -> None:
    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        body = b'data: {"a":1}\r\n\r\ndata: [DONE]\r\n\r\n'
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        writer.write(head + body[:15])  # ends between the CR and the LF
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(body[15:])
        await writer.drain()
        return True

    worker = await scripted(answer)
    async with gateway([worker]) as gw:
        assert await post(gw, STREAM) == (200, b'data: {"a":1}\n\n' + DONE)


async def test_last_event_without_blank_line_is_delivered(scripted: StartWorker) -> None:
    worker = await scripted(replies(chunked([b'data: {"a":1}\n\n', b"data: [DONE]"])))
    async with gateway([worker]) as gw:
        status, body = await post(gw, STREAM)
        assert (status, body) == (200, b'data: {"a":1}\n\n' + DONE)
        assert unpenalised(gw)


async def test_oversize_event_ends_the_stream_with_an_error(scripted: StartWorker) -> None:
    huge = b"data: " + b"x" * 20_000
    worker = await scripted(replies(chunked([b'data: {"a":1}\n\n', huge, b"\n\n", DONE])))
    async with gateway([worker], server__max_event_size=4096) as gw:
        status, body = await post(gw, STREAM)
    assert status == 200
    assert body.startswith(b'data: {"a":1}\n\ndata: {"error"')
    assert b"4096" in body and body.endswith(DONE) and b"xxxx" not in body


async def test_long_crlf_stream_flows_and_stays_bounded(scripted: StartWorker) -> None:
    event = b"data: " + b"y" * 1000 + b"\r\n\r\n"
    worker = await scripted(replies(chunked([event] * 2000 + [b"data: [DONE]\r\n\r\n"])))
    async with gateway([worker]) as gw:
        status, body = await post(gw, STREAM)
    assert status == 200 and body.count(b"y" * 1000) == 2000 and body.endswith(DONE)


async def test_media_type_is_matched_case_insensitively(scripted: StartWorker) -> None:
    raw = chunked([b'data: {"a":1}\r\n\r\n', DONE], ctype="Text/Event-Stream; charset=utf-8")
    worker = await scripted(replies(raw))
    async with gateway([worker]) as gw:
        assert await post(gw, STREAM) == (200, b'data: {"a":1}\n\n' + DONE)


# --- item 4: a [DONE] split across reads --------------------------------------------------


async def test_done_split_across_reads_is_one_done(scripted: StartWorker) -> None:
    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        writer.write(head + b"Transfer-Encoding: chunked\r\n\r\n")
        for piece in (b'data: {"a":1}\n\n', b"data: [DO", b"NE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    worker = await scripted(answer)
    async with gateway([worker]) as gw:
        status, body = await post(gw, STREAM)
        assert (status, body) == (200, b'data: {"a":1}\n\n' + DONE)
        assert unpenalised(gw)


# --- item 5: a slow client is not the worker's failure ------------------------------------


async def test_slow_client_does_not_penalise_the_worker(scripted: StartWorker) -> None:
    event = b"data: " + b"z" * 8000 + b"\n\n"
    worker = await scripted(replies(chunked([event] * 2000 + [DONE])))  # 16 MB at once
    async with (
        gateway([worker], server__stream_idle_timeout_s=0.4) as gw,
        ClientSession(timeout=ClientTimeout(total=30), read_bufsize=4096) as client,
        client.post(gw.url + API, json=STREAM) as resp,
    ):
        received = len(await resp.content.read(65536))
        await asyncio.sleep(1.2)  # the relay waits on this client, not on the worker
        while chunk := await resp.content.read(1 << 20):
            received += len(chunk)
        assert received == 2000 * len(event) + len(DONE)
        await asyncio.sleep(0.05)
        assert unpenalised(gw)


async def test_client_that_stops_reading_is_cut_and_the_worker_aborted(
    scripted: StartWorker,
) -> None:
    event = b"data: " + b"z" * 8000 + b"\n\n"
    worker = await scripted(replies(chunked([event] * 2000 + [DONE])))  # 16 MB
    async with gateway([worker], server__client_write_timeout_s=0.5) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":")[-1]))
        body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (API.encode(), len(body), body)
        )
        await writer.drain()
        await reader.read(1000)  # then read nothing more
        w = next(iter(gw.registry))
        for _ in range(200):
            if w.in_flight == 0 and worker.aborts:
                break
            await asyncio.sleep(0.025)
        assert w.in_flight == 0 and worker.aborts and unpenalised(gw)
        writer.close()


# --- items 9, 11 and the rest of framing: the parser decides -----------------------------


async def test_204_and_304_have_no_body(scripted: StartWorker) -> None:
    raw = [b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 304 Not Modified\r\n\r\n"]
    worker = await scripted(replies(*raw))
    async with gateway([worker], server__stream_idle_timeout_s=30) as gw:
        started = asyncio.get_running_loop().time()
        assert await post(gw, CHAT) == (204, b"")
        assert await post(gw, CHAT) == (304, b"")
        assert asyncio.get_running_loop().time() - started < 2
        assert unpenalised(gw)
    first, second = worker.inference
    assert first.connection == second.connection  # bodiless: the connection stayed usable


async def test_interim_heads_are_skipped(scripted: StartWorker) -> None:
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    worker = await scripted(replies(raw + http_response(b'{"ok":1}')))
    async with gateway([worker]) as gw:
        assert await post(gw, CHAT) == (200, b'{"ok":1}')


MALFORMED = {
    "negative chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\nok\r\n0\r\n\r\n",
    "superscript length": "HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\nok".encode(),
    "CR in a value": b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok",
    "LF in a value": b"HTTP/1.1 200 OK\r\nX-A: a\nb: c\r\nContent-Length: 2\r\n\r\nok",
    "NUL in a value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    "TE and CL": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n"
    ),
    "duplicate CL": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
    "xchunkedx": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: xchunkedx\r\n\r\nok",
    "gzip transfer coding": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "obs-fold": b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 2\r\n\r\nok",
    "bare LF": b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
    "not HTTP": b"SSH-2.0-OpenSSH\r\n\r\n",
    "101 unasked": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\nraw",
    "huge head": b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * 200_000 + b"\r\n\r\n",
    "too many fields": b"HTTP/1.1 200 OK\r\n" + b"X-A: 1\r\n" * 500 + b"\r\n",
    "cut body": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly",
}


@pytest.mark.parametrize("raw", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_malformed_answers_are_refused(scripted: StartWorker, raw: bytes) -> None:
    worker = await scripted(replies(raw, http_response(b'{"ok":1}'), keep=False))
    async with gateway([worker], retry__max_retries=0) as gw:
        status, body = await post(gw, CHAT)
        assert status == 502 and b"ok" not in body.replace(b'"object"', b"")
        assert await post(gw, CHAT) == (200, b'{"ok":1}')  # on a fresh connection
    assert worker.inference[1].connection != worker.inference[0].connection


async def test_connection_close_token_in_a_list_is_honoured(scripted: StartWorker) -> None:
    worker = await scripted(
        replies(http_response(b"{}", extra="Connection: keep-alive, close\r\n"))
    )
    async with gateway([worker]) as gw:
        for _ in range(2):
            assert await post(gw, CHAT) == (200, b"{}")
    first, second = worker.inference
    assert first.connection != second.connection


async def test_slow_drip_head_within_the_deadline_is_read(scripted: StartWorker) -> None:
    raw = http_response(b'{"ok":1}')

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        for i in range(0, len(raw), 3):
            writer.write(raw[i : i + 3])
            await writer.drain()
            await asyncio.sleep(0.002)
        return True

    worker = await scripted(answer)
    async with gateway([worker]) as gw:
        assert await post(gw, CHAT) == (200, b'{"ok":1}')


async def test_oversize_answer_is_refused(scripted: StartWorker) -> None:
    worker = await scripted(replies(http_response(b"[" + b"1," * 40_000 + b"1]")))
    async with gateway([worker], server__max_response_size=16_384, retry__max_retries=0) as gw:
        status, _ = await post(gw, CHAT)
    assert status == 502


# --- item 10: never sent twice ------------------------------------------------------------


async def test_request_read_whole_then_dropped_is_not_resent(scripted: StartWorker) -> None:
    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 2:
            return False  # read it whole, then hang up without a word
        writer.write(http_response(b'{"n":%d}' % n))
        await writer.drain()
        return True

    worker = await scripted(answer)
    async with gateway([worker], retry__max_retries=0) as gw:
        assert await post(gw, CHAT) == (200, b'{"n":1}')
        status, _ = await post(gw, CHAT)
        assert status == 502
    assert worker.posts == 2  # the second request reached the worker once


# --- items 6 and 3xx on the request path: redirects are never followed ---------------------


async def test_probes_do_not_follow_redirects(scripted: StartWorker) -> None:
    outside = await scripted(replies(http_response(b"{}")))
    outside.probe_answer = http_response(b'{"object":"list","data":[{"id":"leaked"}]}')
    worker = await scripted(replies(http_response(b"{}")))
    location = f"Location: {outside.url}/v1/models\r\n"
    worker.probe_answer = http_response(b"", status="302 Found", extra=location)
    async with run_gateway([worker.url], worker_kind="auto", ready_within_s=0.3) as gw:
        await asyncio.sleep(0.6)  # probes, metadata reads, load polls
        async with ClientSession() as client, client.get(gw.url + "/v1/models") as resp:
            assert b"leaked" not in await resp.read()
    assert worker.exchanges and outside.exchanges == []


async def test_redirect_answers_are_neither_followed_nor_relayed(scripted: StartWorker) -> None:
    outside = await scripted(replies(http_response(b'{"leaked":1}')))
    location = f"Location: {outside.url}/v1/chat/completions\r\n"
    worker = await scripted(replies(http_response(b"", status="307 Temporary", extra=location)))
    async with (
        gateway([worker], retry__max_retries=0) as gw,
        ClientSession() as client,
        client.post(gw.url + API, json=CHAT, allow_redirects=False) as resp,
    ):
        assert resp.status == 502 and "Location" not in resp.headers
    assert outside.exchanges == []


# --- item 8 and gzip: encodings -----------------------------------------------------------


async def test_gzip_request_body_is_forwarded_decoded_without_its_encoding(
    scripted: StartWorker,
) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    async with gateway([worker]) as gw, ClientSession() as client:
        data = gzip.compress(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        async with client.post(gw.url + API, data=data, headers=headers) as resp:
            assert resp.status == 200
    seen = worker.inference[0]
    assert seen.header("content-encoding") is None and seen.body.startswith(b'{"model"')
    assert seen.header("accept-encoding") is None


async def test_gzipped_event_stream_is_refused(scripted: StartWorker) -> None:
    raw = chunked(
        [gzip.compress(b'data: {"a":1}\n\ndata: [DONE]\n\n')], extra="Content-Encoding: gzip\r\n"
    )
    worker = await scripted(replies(raw))
    async with gateway([worker], retry__max_retries=0) as gw:
        status, _ = await post(gw, STREAM)
    assert status == 502


# --- a client that leaves as soon as it has [DONE] ---------------------------------------


async def test_a_client_leaving_right_after_done_is_a_complete_request(
    scripted: StartWorker,
) -> None:
    """Clients close as soon as they read ``[DONE]`` (the real-SGLang bench's did). The
    worker here ends its body 0.3 s after ``[DONE]``, so the gateway finishes the stream
    after the client left: that is a complete 200 with its usage learnt (before: a 499,
    its cached tokens lost to routing)."""
    usage = (
        b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":1,'
        b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
    )
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    body = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n' + usage + DONE

    async def late_end(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(head + b"%x\r\n%s\r\n" % (len(body), body))
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    worker = await scripted(late_end)
    async with gateway([worker]) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":")[-1]))
        request = orjson.dumps(STREAM)
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (API.encode(), len(request), request)
        )
        await writer.drain()
        got = b""
        while b"data: [DONE]" not in got:
            got += await asyncio.wait_for(reader.read(65536), 5)
        writer.transport.abort()  # gone, with a reset, the moment [DONE] arrived
        for _ in range(100):
            decisions = list(gw.app[app_keys.DECISIONS].latest(1))
            if decisions and decisions[0].outcome is not None:
                break
            await asyncio.sleep(0.02)
        outcome = decisions[0].outcome
        assert outcome is not None
        assert outcome.status == 200 and outcome.reported_cached_tokens == 32
        assert unpenalised(gw) and not worker.aborts
