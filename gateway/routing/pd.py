"""Prefill/decode disaggregation (docs/PD.md): what a PD pair's request carries, and the
prefill's input logprobs merged into the decode's answer. The router does the I/O.

Contract:
- :func:`pair_body` is the client's body with the bootstrap fields SGLang's PD servers
  meet by: ``bootstrap_host`` (the prefill URL's host, IPv6 in brackets),
  ``bootstrap_port`` (the port configured for that prefill worker, else the one its
  ``/server_info`` tells, else ``null``: each server's own default) and
  ``bootstrap_room``, a fresh random integer per attempt. One scalar room serves a batch
  too: SGLang expands it to ``room + i`` per item on both servers alike
  (``GenerateReqInput._normalize_bootstrap_params``), so the room is drawn below
  ``2**63 - 2**32``; for a prefill's DP rank, a room of that rank (:func:`new_room`).
  The client's own bootstrap fields, rid and DP rank members (``disagg_prefill_dp_rank``
  too) are replaced (a client cannot pick another request's room). The same body goes
  to both.
- :func:`wants_input_logprobs`: the request asks for input logprobs that only the prefill
  computes (``/generate`` with ``return_logprob``; the OpenAI routes carry none in their
  answers, so nothing is merged there, as sglang-router).
- :func:`input_logprobs` reads them from the prefill's answer (a JSON body or its stream's
  events); :func:`merger` returns the transform that prepends them to the decode's
  ``meta_info.input_token_logprobs`` (a batch's list item by item; a body or event it
  cannot parse or write back, as it came).

Cost: one JSON parse and serialisation of the body per attempt; a logprob merge parses
and re-serialises each event of that (rare) request.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import orjson

from gateway.forward.outbound import body_with_members
from gateway.forward.sse import parse
from gateway.routing.request import DP_RANK_KEYS, ApiKind

BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# SGLang's hint naming the prefill rank that holds the KV (0.5.23): the client's would
# send the decode elsewhere, both sides then waiting for each other up to their timeouts
PREFILL_RANK_KEY = "disagg_prefill_dp_rank"
_ROOM_BOUND = (1 << 63) - (1 << 32)  # room + i stays a 63-bit integer for any batch


def new_room(rank: int | None = None, ranks: int = 1) -> int:
    """A bootstrap room: random, 63-bit (sglang-router's range), batch headroom left. For
    DP rank ``rank`` of a prefill with ``ranks`` ranks, one with ``room % ranks == rank``:
    SGLang's decode fetches the KV from that rank (``_resolve_prefill_dp_rank``), and its
    prefill puts the request there by default (``follow_bootstrap_room``), failing one
    pinned elsewhere ("follow_bootstrap_room conflict")."""
    if rank is None or ranks <= 1:
        return secrets.randbelow(_ROOM_BOUND)
    return secrets.randbelow(_ROOM_BOUND // ranks) * ranks + rank


def bootstrap_host(url: str) -> str:
    """The host a decode server reaches the prefill's bootstrap server at: the prefill
    URL's (sglang-router's rule), an IPv6 literal in brackets."""
    host = urlsplit(url).hostname or "localhost"
    return f"[{host}]" if ":" in host else host


def pair_body(
    body: bytes,
    prefill_url: str,
    port: int | None,
    room: int,
    extra: Mapping[str, object],
) -> bytes:
    """The body both servers of the pair get (module contract); ``extra``: the rid and
    DP rank members the router sets."""
    members: dict[str, object] = {
        "bootstrap_host": bootstrap_host(prefill_url),
        "bootstrap_port": port,
        "bootstrap_room": room,
        **extra,
    }
    drop = (*BOOTSTRAP_KEYS, PREFILL_RANK_KEY, *DP_RANK_KEYS)
    return body_with_members(body, members, rewrite=True, drop=drop)


def wants_input_logprobs(kind: ApiKind, body: bytes) -> bool:
    """``/generate`` asking ``return_logprob`` (any truthy value, or a list with one)."""
    if kind is not ApiKind.GENERATE or b"return_logprob" not in body:
        return False
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    flag = obj.get("return_logprob") if isinstance(obj, dict) else None
    return any(flag) if isinstance(flag, list) else bool(flag)


def input_logprobs(answer: bytes) -> list[Any] | None:
    """The prefill's ``meta_info.input_token_logprobs``: per batch item (a list of
    lists, None where an item has none), or None when the answer holds none."""
    docs: list[Any] = []
    stripped = answer.lstrip()
    if stripped.startswith(b"data:"):
        for event in parse(answer):
            if event.data and event.data != "[DONE]":
                try:
                    docs.append(orjson.loads(event.data))
                except orjson.JSONDecodeError:
                    continue
    else:
        try:
            docs.append(orjson.loads(answer))
        except orjson.JSONDecodeError:
            return None
    found: dict[int, list[Any]] = {}
    for doc in docs:
        for i, item in enumerate(doc if isinstance(doc, list) else [doc]):
            lp = _logprobs(item)
            if lp is not None and i not in found:
                found[i] = lp
    if not found:
        return None
    return [found.get(i) for i in range(max(found) + 1)]


def _logprobs(item: Any) -> list[Any] | None:
    meta = item.get("meta_info") if isinstance(item, dict) else None
    lp = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return lp if isinstance(lp, list) else None


def merger(prefill: list[Any]) -> Callable[[bytes], bytes]:
    """The transform that prepends ``prefill``'s input logprobs to the decode's."""

    def merge_doc(doc: Any) -> Any:
        items = doc if isinstance(doc, list) else [doc]
        for i, item in enumerate(items):
            head = prefill[i] if i < len(prefill) else None
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if head is not None and isinstance(meta, dict):
                tail = meta.get("input_token_logprobs")
                meta["input_token_logprobs"] = head + (tail if isinstance(tail, list) else [])
        return doc

    def transform(data: bytes) -> bytes:
        if not data.lstrip().startswith(b"data:"):
            try:
                return orjson.dumps(merge_doc(orjson.loads(data)))
            except (orjson.JSONDecodeError, orjson.JSONEncodeError):  # too deep to write
                return data
        out = []
        for block in data.split(b"\n\n"):
            line = block.strip()
            if line.startswith(b"data:") and b"meta_info" in line and b"\n" not in line:
                try:
                    doc = orjson.loads(line[5:].strip())
                    block = b"data: " + orjson.dumps(merge_doc(doc))
                except (orjson.JSONDecodeError, orjson.JSONEncodeError):
                    pass
            out.append(block)
        return b"\n\n".join(out)

    return transform
