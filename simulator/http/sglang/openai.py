"""SGLang's OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/embeddings`` (SGLANG_API.md §1, §2).

As SGLang's serving layer: ``n`` must be 1; the limit is ``max_completion_tokens`` or
``max_tokens`` (completions: 16 by default; chat: none, so the request runs to its natural
stop or the context's end); the OpenAI ``id`` is the rid; ``model`` echoes the request's.
Without streaming, a scheduler abort with a status code is that HTTP error. A chat stream
starts after the first output (so an early failure is still an HTTP status), a completions
stream at once (a refused request is an ``error`` event); an abort mid-stream is an
``error`` event. ``stream_options``: ``include_usage`` adds a usage chunk,
``continuous_usage_stats`` puts usage on every chunk; ``usage.prompt_tokens_details`` only
with ``enable_cache_report``; with HiCache, ``return_cached_tokens_details`` adds
``sglext.cached_tokens_details`` (non-streamed: after ``metadata``; streamed: a chunk of
its own before the usage chunk). A list of completion prompts runs as parallel requests (rids
``rid``, ``rid_1``…), not streamed. An embedding is a deterministic unit vector per input
(there is no model to embed with). The DP rank: ``X-Data-Parallel-Rank``, else
``routed_dp_rank``, else ``data_parallel_rank`` (:mod:`.dp`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from typing import Any

import orjson
import xxhash
from aiohttp import web

from simulator.http import api
from simulator.http.api import ApiError
from simulator.http.base import json_response
from simulator.http.sglang.core import SSE_HEADERS, GenRequest, SGLangCore
from simulator.http.sglang.dp import routed_rank
from simulator.model.driver import RequestHandle
from simulator.model.requests import Finish


class OpenAIRoutes(SGLangCore):
    """The OpenAI-compatible handlers (see module docstring)."""

    # ------------------------------------------------------------------ chat
    async def _chat(self, request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        messages = body.get("messages")
        if messages is None:
            raise api.missing_field("messages", body)
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise api.wrong_type("messages", "list", messages)
        input_ids = body.get("input_ids")
        if input_ids is not None:
            prompt = self._token_ids("input_ids", input_ids)
        else:
            try:
                prompt = self.tokenizer.encode_chat_request(body)
            except Exception as exc:  # a template that refuses the conversation (SGLang: 400)
                raise api.bad_request(f"Error in applying chat template: {exc}") from None
        gen, model, include_usage, continuous = self._openai_common(request, body, prompt, None)
        details = self._wants_details(body)
        if not gen.stream:
            handle = self._submit_openai(gen)
            with self._aborting_on_exit(handle):
                await self._wait_done(handle)
            finish = self._raise_for_status(handle.finish)
            u = self._usage(handle)
            text = self._text(handle, 0, handle.completion_tokens)
            created = int(time.time())
            ext = self._sglext(handle) if details else None
            return json_response(api.chat_response(gen.rid, created, model, text, finish, u, ext))
        return await self._chat_stream(request, gen, model, include_usage, continuous, details)

    async def _chat_stream(
        self,
        request: web.BaseRequest,
        gen: GenRequest,
        model: str,
        include_usage: bool,
        continuous: bool,
        details: bool = False,
    ) -> web.StreamResponse:
        handle = self._submit_openai(gen)
        created = int(time.time())
        rid = gen.rid
        with self._aborting_on_exit(handle):
            await handle.wait()  # SGLang pre-fetches the first output before answering
            resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await resp.prepare(request)
            first = handle.finish if handle.completion_tokens == 0 else None
            if first is not None and first.status_code is not None:
                # a scheduler abort with a status as the first output: an error event only
                await resp.write(api.stream_error(first.message or "aborted", first.status_code))
                await resp.write(api.DONE)
                return resp
            role = {"reasoning_content": None, "role": "assistant", "content": ""}
            await resp.write(api.chat_chunk(rid, created, model, role))
            chunks = 1
            if self._maybe_drop(request, chunks):
                return resp
            sent = 0
            while True:
                n = handle.completion_tokens
                delta = self._text(handle, sent, n) if n > sent else ""
                if delta:
                    u = self._usage(handle, n) if continuous else None
                    content = {"reasoning_content": None, "content": delta}
                    await resp.write(api.chat_chunk(rid, created, model, content, None, u))
                    chunks += 1
                    if self._maybe_drop(request, chunks):
                        return resp
                sent = n
                if handle.done:
                    break
                await handle.wait()
            finish = handle.finish
            if finish is not None and finish.status_code is not None:
                await resp.write(api.stream_error(finish.message or "aborted", finish.status_code))
            else:
                await resp.write(
                    api.chat_chunk(rid, created, model, {"reasoning_content": None}, finish)
                )
                ext = self._sglext(handle) if details else None
                if ext is not None:
                    kind = "chat.completion.chunk"
                    await resp.write(api.sglext_chunk(rid, created, model, kind, ext))
                if include_usage:
                    await resp.write(api.chat_usage_chunk(rid, created, model, self._usage(handle)))
            await resp.write(api.DONE)
        return resp

    def _openai_common(
        self,
        request: web.BaseRequest,
        body: dict[str, Any],
        prompt: list[int],
        default_max: int | None,
    ) -> tuple[GenRequest, str, bool, bool]:
        n = self._int(body, "n", 1)
        if n != 1:
            message = "The simulated worker supports n=1 only."
            raise ApiError(400, api.error_object(message, "BadRequest", 400))
        max_tokens = self._int(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = self._int(body, "max_tokens", default_max)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise api.wrong_type("stream_options", "dictionary", options)
        model = body.get("model")
        gen = GenRequest(
            rid=self._rid(body),
            prompt_ids=prompt,
            max_new_tokens=max_tokens if max_tokens is not None else 0,
            explicit_max=max_tokens is not None,
            ignore_eos=bool(body.get("ignore_eos", False)),
            namespace=self._namespace(body),
            adapter=self._adapter(body),
            stream=bool(body.get("stream", False)),
            dp_rank=routed_rank(body, native=False, headers=request.headers),
        )
        return (
            gen,
            model if isinstance(model, str) else self.model,
            bool(options.get("include_usage")),
            bool(options.get("continuous_usage_stats")),
        )

    def _submit_openai(self, gen: GenRequest) -> RequestHandle:
        try:
            return self._submit(gen, stream_outputs=gen.stream)
        except ValueError as exc:
            raise api.bad_request(str(exc)) from None

    @staticmethod
    def _raise_for_status(finish: Finish | None) -> Finish | None:
        """A scheduler abort with a status code is an HTTP error (non-streaming)."""
        if finish is not None and finish.kind == "abort" and finish.status_code is not None:
            raise api.scheduler_abort_error(finish.status_code, finish.message or "aborted")
        return finish

    def _wants_details(self, body: dict[str, Any]) -> bool:
        """``return_cached_tokens_details``, answered when HiCache is on (the tier split is
        what it is for; without HiCache the simulator keeps its former bodies)."""
        return (
            self.config.enable_hierarchical_cache
            and body.get("return_cached_tokens_details") is True
        )

    @staticmethod
    def _sglext(handle: RequestHandle) -> dict[str, Any] | None:
        return api.sglext(api.cached_details(handle.cached_tokens, handle.cached_host))

    def _usage(self, handle: RequestHandle, completion: int | None = None) -> dict[str, Any]:
        return api.usage(
            handle.prompt_tokens,
            handle.completion_tokens if completion is None else completion,
            handle.cached_tokens,
            self.config.enable_cache_report,
        )

    # ------------------------------------------------------------------ completions
    async def _completions(
        self, request: web.BaseRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        if "prompt" not in body:
            raise api.missing_field("prompt", body)
        prompts, texts = self._completion_prompts(body.get("prompt"))
        echo = bool(body.get("echo", False))
        first, model, include_usage, continuous = self._openai_common(request, body, prompts[0], 16)
        details = self._wants_details(body)
        if len(prompts) > 1 and first.stream:
            raise api.bad_request("The simulated worker does not stream batches.")
        if first.stream:
            echo_text = texts[0] if echo else ""
            return await self._completions_stream(
                request, first, model, include_usage, continuous, echo_text, details
            )
        gens = [first] + [
            dataclasses.replace(first, rid=f"{first.rid}_{i}", prompt_ids=p)
            for i, p in enumerate(prompts[1:], start=1)
        ]
        handles: list[RequestHandle] = []
        try:
            for gen in gens:
                handles.append(self._submit_openai(gen))
        except ApiError:
            for handle in handles:
                self._abort(handle.rid)
            raise
        with contextlib.ExitStack() as stack:
            for handle in handles:
                stack.enter_context(self._aborting_on_exit(handle))
            for handle in handles:
                await self._wait_done(handle)
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for i, handle in enumerate(handles):
            finish = self._raise_for_status(handle.finish)
            text = (texts[i] if echo else "") + self._text(handle, 0, handle.completion_tokens)
            choices.append(api.completion_choice(i, text, finish))
            prompt_tokens += handle.prompt_tokens
            completion_tokens += handle.completion_tokens
            cached += handle.cached_tokens
        u = api.usage(prompt_tokens, completion_tokens, cached, self.config.enable_cache_report)
        created = int(time.time())
        ext = self._sglext(handles[0]) if details else None  # the first prompt's, as SGLang
        return json_response(api.completion_response(first.rid, created, model, choices, u, ext))

    def _completion_prompts(self, prompt: Any) -> tuple[list[list[int]], list[str]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)], [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.tokenizer.encode(p) for p in prompt], list(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            ids = [self._token_ids("prompt", p) for p in prompt]
            return ids, [self.tokenizer.decode(p) for p in ids]
        if isinstance(prompt, list) and prompt:
            ids0 = self._token_ids("prompt", prompt)
            return [ids0], [self.tokenizer.decode(ids0)]
        raise api.wrong_type("prompt", "string", prompt)

    async def _completions_stream(
        self,
        request: web.BaseRequest,
        gen: GenRequest,
        model: str,
        include_usage: bool,
        continuous: bool,
        echo_text: str,
        details: bool = False,
    ) -> web.StreamResponse:
        created = int(time.time())
        rid = gen.rid
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            handle = self._submit(gen, stream_outputs=True)
        except ValueError as exc:
            error = api.error_object(str(exc), "BadRequestError", 400)
            await resp.write(api.sse({"error": error}))
            await resp.write(api.DONE)
            return resp
        with self._aborting_on_exit(handle):
            sent = 0
            chunks = 0
            pending_echo = echo_text
            while True:
                await handle.wait()
                n = handle.completion_tokens
                if n > sent or handle.done:
                    text = pending_echo + self._text(handle, sent, n)
                    pending_echo = ""
                    sent = n
                    finish = handle.finish if handle.done else None
                    if finish is not None and finish.status_code is not None:
                        message = finish.message or "aborted"
                        await resp.write(api.stream_error(message, finish.status_code))
                        break
                    u = self._usage(handle, n) if continuous else None
                    choice = api.completion_choice(0, text, finish)
                    await resp.write(api.completion_chunk(rid, created, model, choice, u))
                    chunks += 1
                    if self._maybe_drop(request, chunks):
                        return resp
                if handle.done:
                    ext = self._sglext(handle) if details else None
                    if ext is not None:
                        kind = "text_completion"
                        await resp.write(api.sglext_chunk(rid, created, model, kind, ext))
                    if include_usage:
                        u = self._usage(handle)
                        await resp.write(api.completion_usage_chunk(rid, created, model, u))
                    break
            await resp.write(api.DONE)
        return resp

    # ------------------------------------------------------------------ embeddings
    async def _embeddings(
        self, request: web.BaseRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        if "input" not in body:
            raise api.missing_field("input", body)
        value = body["input"]
        if isinstance(value, str):
            inputs = [self.tokenizer.encode(value)]
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            inputs = [self.tokenizer.encode(v) for v in value]
        elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            inputs = [self._token_ids("input", v) for v in value]
        elif isinstance(value, list) and value:
            inputs = [self._token_ids("input", value)]
        else:
            raise api.wrong_type("input", "string", value)
        data = [
            {"embedding": _embedding(ids), "index": i, "object": "embedding"}
            for i, ids in enumerate(inputs)
        ]
        total = sum(len(ids) for ids in inputs)
        u = {
            "prompt_tokens": total,
            "total_tokens": total,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        }
        return json_response(
            {"data": data, "model": self.config.model_path, "object": "list", "usage": u}
        )


def _embedding(ids: list[int], dim: int = 16) -> list[float]:
    """A deterministic unit vector per token sequence (the simulator has no real model)."""
    h = xxhash.xxh64_intdigest(orjson.dumps(ids))
    rng = random.Random(h)
    vec = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
    norm = sum(v * v for v in vec) ** 0.5 or 1.0
    return [round(v / norm, 6) for v in vec]
