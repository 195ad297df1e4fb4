"""llama.cpp's generation routes: ``/v1/chat/completions`` and ``/v1/completions`` (OpenAI
shapes, also without ``/v1``) and the native ``/completion``.

The answer names the alias whatever ``model`` the request gave; ``usage`` (with
``prompt_tokens_details.cached_tokens``) and ``timings`` come with the plain answer, on the
stream's finish chunk and on its ``include_usage`` chunk. A chat stream opens with
``delta: {"role": "assistant", "content": null}``. ``prompt`` is a string or a list of
token ids.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from aiohttp import web

from simulator.http.base import json_response
from simulator.http.llamacpp.core import BUILD_INFO, LlamaCppCore, llama_error
from simulator.model.driver import RequestHandle


class LlamaCompletionRoutes(LlamaCppCore):
    """The generation handlers (see module docstring)."""

    async def _chat(self, request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise llama_error(400, "'messages' is required", "invalid_request_error")
        tools = body.get("tools")
        prompt = self.tokenizer.encode_chat(messages, tools if isinstance(tools, list) else None)
        req = self._sim_request(body, prompt, "max_completion_tokens", "max_tokens", "n_predict")
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        cmpl_id = "chatcmpl-" + secrets.token_hex(16)
        created = int(time.time())
        head = {
            "created": created,
            "id": cmpl_id,
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
        }

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice = {"finish_reason": finish, "index": 0, "delta": delta}
            return {"choices": [choice], **head, "object": "chat.completion.chunk"}

        def first_events(handle: RequestHandle) -> list[dict[str, Any]]:
            return [chunk({"role": "assistant", "content": None})]

        def text_event(handle: RequestHandle, text: str) -> dict[str, Any]:
            return chunk({"content": text})

        def last_events(handle: RequestHandle) -> list[dict[str, Any]]:
            timings = self._timings(handle)
            events = [{**chunk({}, self._finish_reason(handle.finish)), "timings": timings}]
            if include_usage:
                usage = {"usage": self._usage(handle), "timings": timings}
                events.append({"choices": [], **head, "object": "chat.completion.chunk", **usage})
            return events

        if req.stream:
            return await self._stream(request, req, first_events, text_event, last_events)
        handle, _ = await self._run_plain(req)
        text = self._text(handle, 0, handle.completion_tokens)
        choice = {
            "finish_reason": self._finish_reason(handle.finish),
            "index": 0,
            "message": {"role": "assistant", "content": text},
        }
        answer = {
            "choices": [choice],
            **head,
            "object": "chat.completion",
            "usage": self._usage(handle),
            "timings": self._timings(handle),
        }
        return json_response(answer)

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        """``prompt`` as a string or a list of token ids."""
        prompt_value = body.get("prompt")
        if isinstance(prompt_value, str):
            return self.tokenizer.encode(prompt_value)
        if isinstance(prompt_value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt_value
        ):
            return list(prompt_value)
        raise llama_error(
            400, "'prompt' must be a string or a list of tokens", "invalid_request_error"
        )

    async def _text_completion(
        self, request: web.BaseRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        """OpenAI's ``/v1/completions`` (llama.cpp's oaicompat form of ``/completion``)."""
        req = self._sim_request(body, self._prompt(body), "max_tokens", "n_predict")
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        head = {
            "created": int(time.time()),
            "id": "cmpl-" + secrets.token_hex(16),
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
            "object": "text_completion",
        }

        def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
            return {"choices": [choice], **head}

        def last_events(handle: RequestHandle) -> list[dict[str, Any]]:
            timings = self._timings(handle)
            events = [{**chunk("", self._finish_reason(handle.finish)), "timings": timings}]
            if include_usage:
                usage = {"usage": self._usage(handle), "timings": timings}
                events.append({"choices": [], **head, **usage})
            return events

        if req.stream:
            return await self._stream(
                request, req, lambda h: [], lambda h, text: chunk(text), last_events
            )
        handle, _ = await self._run_plain(req)
        text = self._text(handle, 0, handle.completion_tokens)
        answer = {
            **chunk(text, self._finish_reason(handle.finish)),
            "usage": self._usage(handle),
            "timings": self._timings(handle),
        }
        return json_response(answer)

    async def _completion(
        self, request: web.BaseRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        req = self._sim_request(body, self._prompt(body), "n_predict", "max_tokens")

        def event(
            handle: RequestHandle, text: str, stop: bool, slot: int | None = None
        ) -> dict[str, Any]:
            out: dict[str, Any] = {
                "index": 0,
                "content": text,
                "tokens": [],
                "stop": stop,
                "id_slot": self._slot_ids.get(handle.rid, -1) if slot is None else slot,
                "tokens_predicted": handle.completion_tokens,
                "tokens_evaluated": handle.prompt_tokens,
            }
            if stop:
                out.update(
                    {
                        "model": self.model,
                        "stop_type": "eos"
                        if handle.finish and handle.finish.kind == "stop"
                        else "limit",
                        "tokens_cached": handle.prompt_tokens + handle.completion_tokens,
                        "truncated": False,
                        "timings": self._timings(handle),
                    }
                )
            return out

        if req.stream:
            return await self._stream(
                request,
                req,
                lambda h: [],
                lambda h, text: event(h, text, False),
                lambda h: [event(h, "", True)],
            )
        handle, slot = await self._run_plain(req)
        text = self._text(handle, 0, handle.completion_tokens)
        return json_response(event(handle, text, True, slot))
