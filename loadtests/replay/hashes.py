"""The gateway's view of a workload request (:class:`gateway.routing.request.RouteRequest`).

Generic path: the JSON body a live client would send, through
``gateway.routing.request.parse_request`` itself, so hashing is the gateway's own.

Trace path (Mooncake, Azure): rendering a 12,000-token prompt to text and hashing it costs
about 2 ms, and the conversation trace has 12,031 of them, mostly repeating the same
blocks. :class:`TraceHasher` computes the very same chained hashes
(``H_i = H_{i-1} xor xxh3_64(block_i, seed + i)`` over the canonical chat rendering,
``gateway.routing.hashing``) incrementally, rendering each trace block once: the chain state at
the end of a full trace block depends only on its chained id, so it is memoised per id.
:meth:`TraceHasher.check` compares the result with ``parse_request`` on a real body and
the replay runs it before using the trace path (falling back to the generic path if the
gateway's canonical rendering ever changes); the tests do the same on real trace rows.

Memory: 32 hashes (256 bytes) plus a few bytes of tail per distinct full block: about
60 MB for the Mooncake conversation trace's 183k distinct blocks.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import orjson
from xxhash import xxh3_64_intdigest

from gateway.routing.hashing import seed_for
from gateway.routing.request import ApiKind, RequestSettings, RouteRequest, parse_request
from loadtests.workloads.base import DEFAULT_MODEL, TracePrompt, WorkloadRequest
from loadtests.workloads.text import PIECES, PieceCodec

# The canonical rendering of one user message (gateway.routing.request): role, field end,
# content, field end, message end.
_HEADER = b"user\x1f"
_TRAILER = b"\x1f\x1e"


def parse_body(req: WorkloadRequest, settings: RequestSettings, model: str) -> RouteRequest:
    """The gateway's parse of the body a live client sends for ``req``."""
    body = orjson.dumps(req.body(model=model))
    return parse_request(ApiKind.CHAT, body, {}, settings)


@dataclass(slots=True)
class _Chain:
    """Hash chain state: last hash, number of hashed blocks, bytes not yet a full block."""

    last: int
    count: int
    tail: bytes


class TraceHasher:
    """Exact gateway block hashes of trace prompts, memoised per chained block id."""

    def __init__(self, settings: RequestSettings, model: str = DEFAULT_MODEL) -> None:
        self._settings = settings
        self._model = model
        self._block = settings.block_chars
        self._seed = seed_for(model, None)
        self._memo: dict[int, tuple[array[int], bytes]] = {}
        self._text = PieceCodec([p.encode() for p in PIECES])

    def _advance(self, chain: _Chain, data: bytes, out: array[int]) -> _Chain:
        data = chain.tail + data
        size, last, count = self._block, chain.last, chain.count
        full = len(data) // size
        for m in range(full):
            last ^= xxh3_64_intdigest(data[m * size : (m + 1) * size], self._seed + count)
            count += 1
            out.append(last)
        return _Chain(last, count, data[full * size :])

    def hashes(self, prompt: TracePrompt) -> array[int]:
        """The block hashes ``parse_request`` gives the body of ``prompt``."""
        out: array[int] = array("Q")
        chain = _Chain(0, 0, b"")
        chain = self._advance(chain, _HEADER, out)
        sizes = prompt.block_sizes()
        for pos, (hid, n) in enumerate(zip(prompt.hash_ids, sizes, strict=True)):
            if pos == len(sizes) - 1:
                text = self._text.encode(prompt.block_seed(hid), n) + _TRAILER
                self._advance(chain, text, out)
                break
            memo = self._memo.get(hid)
            if memo is None:
                part: array[int] = array("Q")
                text = self._text.encode(prompt.block_seed(hid), n)
                after = self._advance(chain, text, part)
                memo = (part, after.tail)
                self._memo[hid] = memo
            part, tail = memo
            out.extend(part)
            chain = _Chain(part[-1] if part else chain.last, chain.count + len(part), tail)
        return out

    def route_request(self, req: WorkloadRequest) -> RouteRequest:
        """What ``parse_request`` returns for ``req``'s body (trace requests only)."""
        if req.trace is None:
            raise ValueError("not a trace request")
        chars = len(_HEADER) + 4 * req.trace.input_tokens + len(_TRAILER)
        return RouteRequest(
            kind=ApiKind.CHAT,
            model=self._model,
            stream=True,
            include_usage=True,
            prompt_chars=chars,
            prompt_tokens=math.ceil(chars / self._settings.chars_per_token),
            block_hashes=self.hashes(req.trace).tolist(),
            routing_key=req.session_id,
            rid=None,
            body=b"{}",
            block_chars=self._block,
        )

    def check(self, req: WorkloadRequest) -> bool:
        """Whether the trace path agrees with ``parse_request`` on ``req``."""
        fast = self.route_request(req)
        slow = parse_body(req, self._settings, self._model)
        return (fast.block_hashes, fast.prompt_chars, fast.prompt_tokens) == (
            slow.block_hashes,
            slow.prompt_chars,
            slow.prompt_tokens,
        )
