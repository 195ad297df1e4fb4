"""Hostile clients holding a valid key (or none needed): CR, LF and NUL in every field they
control (headers, request id, target, the body's rid and model), absolute-form and encoded
targets, Connection-listed headers, huge and compressed bodies (issue 16, items 1, 7, 12,
13). What reaches the worker is read by h11, as a real server would read it."""

from __future__ import annotations

import asyncio
import gzip
import resource
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
    raw_exchange,
    replies,
)

from loadtests.harness.inprocess import GatewayHandle, run_gateway

API = "/v1/chat/completions"
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SMUGGLED = (
    "r1\r\nContent-Length: 0\r\n\r\nPOST /flush_cache HTTP/1.1\r\nHost: w\r\n"
    "Content-Length: 0\r\n\r\n"
)


@asynccontextmanager
async def gateway(workers: list[ScriptedWorker], **overrides: Any) -> AsyncIterator[GatewayHandle]:
    async with run_gateway([w.url for w in workers], worker_kind="sglang", **overrides) as gw:
        yield gw


def port_of(gw: GatewayHandle) -> int:
    return int(gw.url.rsplit(":", 1)[1])


def clean(worker: ScriptedWorker) -> None:
    """Whatever the clients sent, the worker saw well-formed requests to the API path, and
    no CR, LF or NUL in any header."""
    assert not worker.protocol_errors
    for exchange in worker.exchanges:
        if exchange.method == "POST":
            assert exchange.target in (API, "/abort_request")
        for name, value in exchange.headers:
            assert not any(c in name + value for c in "\r\n\x00"), (name, value)


def request(target: str, body: bytes, *headers: str) -> bytes:
    lines = [f"POST {target} HTTP/1.1", "Host: gw", "Content-Type: application/json"]
    lines += [*headers, f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# --- item 1: smuggling through the rid -----------------------------------------------------


@pytest.mark.parametrize(
    "rid", [SMUGGLED, "a\x00b", "a\rb", "a\nb"], ids=["crlf", "nul", "cr", "lf"]
)
async def test_rid_with_control_characters_smuggles_nothing(
    scripted: StartWorker, rid: str
) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    async with gateway([worker]) as gw, ClientSession(timeout=ClientTimeout(total=10)) as client:
        async with client.post(gw.url + API, json={**CHAT, "rid": rid}) as resp:
            await resp.read()
            assert resp.status in (200, 400)  # 400 until the gateway owns the rid
        async with client.post(gw.url + API, json=CHAT) as resp:
            assert (resp.status, await resp.read()) == (200, b'{"ok":1}')
    clean(worker)
    assert len(worker.inference) in (1, 2)


# --- every other client-controlled field ------------------------------------------------------

BODY = orjson.dumps(CHAT)
RAW_HOSTILE = {
    "CR in a header value": request(API, BODY, "X-A: a\rb"),
    "NUL in a header value": request(API, BODY, "X-A: a\x00b"),
    "LF in a header name": request(API, BODY, "X-\nA: b"),
    "obs-fold": request(API, BODY, "X-A: a", " folded"),
    "CR in the request id": request(API, BODY, "X-Request-Id: r\r1"),
    "NUL in the request id": request(API, BODY, "X-Request-Id: r\x001"),
    "DEL in the request id": request(API, BODY, "X-Request-Id: r\x7f1"),
    "bare LF line ends": request(API, BODY).replace(b"\r\n", b"\n"),
    "encoded CR LF in the target": request(API + "%0d%0aX-A:%20b", BODY),
    "space in the target": request(API + " x", BODY),
    "no version (HTTP/0.9)": request(API, BODY).replace(b" HTTP/1.1", b"", 1),
    "TE and CL": request(API, b"0\r\n\r\n", "Transfer-Encoding: chunked"),
}


@pytest.mark.parametrize("raw", list(RAW_HOSTILE.values()), ids=list(RAW_HOSTILE))
async def test_control_characters_in_the_head_never_reach_the_worker(
    scripted: StartWorker, raw: bytes
) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    async with gateway([worker]) as gw:
        answer = await raw_exchange(port_of(gw), raw)
    status_line = answer.partition(b"\r\n")[0]  # aiohttp's parser errors answer as 1.0
    assert status_line.split(b" ")[1] in (b"400", b"404"), status_line
    assert worker.inference == []
    clean(worker)


@pytest.mark.parametrize(
    "request_id", ["a b", "é", "x" * 200, "a\tb"], ids=["space", "non-ascii", "long", "tab"]
)
async def test_unusable_request_ids_are_replaced(scripted: StartWorker, request_id: str) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    async with gateway([worker]) as gw:
        answer = await raw_exchange(port_of(gw), request(API, BODY, f"X-Request-Id: {request_id}"))
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 200 ")
    echoed = next(line for line in head.split("\r\n") if line.startswith("x-request-id:"))
    assert request_id.lower() not in echoed and len(echoed.split(":")[1].strip()) == 32
    clean(worker)


async def test_model_and_unknown_fields_with_control_characters_stay_in_the_body(
    scripted: StartWorker,
) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    body = {**CHAT, "model": "m\r\nX-Evil: 1", "extra\r\nfield": "\x00"}
    async with (
        gateway([worker]) as gw,
        ClientSession() as client,
        client.post(gw.url + API, json=body) as resp,
    ):
        assert resp.status == 200
    seen = orjson.loads(worker.inference[0].body)
    assert seen["model"] == "m\r\nX-Evil: 1" and seen["extra\r\nfield"] == "\x00"
    clean(worker)


# --- item 12: the worker gets the route's canonical path -------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        API + "?x=1",
        "/v1/%63hat/completions",
        "http://evil.example" + API,
        "http://evil.example" + API + "?flush=1#frag",
    ],
    ids=["query", "percent-encoded", "absolute-form", "absolute-form-query"],
)
async def test_upstream_target_is_canonical(scripted: StartWorker, target: str) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    async with gateway([worker]) as gw:
        answer = await raw_exchange(port_of(gw), request(target, BODY))
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert [e.target for e in worker.inference] == [API]
    assert worker.inference[0].header("host") == worker.url.removeprefix("http://")


# --- item 13: hop-by-hop headers by declaration --------------------------------------------


async def test_connection_listed_and_proxy_connection_headers_are_not_forwarded(
    scripted: StartWorker,
) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    headers = ("Connection: keep-alive, X-Secret", "X-Secret: s", "Proxy-Connection: keep-alive")
    async with gateway([worker]) as gw:
        answer = await raw_exchange(port_of(gw), request(API, BODY, *headers, "X-Kept: k"))
    assert answer.startswith(b"HTTP/1.1 200 ")
    seen = worker.inference[0]
    assert seen.header("x-secret") is None and seen.header("proxy-connection") is None
    assert seen.header("x-kept") == "k"


async def test_worker_connection_listed_headers_are_not_relayed(scripted: StartWorker) -> None:
    extra = "Connection: X-Internal\r\nX-Internal: secret\r\nX-Public: p\r\n"
    worker = await scripted(replies(http_response(b'{"ok":1}', extra=extra)))
    async with (
        gateway([worker]) as gw,
        ClientSession() as client,
        client.post(gw.url + API, json=CHAT) as resp,
    ):
        assert resp.headers.get("X-Public") == "p" and "X-Internal" not in resp.headers


# --- item 7: the gateway owns the rid (needs the router edit, see the issue-16 report) -------


async def test_client_chosen_rid_never_names_an_upstream_request(scripted: StartWorker) -> None:
    event = b'data: {"a":1}\n\n'

    async def slow(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        writer.write(head + b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(100):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.02)
        return False

    worker = await scripted(slow)
    async with gateway([worker]) as gw, ClientSession() as client:
        body = {**CHAT, "stream": True, "rid": "victim"}
        async with client.post(gw.url + API, json=body, headers={"x-request-id": "victim"}) as resp:
            await resp.content.readany()
            resp.close()  # the attacker goes away: the gateway aborts *its* request
        for _ in range(100):
            if worker.aborts:
                break
            await asyncio.sleep(0.02)
    upstream_rid = orjson.loads(worker.inference[0].body)["rid"]
    assert upstream_rid != "victim" and len(upstream_rid) == 32
    assert worker.inference[0].header("x-request-id") == upstream_rid
    assert [orjson.loads(a) for a in worker.aborts] == [{"rid": upstream_rid}]


async def test_body_without_rid_gets_the_gateways(scripted: StartWorker) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    async with (
        gateway([worker]) as gw,
        ClientSession() as client,
        client.post(gw.url + API, json=CHAT, headers={"x-request-id": "mine"}) as r,
    ):
        assert r.status == 200 and r.headers["x-request-id"] == "mine"
    seen = orjson.loads(worker.inference[0].body)
    assert seen["rid"] != "mine" and {k: v for k, v in seen.items() if k != "rid"} == CHAT


async def test_a_batch_keeps_its_body_and_no_client_rid_is_aborted(scripted: StartWorker) -> None:
    """SGLang wants a list of rids for a batch: the gateway neither inserts its string rid
    nor aborts the client's rids (they name nothing the gateway chose)."""
    worker = await scripted(replies(http_response(b'[{"text":"x"},{"text":"y"}]')))
    batches = [{"text": ["a b", "c d"], "rid": ["victim-1", "victim-2"]}, {"text": ["e", "f"]}]
    async with gateway([worker]) as gw, ClientSession() as client:
        for batch in batches:
            async with client.post(gw.url + "/generate", json=batch) as r:
                assert r.status == 200
    assert [orjson.loads(x.body) for x in worker.inference] == batches
    assert worker.aborts == []


# --- huge and compressed bodies --------------------------------------------------------------


async def test_huge_body_is_refused_before_the_worker(scripted: StartWorker) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    big = orjson.dumps({**CHAT, "pad": "x" * (2 << 20)})
    async with gateway([worker], server__max_payload_size=1 << 20) as gw:
        answer = await raw_exchange(port_of(gw), request(API, big))
    assert answer.startswith(b"HTTP/1.1 413 ") and worker.inference == []


async def test_compression_bomb_is_refused_without_inflating_it(scripted: StartWorker) -> None:
    worker = await scripted(replies(http_response(b'{"ok":1}')))
    bomb = gzip.compress(b'{"model":"m","pad":"' + b"0" * (512 << 20) + b'"}', 9)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    async with gateway([worker], server__max_payload_size=1 << 20) as gw:
        answer = await raw_exchange(port_of(gw), request(API, bomb, "Content-Encoding: gzip"))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert answer.startswith(b"HTTP/1.1 413 ") and worker.inference == []
    assert grown_mib < 128  # 512 MiB inflated would show


async def test_streamed_answer_to_a_gzip_accepting_client_is_identity(
    scripted: StartWorker,
) -> None:
    worker = await scripted(replies(chunked([b'data: {"a":1}\n\n', b"data: [DONE]\n\n"])))
    async with gateway([worker]) as gw, ClientSession(auto_decompress=False) as client:
        headers = {"Accept-Encoding": "gzip, br"}
        async with client.post(gw.url + API, json={**CHAT, "stream": True}, headers=headers) as r:
            assert r.status == 200 and "Content-Encoding" not in r.headers
            assert await r.read() == b'data: {"a":1}\n\ndata: [DONE]\n\n'
    assert worker.inference[0].header("accept-encoding") is None
