"""Forwarding one attempt to one worker, and relaying its answer to the client.

Contract:
- :func:`send` posts the body to the worker (``gateway.forward.upstream``) and returns its
  response head, or raises :class:`AttemptFailed` (``connect``: nothing reached the worker
  or it hung up before answering; ``timeout``). Nothing has reached the client then, so
  the router may retry.
- :func:`relay` sends the worker's answer to the client and returns the outcome.
  * A 5xx or 429 head is reported as ``AttemptFailed("status")`` (body read, connection
    reusable) unless ``final``, so the router can try another worker.
  * SSE (``200`` + ``text/event-stream``): the client's response is prepared only at the
    worker's first chunk, so a worker that fails before it is still retryable; the first
    chunk marks time to first token. Then chunks are written as they arrive
    (``readany`` → ``write``, which awaits the transport's drain: back-pressure). Only
    whole events are written: a trailing partial event waits for its end, so a failure
    mid-stream is followed by exactly one SGLang error event and ``data: [DONE]``.
  * Anything else is read whole and relayed as is (status, body, content type).
- Client disconnect (write fails, or the handler is cancelled): the upstream connection is
  closed and ``/abort_request`` is sent to the worker in the background; the caller's lease
  is released by the caller's ``finally``.
- Both sockets have TCP_NODELAY: aiohttp's server protocol sets it on accepted sockets,
  and asyncio/uvloop set it on the worker connections of ``gateway.forward.upstream``.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.errors import stream_error_event
from gateway.forward.upstream import FirstByteTimeout, UpstreamError, UpstreamPool, UpstreamResponse

# Never forwarded in either direction (RFC 9110 §7.6.1), plus lengths aiohttp recomputes.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",  # the gateway already read the body: no 100-continue dance upstream
    }
)
_NOT_RELAYED = HOP_BY_HOP | {"date", "server"}
_REPLACED = HOP_BY_HOP | {"x-request-id", "content-type"}
# usage / meta_info "cached_tokens"; llama.cpp's timings "cache_n" (the same number)
_CACHED = re.compile(rb'"(?:cached_tokens|cache_n)"\s*:\s*(\d+)')
_CACHED_MARKS = (b'"cached_tokens"', b'"cache_n"')
_DONE = b"data: [DONE]"
_EVENT_END = b"\n\n"


class AttemptFailed(Exception):
    """One attempt failed before any byte reached the client."""

    def __init__(
        self,
        kind: str,
        message: str,
        status: int = 0,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind  # "connect" | "timeout" | "first_byte_timeout" | "status" | "dropped"
        self.message = message
        self.status = status
        self.body = body
        self.headers = dict(headers or {})


@dataclass(slots=True)
class Outcome:
    """What one relayed answer turned out to be."""

    status: int = 0
    ttft_s: float | None = None
    cached_tokens: int | None = None  # as the worker reported it
    failed_mid_stream: bool = False
    client_gone: bool = False


def upstream_headers(
    headers: CIMultiDictProxy[str],
    request_id: str,
    extra: Mapping[str, str],
    drop: frozenset[str] = frozenset(),
) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop ones and ``drop`` (lower-case names: the
    client's credentials, see ``gateway.forward.credentials``), with the request id, a
    JSON content type (and ``extra``) set."""
    out = [
        (key, value)
        for key, value in headers.items()
        if (name := key.lower()) not in _REPLACED and name not in drop
    ]
    out.append(("x-request-id", request_id))
    # The body parsed as JSON, and SGLang refuses any other type: curl's -d default
    # (form-urlencoded) must not turn a valid request into a worker's 400.
    out.append(("Content-Type", "application/json"))
    out.extend(extra.items())
    return out


async def send(
    pool: UpstreamPool,
    url: str,
    path: str,
    body: bytes,
    headers: list[tuple[str, str]],
    deadline: float,
) -> UpstreamResponse:
    try:
        return await pool.request(url, path, headers, body, deadline)
    except UpstreamError as exc:
        raise AttemptFailed("connect", str(exc)) from exc
    except FirstByteTimeout as exc:  # retryable: the request's own budget is not spent
        raise AttemptFailed("first_byte_timeout", "the worker sent nothing in time") from exc
    except TimeoutError as exc:
        raise AttemptFailed("timeout", "the worker timed out") from exc


def cached_tokens(data: bytes) -> int | None:
    """The last ``"cached_tokens": N`` in ``data`` (usage details or ``meta_info``), or
    llama.cpp's ``"cache_n": N`` (``timings``, in a stream's last chunk even without
    ``stream_options.include_usage``)."""
    found = _CACHED.findall(data)
    return int(found[-1]) if found else None


def _response_headers(upstream: UpstreamResponse, extra: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in upstream.headers:
        if key.lower() not in _NOT_RELAYED:
            out.add(key, value)
    out.update(extra)
    return out


async def relay(
    request: web.Request,
    upstream: UpstreamResponse,
    *,
    stream: bool,
    final: bool,
    extra_headers: Mapping[str, str],
    started: float,
    on_first_byte: Callable[[], None],
) -> tuple[web.StreamResponse, Outcome]:
    """Relay ``upstream`` to the client (see the module contract)."""
    status = upstream.status
    if (status >= 500 or status == 429) and not final:
        body = await _read_body(upstream)
        raise AttemptFailed(
            "status", f"the worker answered {status}", status, body, dict(upstream.headers)
        )
    ctype = upstream.header("content-type") or ""
    if stream and status == 200 and ctype.startswith("text/event-stream"):
        return await _relay_sse(request, upstream, extra_headers, started, on_first_byte)
    body = await _read_body(upstream)
    on_first_byte()
    response = web.Response(
        status=status, body=body, headers=_response_headers(upstream, extra_headers)
    )
    return response, Outcome(status=status, cached_tokens=cached_tokens(body))


async def _read_body(upstream: UpstreamResponse) -> bytes:
    try:
        return await upstream.read()
    except UpstreamError as exc:
        raise AttemptFailed("dropped", f"the worker dropped the connection: {exc}") from exc
    except TimeoutError as exc:
        raise AttemptFailed("timeout", "the worker timed out") from exc


async def _first_chunk(upstream: UpstreamResponse) -> bytes:
    try:
        chunk = await upstream.readany()
    except UpstreamError as exc:
        raise AttemptFailed("dropped", f"the worker dropped the stream: {exc}") from exc
    except TimeoutError as exc:
        raise AttemptFailed("timeout", "the worker timed out before its first token") from exc
    if not chunk:
        raise AttemptFailed("dropped", "the worker closed the stream before any event")
    return chunk


async def _relay_sse(
    request: web.Request,
    upstream: UpstreamResponse,
    extra_headers: Mapping[str, str],
    started: float,
    on_first_byte: Callable[[], None],
) -> tuple[web.StreamResponse, Outcome]:
    chunk = await _first_chunk(upstream)
    outcome = Outcome(status=200, ttft_s=time.perf_counter() - started)
    on_first_byte()
    response = web.StreamResponse(status=200, headers=_response_headers(upstream, extra_headers))
    await _client_write(response, response.prepare(request))
    pending = b""  # a trailing partial event, held until its end arrives
    last_usage = b""
    last = chunk
    writing = False  # tells a client failure (while writing) from a worker's
    try:
        while chunk:
            if any(mark in chunk for mark in _CACHED_MARKS):
                last_usage = chunk
            last = chunk
            if pending or not chunk.endswith(_EVENT_END):
                chunk = pending + chunk
                end = chunk.rfind(_EVENT_END)
                cut = end + 2 if end >= 0 else 0
                pending, chunk = chunk[cut:], chunk[:cut]
            if chunk:
                writing = True
                await response.write(chunk)  # awaits the drain: back-pressure
                writing = False
            chunk = await upstream.readany()
        if _DONE not in last:
            raise UpstreamError("dropped", "the stream ended without [DONE]")
    except (UpstreamError, aiohttp.ClientConnectionError, OSError, TimeoutError) as exc:
        if writing:
            raise ClientGone(response) from exc
        outcome.failed_mid_stream = True
        code, message = (
            (504, "the worker timed out mid-stream")
            if isinstance(exc, TimeoutError)
            else (502, "the worker failed mid-stream")
        )
        await _client_write(response, response.write(stream_error_event(code, message)))
    outcome.cached_tokens = cached_tokens(last_usage) if last_usage else None
    await _client_write(response, response.write_eof())
    return response, outcome


class ClientGone(Exception):
    """The client went away while ``response`` (already prepared) was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("the client went away")
        self.response = response


async def _client_write(response: web.StreamResponse, write: Awaitable[object]) -> None:
    try:
        await write
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
        raise ClientGone(response) from exc


async def abort(
    session: aiohttp.ClientSession,
    url: str,
    rid: str,
    timeout_s: float,
    path: str = "/abort_request",
) -> None:
    """Ask the worker to stop ``rid`` (fire and forget: errors are ignored)."""
    try:
        async with session.post(
            url + path,
            json={"rid": rid},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError, OSError, asyncio.CancelledError):
        pass
