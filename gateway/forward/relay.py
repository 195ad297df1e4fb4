"""Forwarding one attempt to one worker, and relaying its answer to the client.

Contract:
- :func:`send` posts the body to the worker (``gateway.forward.upstream``) at the
  canonical target (``gateway.forward.outbound.upstream_target``) and returns its
  response head, or raises :class:`AttemptFailed` (``connect``: nothing reached the worker
  or it hung up before answering; ``timeout``). Nothing has reached the client then, so
  the router may retry. A target or header the gateway must not write (CR, LF or NUL in
  a value, a path that is not a plain API path) is the client's 400, sent nowhere.
- :func:`relay` sends the worker's answer to the client and returns the outcome.
  * A 5xx or 429 head is reported as ``AttemptFailed("status")`` (body read, bounded,
    connection reusable) unless ``final``, so the router can try another worker. A 3xx is
    never followed nor relayed (its ``Location`` is the worker's to give, not the
    client's to follow): ``AttemptFailed("connect")``.
  * SSE (``200`` + ``text/event-stream``, any case): the client's response is prepared
    only at the worker's first body bytes, so a worker that fails before them is still
    retryable; they mark time to first token. Then whole events (``gateway.forward.sse``:
    CRLF, CR or LF line ends; a last event without its blank line) are written as they
    complete (``readany`` → ``write``, which awaits the transport's drain: back-pressure).
    The stream succeeded when an event's data was ``[DONE]``; a failure before it is
    followed by exactly one SGLang error event and ``data: [DONE]``. Nothing after
    ``[DONE]`` is relayed: the rest of the worker's body is read and dropped, at most
    64 KiB within 1 s (then the connection is reused), else the connection is closed,
    a failure there ending the stream quietly. An event larger than the pool's
    ``max_event_bytes`` ends the stream with a 502 error event, nothing of it held beyond
    the bound. An encoded stream (``Content-Encoding``) cannot be cut into events:
    ``AttemptFailed("connect")``.
  * Anything else is read whole (at most the pool's ``max_body_bytes``: beyond, the
    attempt failed, ``dropped``) and relayed as is (status, body, content type).
- Client disconnect (write fails, or the handler is cancelled), or a client that takes
  no byte of a write for the pool's ``client_write_timeout_s``: the upstream connection is
  closed and ``/abort_request`` is sent to the worker in the background; the caller's
  lease is released by the caller's ``finally``. Once the client has ``[DONE]``, its
  leaving (many clients close at once) is no disconnect: the request is complete, its
  usage learnt; only the rest of the worker's body is dropped. A stream cut by its
  deadline while the client, not the worker, held it back is not the worker's failure
  (``Outcome.failed_mid_stream`` stays false).
- Response headers: hop-by-hop ones and every name the worker's ``Connection`` lists are
  dropped, as are ``Date``/``Server`` (aiohttp sets its own).
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

from gateway.errors import GatewayError, stream_error_event
from gateway.forward.outbound import (
    HOP_BY_HOP,
    connection_listed,
    forwarded_headers,
    upstream_target,
)
from gateway.forward.sse import EventFramer, EventTooLarge, ends_with_done, parse
from gateway.forward.ticker import LoopTicker
from gateway.forward.upstream import FirstByteTimeout, UpstreamError, UpstreamPool, UpstreamResponse

__all__ = ["HOP_BY_HOP", "AttemptFailed", "ClientGone", "Outcome"]

_NOT_RELAYED = HOP_BY_HOP | {"date", "server"}
# usage / meta_info "cached_tokens"; llama.cpp's timings "cache_n" (the same number)
_CACHED = re.compile(rb'"(?:cached_tokens|cache_n)"\s*:\s*(\d+)')
_CACHED_MARKS = (b'"cached_tokens"', b'"cache_n"')
# usage "prompt_tokens": the engine's count, from which routing learns its token ratio
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_OUTPUT = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# meta_info / sglext "cached_tokens_details": {"device": N, "host": M[, "storage": S,
# "storage_backend": "..."]} (SGLang 0.5.9+, HiCache): a flat object, read bounded
_DETAILS = re.compile(rb'"cached_tokens_details"\s*:\s*\{([^{}]{0,512})\}')
_DETAILS_MARK = b'"cached_tokens_details"'
_TIER = re.compile(rb'"(device|host|storage)"\s*:\s*(\d+)')
_BAD_VALUE = re.compile(r"[\r\n\x00]")
_DONE = b"[DONE]"
# after [DONE], how much more of the worker's body is read (and dropped), and for how long
_AFTER_DONE_BYTES = 64 * 1024
_AFTER_DONE_S = 1.0


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
        self.worker: str | None = None  # which worker failed, when the caller must say (PD)


@dataclass(frozen=True, slots=True)
class CachedTiers:
    """Where a worker's cached tokens came from (``cached_tokens_details``): its GPU, the
    host tier it loaded them back from (HiCache), an L3 storage backend."""

    device: int
    host: int
    storage: int = 0


@dataclass(slots=True)
class Outcome:
    """What one relayed answer turned out to be."""

    status: int = 0
    ttft_s: float | None = None
    cached_tokens: int | None = None  # as the worker reported it
    prompt_tokens: int | None = None  # the worker's usage.prompt_tokens, if reported
    output_tokens: int | None = None  # the worker's usage.completion_tokens, if reported
    # the worker's cached_tokens_details (/generate's meta_info; the OpenAI routes' sglext
    # when the client asked return_cached_tokens_details), if reported
    cached_tiers: CachedTiers | None = None
    failed_mid_stream: bool = False
    client_gone: bool = False


def upstream_headers(
    headers: CIMultiDictProxy[str],
    request_id: str,
    extra: Mapping[str, str],
    drop: frozenset[str] = frozenset(),
) -> list[tuple[str, str]]:
    """The client's headers as ``gateway.forward.outbound.forwarded_headers`` keeps them
    (``drop``: lower-case names, the client's credentials, see
    ``gateway.forward.credentials``), with the request id, a JSON content type (and
    ``extra``) set."""
    out = forwarded_headers(headers.items(), drop)
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
    first_byte_timeout_s: float | None = None,
) -> UpstreamResponse:
    """Send one attempt; ``first_byte_timeout_s`` (None: the pool's) bounds its head."""
    try:
        target = upstream_target(path)
        return await pool.request(url, target, headers, body, deadline, first_byte_timeout_s)
    except ValueError as exc:  # nothing was sent: the client's input cannot go upstream
        raise GatewayError(400, f"the request cannot be forwarded: {exc}") from None
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
    return _last_count(_CACHED, data)


def cached_tiers(data: bytes) -> CachedTiers | None:
    """The last ``"cached_tokens_details": {...}`` object in ``data``, or None (absent,
    or null: SGLang's answer without a hit)."""
    found = _DETAILS.findall(data)
    if not found:
        return None
    tiers = {k: int(v) for k, v in _TIER.findall(found[-1])}
    return CachedTiers(tiers.get(b"device", 0), tiers.get(b"host", 0), tiers.get(b"storage", 0))


def prompt_tokens(data: bytes) -> int | None:
    """The last ``"prompt_tokens": N`` in ``data`` (``usage``), or None."""
    return _last_count(_PROMPT, data)


def output_tokens(data: bytes) -> int | None:
    """The last ``"completion_tokens": N`` in ``data`` (``usage``), or None."""
    return _last_count(_OUTPUT, data)


def _last_count(pattern: re.Pattern[bytes], data: bytes) -> int | None:
    found = pattern.findall(data)
    return int(found[-1]) if found else None


def _response_headers(upstream: UpstreamResponse, extra: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    listed = connection_listed(upstream.headers)
    for key, value in upstream.headers:
        name = key.lower()
        # llhttp refused CR, LF and NUL in values already: the check costs little here
        if name not in _NOT_RELAYED and name not in listed and not _BAD_VALUE.search(value):
            out.add(key, value)
    out.update(extra)
    return out


def _media_type(upstream: UpstreamResponse) -> str:
    return (upstream.header("content-type") or "").partition(";")[0].strip().lower()


async def relay(
    request: web.Request,
    upstream: UpstreamResponse,
    *,
    stream: bool,
    final: bool,
    extra_headers: Mapping[str, str],
    started: float,
    on_first_byte: Callable[[], None],
    transform: Callable[[bytes], bytes] | None = None,
) -> tuple[web.StreamResponse, Outcome]:
    """Relay ``upstream`` to the client (see the module contract). ``transform`` rewrites
    a 2xx answer on its way (a non-streamed body whole; whole events of a stream, LF
    line ends, as they complete), after the usage figures were read from it."""
    status = upstream.status
    limits = upstream.limits
    if (status >= 500 or status == 429) and not final:
        body = await _read_body(upstream, limits.max_body_bytes)
        raise AttemptFailed(
            "status", f"the worker answered {status}", status, body, dict(upstream.headers)
        )
    if 300 <= status < 400 and status != 304:  # 304 Not Modified is no redirect
        upstream.close()
        raise AttemptFailed("connect", f"the worker answered a redirect ({status})")
    if stream and status == 200 and _media_type(upstream) == "text/event-stream":
        if (upstream.header("content-encoding") or "identity").strip().lower() != "identity":
            upstream.close()
            raise AttemptFailed("connect", "the worker encoded its event stream")
        return await _relay_sse(request, upstream, extra_headers, started, on_first_byte, transform)
    body = await _read_body(upstream, limits.max_body_bytes)
    on_first_byte()
    outcome = Outcome(status, cached_tokens=cached_tokens(body), prompt_tokens=prompt_tokens(body))
    outcome.output_tokens = output_tokens(body)
    outcome.cached_tiers = cached_tiers(body)
    if transform is not None and 200 <= status < 300:
        body = transform(body)
    response = web.Response(
        status=status, body=body, headers=_response_headers(upstream, extra_headers)
    )
    return response, outcome


async def read_whole(upstream: UpstreamResponse) -> bytes:
    """The rest of ``upstream``'s body, bounded by the pool's ``max_body_bytes``;
    AttemptFailed if the worker drops it, times out or exceeds the bound."""
    return await _read_body(upstream, upstream.limits.max_body_bytes)


async def _read_body(upstream: UpstreamResponse, limit: int) -> bytes:
    try:
        return await upstream.read(limit)
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


class _WriteWatch:
    """Closes the client's connection when one write takes no byte for ``limit_s``: a
    client that stopped reading must not hold a worker's slot until the request's
    deadline. Checked four times per period by one timer shared by every stream of the
    loop (:class:`gateway.forward.ticker.LoopTicker`), not one timer per stream."""

    __slots__ = ("_limit", "_request", "_ticker", "since")

    def __init__(self, request: web.Request, limit_s: float) -> None:
        self._request = request
        self._limit = limit_s
        self.since: float | None = None  # when the pending write began, None if none
        self._ticker = LoopTicker.watch(self, limit_s / 4) if limit_s > 0 else None

    def tick(self, now: float) -> bool:
        """The ticker's check: a write pending for the limit cuts the client (and ends
        the watch)."""
        since = self.since
        if since is not None and now - since >= self._limit:
            self._ticker = None
            self.cut()
            return False
        return True

    def cut(self) -> None:
        transport = self._request.transport
        if transport is not None:
            transport.abort()  # not close(): that would wait for the unsent bytes

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.discard(self)
            self._ticker = None


async def _relay_sse(
    request: web.Request,
    upstream: UpstreamResponse,
    extra_headers: Mapping[str, str],
    started: float,
    on_first_byte: Callable[[], None],
    transform: Callable[[bytes], bytes] | None,
) -> tuple[web.StreamResponse, Outcome]:
    chunk = await _first_chunk(upstream)
    outcome = Outcome(status=200, ttft_s=time.perf_counter() - started)
    on_first_byte()
    response = _EventStream(status=200, headers=_response_headers(upstream, extra_headers))
    await _client_write(response, response.prepare(request))  # the head waits for a write
    limits = upstream.limits
    framer = EventFramer(limits.max_event_bytes)
    watch = _WriteWatch(request, limits.client_stall_s)
    loop = asyncio.get_running_loop()
    last_usage = last_prompt = last_details = b""
    delivered = False  # the client has [DONE]: from then on its leaving loses it nothing
    try:
        try:
            while chunk:
                events = framer.feed(chunk)
                if events:
                    if framer.done:  # nothing the worker sends after [DONE] is relayed
                        events = _through_done(events)
                    if any(mark in events for mark in _CACHED_MARKS):
                        last_usage = events
                    if b'"prompt_tokens"' in events:
                        last_prompt = events
                    if _DETAILS_MARK in events:
                        last_details = events
                    if transform is not None:
                        events = transform(events)
                    # the last events and the body's end leave in one write when the
                    # worker's body ended too (else the end waits for the rest dropped)
                    await _write(response, events, watch, loop, framer.done and upstream.ended)
                    delivered = framer.done
                    if delivered:
                        await _drop_rest(upstream)
                        break
                elif not response.head_sent:  # the first event is still incomplete
                    await _write(response, b"", watch, loop)
                chunk = await upstream.readany()
            else:
                events = framer.end()  # the body ended cleanly: a last unterminated event
                if events:
                    events = transform(events) if transform else events
                    await _write(response, events, watch, loop, last=framer.done)
                    delivered = framer.done
                if not framer.done:
                    raise UpstreamError("dropped", "the stream ended without [DONE]")
        except (asyncio.CancelledError, ClientGone):
            if not delivered:
                raise
            # a client that closes as soon as it read [DONE] (many do) cancels this
            # handler while the worker's body ends: the request is complete, learn from it
            _uncancel()
            upstream.close()
        except (UpstreamError, aiohttp.ClientConnectionError, OSError, TimeoutError) as exc:
            if not framer.done:
                outcome.failed_mid_stream = not _client_held(upstream, exc)
                code, message = (
                    (504, "the worker timed out mid-stream")
                    if isinstance(exc, TimeoutError)
                    else (502, "the worker failed mid-stream")
                )
                await _write(response, stream_error_event(code, message), watch, loop)
            upstream.close()
        except EventTooLarge:
            outcome.failed_mid_stream = True
            upstream.close()
            message = f"an event from the worker exceeds {limits.max_event_bytes} bytes"
            await _write(response, stream_error_event(502, message), watch, loop)
        # the body's end is watched too: write_eof always drains, so a client that stopped
        # reading once the last events were handed to the transport (aiohttp drains a
        # write only every 64 KiB) would hold this handler, its connection, forever
        try:
            await _write(response, b"", watch, loop, last=True)
        except (asyncio.CancelledError, ClientGone):
            if not delivered:
                raise
            _uncancel()  # the client had [DONE]: closing now, it lost nothing
    finally:
        watch.stop()
    outcome.cached_tokens = cached_tokens(last_usage) if last_usage else None
    outcome.prompt_tokens = prompt_tokens(last_prompt) if last_prompt else None
    outcome.output_tokens = output_tokens(last_prompt) if last_prompt else None
    outcome.cached_tiers = cached_tiers(last_details) if last_details else None
    return response, outcome


def _through_done(events: bytes) -> bytes:
    """``events`` (whole, LF-normalised) up to and including the first ``[DONE]`` one."""
    if events.find(_DONE) == len(events) - len(_DONE) - 2 and ends_with_done(events):
        return events  # the common case: [DONE] is the last event and no earlier one
    end = 0
    for part in events.split(b"\n\n"):
        end += len(part) + 2
        if _DONE in part and any(e.data == "[DONE]" for e in parse(part + b"\n\n")):
            return events[:end]
    return events


async def _drop_rest(upstream: UpstreamResponse) -> None:
    """After ``[DONE]``: the rest of the worker's body is read and dropped, at most
    ``_AFTER_DONE_BYTES`` of it within ``_AFTER_DONE_S`` (SGLang ends its body at once, and
    the connection is reused); a worker that goes on, or stays silent, is cut there,
    rather than hold the request (its lease, the client's response) until the deadline."""
    if upstream.ended:  # the common case: nothing left, the connection is pooled already
        upstream.close()
        return
    left = _AFTER_DONE_BYTES
    try:
        async with asyncio.timeout(_AFTER_DONE_S):
            while left > 0 and (data := await upstream.readany()):
                left -= len(data)
    except (UpstreamError, TimeoutError):
        pass
    upstream.close()  # nothing to drop if the body ended (the connection is pooled)


def _uncancel() -> None:
    """Take back a cancellation of the current task, if any (the client left after
    [DONE]): the handler goes on to record a complete request instead of a 499. A
    cancellation for another reason (the gateway stopping) is taken back too: all that
    is left to do once [DONE] went out is this request's bookkeeping, no await."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.uncancel()


async def _write(
    response: _EventStream,
    data: bytes,
    watch: _WriteWatch,
    loop: asyncio.AbstractEventLoop,
    last: bool = False,
) -> None:
    """One client write (awaits the drain: back-pressure), watched for a stalled client;
    ``last``: with the end of the body (the chunked encoding's last chunk)."""
    watch.since = loop.time()
    response.head_sent = True
    try:
        await (response.write_eof(data) if last else response.write(data))
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, OSError) as exc:
        raise ClientGone(response) from exc
    finally:
        watch.since = None


def _client_held(upstream: UpstreamResponse, exc: BaseException) -> bool:
    """The deadline cut a stream the client was holding back (not the worker's fault)."""
    return isinstance(exc, TimeoutError) and upstream.expired and upstream.held_by_reader


class _EventStream(web.StreamResponse):
    """The relayed event stream. Its head is held until the first body write and leaves
    with it, in one ``send`` (aiohttp's buffered-head mode, the one ``web.Response`` uses):
    on loopback each send costs the gateway the receiver's wake-up too. The relay writes
    the head alone (``write(b"")``) when the worker's first bytes hold no whole event."""

    _send_headers_immediately = False
    head_sent = False  # set by the relay's first write


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
    """Ask the worker to stop ``rid`` (fire and forget: errors are ignored; a redirect is
    not followed)."""
    try:
        async with session.post(
            url + path,
            json={"rid": rid},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
        ) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError, OSError, asyncio.CancelledError):
        pass
