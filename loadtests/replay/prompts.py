"""Workload request → what the gateway sees (``RouteRequest``) and what the worker gets
(token ids), plus the block structure the bounds are computed on.

Token ids are the simulator's own: ``simulator.model.tokenizer`` and its ChatML template, as
the HTTP simulator tokenizes a chat request. They are assembled per message (template
header, then content + end marker), memoised per content string; a request's ``tools``
(rendered into the system message) and an assistant's tool calls (rendered after its
content) are rendered by the simulator's template one message at a time, memoised per
rendering. The template is append-only, so the concatenation equals
``encode_chat(messages, tools)`` — checked on the first request of each kind, with
``encode_chat`` used instead if it ever differs.

Trace prompts are assembled per block: each pseudo-text piece is one simulator token, so
a block's ids are a table look-up of its piece ids (``loadtests.workloads.text``); the
gateway's hashes come from :class:`~loadtests.replay.hashes.TraceHasher`. Both fast
paths are verified against the slow ones on the first trace request.

Bound blocks (``loadtests.replay.bounds``): the prompt's token sequence cut into *segments* at
every place two prompts of these workloads can diverge — per message its template header
and its body; for traces the template header, each trace block, and the template trailer
folded into the last block — and each segment into blocks of ``bound_block_tokens``
(traces: one block per trace block, as PERFORMANCE.md counts them). Ids are chained.
Divergence points being block boundaries, the worker's token-level hit can never exceed
the block-level bound of the same sequence (but for chance equality of a few tokens
after a divergence).
"""

from __future__ import annotations

from collections.abc import Hashable

from xxhash import xxh3_64_intdigest

from gateway.routing.request import RequestSettings
from loadtests.replay.bounds import BlockRequest
from loadtests.replay.hashes import TraceHasher, parse_body
from loadtests.replay.sim import Prepared
from loadtests.workloads.base import DEFAULT_MODEL, TracePrompt, WorkloadRequest
from loadtests.workloads.text import PIECES, PieceCodec
from simulator.model.radix_cache import encode_tokens
from simulator.model.tokenizer import SimTokenizer, default_tokenizer

_MEMO_LIMIT = 8192  # message contents kept tokenised (shared contexts, chat history)
_MASK = (1 << 63) - 1


class PromptBuilder:
    """Prepares requests for the replay (see module docstring). One per run."""

    def __init__(
        self,
        settings: RequestSettings | None = None,
        model: str = DEFAULT_MODEL,
        tokenizer: SimTokenizer | None = None,
        bound_block_tokens: int = 16,
    ) -> None:
        self.settings = settings or RequestSettings()
        self.model = model
        self.tok = tokenizer or default_tokenizer()
        self.bound_block_tokens = bound_block_tokens
        self._hasher = TraceHasher(self.settings, model)
        self._piece_tokens = PieceCodec([encode_tokens([self._single(p)]) for p in PIECES])
        self._head = self.tok.encode("<|im_start|>user\n")
        self._tail = self.tok.encode("<|im_end|>\n<|im_start|>assistant\n")
        self._gen = self.tok.encode("<|im_start|>assistant\n")
        self._head_key = encode_tokens(self._head)
        self._tail_key = encode_tokens(self._tail)
        self._memo: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._fast_trace: bool | None = None
        self._fast_chat: bool | None = None

    def _single(self, piece: str) -> int:
        ids = self.tok.encode(piece)
        if len(ids) != 1:
            raise ValueError(f"piece {piece!r} is not one simulator token")
        return ids[0]

    # --- prepare ---------------------------------------------------------------------

    def prepare(self, req: WorkloadRequest) -> Prepared:
        if req.trace is not None:
            return self._prepare_trace(req, req.trace)
        tokens = self._chat_tokens(req)
        if self._fast_chat is None:
            self._fast_chat = tokens == self._slow_chat(req)
        if not self._fast_chat:
            tokens = self._slow_chat(req)
        return Prepared(parse_body(req, self.settings, self.model), encode_tokens(tokens))

    def _slow_chat(self, req: WorkloadRequest) -> list[int]:
        """The worker's own tokenization of the request (messages and tools)."""
        return self.tok.encode_chat(req.chat_messages(), req.tool_dicts())

    def _prepare_trace(self, req: WorkloadRequest, trace: TracePrompt) -> Prepared:
        if self._fast_trace is None:
            slow = self.tok.encode_chat(req.chat_messages())
            fast = self._trace_key(trace)
            self._fast_trace = self._hasher.check(req) and encode_tokens(slow) == fast
        if not self._fast_trace:
            route = parse_body(req, self.settings, self.model)
            return Prepared(route, encode_tokens(self._slow_chat(req)))
        route = self._hasher.route_request(req)
        return Prepared(route, self._trace_key(trace))

    def _trace_key(self, trace: TracePrompt) -> bytes:
        """The prompt's radix key: template head, each block's piece tokens, tail."""
        codec = self._piece_tokens
        parts = [self._head_key]
        for hid, n in zip(trace.hash_ids, trace.block_sizes(), strict=True):
            parts.append(codec.encode(trace.block_seed(hid), n))
        parts.append(self._tail_key)
        return b"".join(parts)

    def _message(self, role: str, content: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        key = (role, content)
        hit = self._memo.get(key)
        if hit is None:
            head = tuple(self.tok.encode(f"<|im_start|>{role}\n"))
            body = tuple(self.tok.encode(f"{content}<|im_end|>\n"))
            hit = (head, body)
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.pop(next(iter(self._memo)))
            self._memo[key] = hit
        return hit

    def _rendered(self, role: str, text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A message the worker's template rendered as ``text`` (tools in the system
        message, tool calls after the content): its header and its body, memoised."""
        key = (f"{role}\x00rendered", text)
        hit = self._memo.get(key)
        if hit is None:
            head = f"<|im_start|>{role}\n"
            body = text[len(head) :] if text.startswith(head) else text
            hit = (tuple(self.tok.encode(head)), tuple(self.tok.encode(body)))
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.pop(next(iter(self._memo)))
            self._memo[key] = hit
        return hit

    def _segments(self, req: WorkloadRequest) -> list[tuple[int, ...]]:
        segments: list[tuple[int, ...]] = []
        messages = req.messages
        tools = req.tool_dicts()
        if tools:  # the template puts the tools in the (first) system message
            first = [messages[0].as_dict()] if messages[0].role == "system" else []
            text = self.tok.apply_chat_template(first, tools, add_generation_prompt=False)
            segments.extend(self._rendered("system", text))
            messages = messages[len(first) :]
        for m in messages:
            if m.tool_calls:
                text = self.tok.apply_chat_template([m.as_dict()], add_generation_prompt=False)
                segments.extend(self._rendered(m.role, text))
            else:
                segments.extend(self._message(m.role, m.content))
        segments.append(tuple(self._gen))
        return segments

    def _chat_tokens(self, req: WorkloadRequest) -> list[int]:
        return [t for seg in self._segments(req) for t in seg]

    # --- bounds ----------------------------------------------------------------------

    def bound_blocks(self, req: WorkloadRequest) -> BlockRequest:
        """The request's chained blocks for ``loadtests.replay.bounds`` (see module docstring)."""
        if req.trace is not None:
            trace = req.trace
            ids: tuple[Hashable, ...] = ("template-head", *trace.hash_ids)
            sizes = list(trace.block_sizes())
            sizes[-1] += len(self._tail)
            return BlockRequest(ids, (len(self._head), *sizes))
        out_ids: list[Hashable] = []
        out_sizes: list[int] = []
        prev = 0
        step = self.bound_block_tokens
        for seg in self._segments(req):
            for start in range(0, len(seg), step):
                chunk = seg[start : start + step]
                data = b"".join(t.to_bytes(4, "little") for t in chunk)
                prev = xxh3_64_intdigest(data, seed=prev & _MASK)
                out_ids.append(prev)
                out_sizes.append(len(chunk))
        return BlockRequest(tuple(out_ids), tuple(out_sizes))


def trace_block_requests(reqs: list[WorkloadRequest]) -> list[BlockRequest]:
    """Mooncake's own block structure (hash ids, 512 tokens, last partial) for the
    block-level bounds of PERFORMANCE.md §2; empty if any request is not a trace."""
    if any(r.trace is None for r in reqs):
        return []
    return [BlockRequest(r.trace.hash_ids, r.trace.block_sizes()) for r in reqs if r.trace]
