"""Wrong methods on known paths: 405 with ``Allow`` and an OpenAI-style JSON body, for
every method aiohttp's parser knows (TRACE included); methods it does not know, CONNECT
and requests it cannot parse get JSON errors too (``gateway.http.connguard.JsonErrorsHandler``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import ClientSession

from loadtests.harness.inprocess import GatewayHandle, run_gateway

GET_ONLY = "GET,HEAD"
WRONG = {
    "/health": ("TRACE", "PUT", "DELETE", "PATCH", "OPTIONS", "POST", "PROPFIND", "QUERY"),
    "/v1/models": ("TRACE", "PUT", "DELETE", "PATCH", "POST", "LINK"),
    "/v1/chat/completions": ("GET", "TRACE", "PUT", "DELETE", "HEAD"),
    "/metrics": ("POST", "TRACE", "PUT"),
}
ALLOWED = {"/health": GET_ONLY, "/v1/models": GET_ONLY, "/metrics": GET_ONLY}


@pytest.fixture
async def gw() -> AsyncIterator[GatewayHandle]:
    async with run_gateway([], server__max_header_size=512) as handle:
        yield handle


def _error(body: bytes, status: int) -> str:
    error = orjson.loads(body)["error"]
    assert error["code"] == status and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    message: str = error["message"]
    return message


@pytest.mark.parametrize("path", sorted(WRONG))
async def test_wrong_method_on_a_known_path_is_405(
    gw: GatewayHandle, client: ClientSession, path: str
) -> None:
    for method in WRONG[path]:
        async with client.request(method, gw.url + path) as resp:
            body = await resp.read()
            assert resp.status == 405, (method, path, resp.status, body[:200])
            allow = set(resp.headers["Allow"].split(","))
            assert allow == set(ALLOWED.get(path, "POST").split(",")), (method, path)
            assert method not in allow
            if method != "HEAD":  # a HEAD answer carries no body
                assert resp.content_type == "application/json"
                assert method in _error(body, 405)


async def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        data = await asyncio.wait_for(reader.read(), 5)  # every one of these closes
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n", 501),  # a method the parser refuses
        (b"BREW /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 501),
        (b"CONNECT /health HTTP/1.1\r\nHost: x\r\n\r\n", 501),  # not a forward proxy
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1024 + b"\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),
    ],
)
async def test_requests_aiohttp_answers_itself_get_json(
    gw: GatewayHandle, request_bytes: bytes, status: int
) -> None:
    port = int(gw.url.rsplit(":", 1)[1])
    got, headers, body = await _raw(port, request_bytes)
    assert got == status, body[:200]
    assert headers["content-type"].startswith("application/json")
    message = _error(body, status)
    assert "a" * 64 not in message and "colon" not in message  # the request is not echoed


async def test_unknown_method_after_a_good_request_is_json_too(gw: GatewayHandle) -> None:
    port = int(gw.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await asyncio.wait_for(reader.readexactly(length), 5)
        writer.write(b"FOO /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # same connection
        second = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    assert second.startswith(b"HTTP/1.0 501")  # aiohttp's error answers are HTTP/1.0
    assert second.endswith(b'"type":"invalid_request_error","param":null,"code":501}}')
