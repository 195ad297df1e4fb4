"""What the gateway writes upstream of its own: the request target, the request id (rid)
it gives the worker, and the client headers it forwards.

Contract:
- :func:`upstream_target` turns the client's request target into the canonical origin-form
  path the worker gets: the path only (a query, a fragment and an absolute-form URL's
  scheme and authority are dropped: no API route takes a query), percent-decoded once
  (``/v1/%63ompletions`` is the ``/v1/completions`` aiohttp routed), and refused
  (``ValueError``) unless it is plain segments of unreserved characters.
- :func:`new_rid` is the upstream rid: 128 random bits, owned by the gateway. The
  worker's aborts (``/abort_request {"rid"}``) name only rids the gateway made, so no
  client can name (and abort) another client's request, nor inject bytes through it.
- :func:`body_with_rid` sets the body's ``rid`` member to the gateway's, replacing one the
  client sent (re-serialising that rare body with orjson) or appending one (bytes
  inserted before the closing brace, nothing else touched: the common case);
  :func:`body_with_members` does the same for any members (the rid and the DP rank the
  gateway chose), removing the client's own spellings of them. A body it must
  re-serialise but cannot (nested over 254 levels) is the client's 400.
- :func:`forwarded_headers` is the client's headers minus hop-by-hop ones (RFC 9110
  §7.6.1: the fixed list, ``Proxy-Connection``, and every name the client's
  ``Connection`` header lists), minus the body's encoding (aiohttp decoded the body the
  gateway forwards) and ``Accept-Encoding`` (an encoded event stream could not be cut
  into events), minus the request id and content type (the gateway sets its own), minus
  the headers by which SGLang lets its router override the body's members (every
  ``x-override-*``: the rid, the bootstrap room, host and port, the DP ranks, the
  priority; and ``X-Data-Parallel-Rank``: the gateway is that router), minus ``drop``.

Cost: a regular-expression match per target; a few dictionary looks per header.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote, urlsplit

import orjson

from gateway.errors import GatewayError

# Never forwarded in either direction (RFC 9110 §7.6.1), plus lengths aiohttp recomputes.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
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
# request headers that describe the client's bytes, not the body the gateway sends, and
# those the gateway sets itself (the request id, the JSON content type)
_NOT_FORWARDED = HOP_BY_HOP | {
    "content-encoding",
    "accept-encoding",
    "x-request-id",
    "content-type",
    "x-data-parallel-rank",  # SGLang's DP rank, over the body's
}
_OVERRIDE = "x-override-"  # SGLang's request_headers: each overrides a body member
_SEGMENTS = re.compile(r"(?:/[A-Za-z0-9._~-]+)+")
_DOT_SEGMENT = re.compile(r"/\.\.?(?:/|$)")


@functools.lru_cache(maxsize=256)  # a handful of API paths; a refused one is not cached
def upstream_target(raw_target: str) -> str:
    """The canonical origin-form path for ``raw_target`` (see the module contract)."""
    path = unquote(urlsplit(raw_target).path, errors="strict")
    if not _SEGMENTS.fullmatch(path) or _DOT_SEGMENT.search(path):
        raise ValueError("the request path is not a plain API path")
    return path


def new_rid() -> str:
    """A fresh upstream rid (as unique as ``uuid4().hex``; SGLang's own have no prefix)."""
    return os.urandom(16).hex()


def body_with_rid(body: bytes, rid: str, *, has_rid: bool) -> bytes:
    """``body`` (a JSON object) with its ``rid`` member set to ``rid``. ``has_rid``: the
    client's body holds a ``rid`` member (the parser knows: the key may be escaped)."""
    return body_with_members(body, {"rid": rid}, rewrite=has_rid)


def body_with_members(
    body: bytes, members: Mapping[str, object], *, rewrite: bool, drop: Iterable[str] = ()
) -> bytes:
    """``body`` (a JSON object) with ``members`` set. ``rewrite``: the client's body may
    hold one of them or of ``drop`` (removed): it is re-serialised; else the members are
    appended before the closing brace, nothing else touched (the common case)."""
    if rewrite:
        obj = orjson.loads(body)
        for key in drop:
            obj.pop(key, None)
        obj.update(members)
        try:
            return orjson.dumps(obj)
        except orjson.JSONEncodeError:  # read to 1,024 levels deep, written to 254
            raise GatewayError(400, "the request body is nested too deeply") from None
    close = body.rindex(b"}")
    sep = b"" if body[:close].rstrip().endswith(b"{") else b","
    added = b",".join(orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in members.items())
    return body[:close] + sep + added + body[close:]


def connection_listed(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The lower-case names a ``Connection`` header lists (hop-by-hop by declaration)."""
    names: set[str] = set()
    for key, value in headers:
        if key.lower() == "connection":
            names.update(t.strip().lower() for t in value.split(",") if t.strip())
    return frozenset(names)


def forwarded_headers(
    headers: Iterable[tuple[str, str]], drop: frozenset[str]
) -> list[tuple[str, str]]:
    """The client headers that go upstream (see the module contract)."""
    items = list(headers)
    listed = connection_listed(items)
    return [
        (key, value)
        for key, value in items
        if (name := key.lower()) not in _NOT_FORWARDED
        and name not in drop
        and name not in listed
        and not name.startswith(_OVERRIDE)
    ]
