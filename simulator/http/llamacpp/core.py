"""What llama.cpp's routes share: the slot model, the ``Server`` header and the 404s, a
request from a body, llama.cpp's ``timings`` and ``usage``, and running a request.

Token limit: the first of the route's limit fields that is set (negative: none); without
one, a request runs to its natural stop (``natural_output_tokens``) or until its slot is
full. A plain request runs to its end even if its client left
(:meth:`LlamaCppCore._run_plain`); a streamed one answers once its first token is sampled,
is aborted when its client leaves, and its connection is closed after it
(:meth:`LlamaCppCore._stream`). Error bodies: :func:`llama_error`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from aiohttp import web

from simulator.config import SimConfig
from simulator.http import api
from simulator.http.api import ApiError
from simulator.http.base import HttpWorker, json_response
from simulator.model.driver import DrivenModel, RequestHandle
from simulator.model.requests import Finish, RequestOutput, SimRequest
from simulator.model.slots import ContextTooLong, SlotWorkerModel

SERVER_NAME = "llama.cpp"
BUILD_INFO = "b0-unknown"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Server": SERVER_NAME,
}

Events = Callable[[RequestHandle], list[dict[str, Any]]]
TextEvent = Callable[[RequestHandle, str], dict[str, Any]]


def llama_error(status: int, message: str, err_type: str, **extra: Any) -> ApiError:
    """llama.cpp's error body: ``{"error": {"code", "message", "type", ...}}``."""
    return ApiError(
        status, {"error": {"code": status, "message": message, "type": err_type, **extra}}
    )


class LlamaCppCore(HttpWorker):
    """The llama.cpp personality's model and request plumbing (see module docstring); the
    route families extend it and :class:`simulator.http.llamacpp.LlamaCppWorker` combines
    them. ``engine`` is the :class:`SlotWorkerModel`."""

    def __init__(
        self, config: SimConfig, host: str = "127.0.0.1", port: int = 0, index: int = 0
    ) -> None:
        super().__init__(config, host, port, index)
        self.engine = SlotWorkerModel.from_config(config, tokenizer=self.tokenizer)
        self.n_ctx: int = self.engine.n_ctx or 0
        self._slot_ids: dict[str, int] = {}  # rid → slot, for handlers that asked

    def _driven_model(self) -> DrivenModel:
        return self.engine

    # ------------------------------------------------------------------ 404s and the Server header
    def _not_found(self, request: web.BaseRequest) -> web.StreamResponse:
        return self._method_not_allowed()

    def _method_not_allowed(self) -> web.StreamResponse:
        error = {"message": "File Not Found", "type": "not_found_error", "code": 404}
        return json_response({"error": error}, 404)  # cpp-httplib: 404 for both

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        response = await super()._dispatch(request)
        if not response.prepared:
            response.headers["Server"] = SERVER_NAME
        return response

    # ------------------------------------------------------------------ request plumbing
    def _observe(self, handle: RequestHandle, out: RequestOutput) -> None:
        super()._observe(handle, out)
        if out.first_token and out.rid in self._slot_ids:
            slot = self.engine.slot_of(out.rid)
            self._slot_ids[out.rid] = slot.id if slot is not None else -1

    def _sim_request(self, body: dict[str, Any], prompt: list[int], *names: str) -> SimRequest:
        """The model's request: the first of ``names`` set is the token limit (none or
        -1: until the natural end or the slot is full)."""
        limit: int | None = None
        for name in names:
            value = body.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise llama_error(400, f"'{name}' must be an integer", "invalid_request_error")
                limit = value if value >= 0 else None
                break
        room = max(self.n_ctx - len(prompt), 0)
        eos_at = None if limit is not None else min(self.config.natural_output_tokens, room) or None
        return SimRequest(
            rid=secrets.token_hex(16),
            prompt_ids=prompt,
            max_new_tokens=room if limit is None else limit,
            ignore_eos=bool(body.get("ignore_eos", False)),
            eos_at=eos_at,
            stream=bool(body.get("stream", False)),
        )

    def _submit(self, req: SimRequest) -> RequestHandle:
        try:
            handle = self.driver.submit(req)
        except ContextTooLong as exc:
            raise llama_error(
                400,
                str(exc),
                "exceed_context_size_error",
                n_prompt_tokens=exc.prompt_tokens,
                n_ctx=exc.n_ctx,
            ) from None
        except ValueError as exc:
            raise llama_error(400, str(exc), "invalid_request_error") from None
        self._slot_ids[req.rid] = -1  # filled by _observe at the first token
        return handle

    def _timings(self, handle: RequestHandle) -> dict[str, Any]:
        """llama.cpp's ``timings``, in modelled milliseconds."""
        first = handle.first_token_time
        end = handle.finish_time if handle.finish_time is not None else first
        prompt_n = handle.prompt_tokens - handle.cached_tokens
        prompt_ms = (first - handle.arrival) * 1000 if first is not None else 0.0
        predicted_ms = (end - first) * 1000 if end is not None and first is not None else 0.0
        predicted_n = handle.completion_tokens
        return {
            "cache_n": handle.cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_ms * 1000 if prompt_ms else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": predicted_n / predicted_ms * 1000 if predicted_ms else 0.0,
        }

    @staticmethod
    def _usage(handle: RequestHandle) -> dict[str, Any]:
        return {
            "completion_tokens": handle.completion_tokens,
            "prompt_tokens": handle.prompt_tokens,
            "total_tokens": handle.prompt_tokens + handle.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": handle.cached_tokens},
        }

    @staticmethod
    def _finish_reason(finish: Finish | None) -> str:
        return "stop" if finish is not None and finish.kind == "stop" else "length"

    # ------------------------------------------------------------------ running a request
    async def _run_plain(self, req: SimRequest) -> tuple[RequestHandle, int]:
        """Submit and wait for the end; the handle and the slot it ran in. A plain request
        is not aborted when its client leaves (llama.cpp runs it to the end)."""
        handle = self._submit(req)
        try:
            await self._wait_done(handle)
            return handle, self._slot_ids.get(req.rid, -1)
        finally:
            self._slot_ids.pop(req.rid, None)

    async def _stream(
        self,
        request: web.BaseRequest,
        req: SimRequest,
        first_events: Events,
        text_event: TextEvent,
        last_events: Events,
    ) -> web.StreamResponse:
        """Stream one request: the response starts once the first token is sampled."""
        handle = self._submit(req)
        try:
            with self._aborting_on_exit(handle):
                while handle.completion_tokens == 0 and not handle.done:
                    await handle.wait()
                resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
                resp.force_close()
                await resp.prepare(request)
                events: list[dict[str, Any]] = list(first_events(handle))
                sent = chunks = 0
                while True:
                    n = handle.completion_tokens
                    text = self._text(handle, sent, n) if n > sent else ""
                    sent = n
                    if text:
                        events.append(text_event(handle, text))
                    if handle.done:
                        events.extend(last_events(handle))
                    for event in events:
                        await resp.write(api.sse(event))
                        chunks += 1
                        if self._maybe_drop(request, chunks):
                            return resp
                    events = []
                    if handle.done:
                        break
                    await handle.wait()
                await resp.write(api.DONE)
                return resp
        finally:
            self._slot_ids.pop(req.rid, None)
