"""The HTTP API of one simulated llama.cpp server (``SimConfig.engine = "llamacpp"``).

The shapes are those docs/REAL_ENGINE.md records of llama.cpp's server (xllamacpp
2026.10.11549), over a :class:`simulator.model.slots.SlotWorkerModel`:

* every response carries ``Server: llama.cpp``; unknown paths (``/server_info``,
  ``/v1/loads``, ``/abort_request``…) answer 404 ``File Not Found``;
* ``GET /health`` → ``{"status":"ok"}`` (also while every slot is busy; 503 with the
  ``fail_health`` fault); ``GET /props`` (``total_slots``,
  ``default_generation_settings.n_ctx`` per slot, ``model_alias``, ``model_path``…);
  ``GET /slots`` (``?fail_on_no_slot=1``: 503 when no slot is idle); ``GET /metrics``
  (``llamacpp:*``, with ``enable_metrics``); ``GET /v1/models`` (``owned_by: llamacpp``);
  ``POST /tokenize`` and ``/apply-template``;
* ``POST /v1/chat/completions`` and ``/v1/completions`` streamed or not, and the native
  ``POST /completion``: a prompt longer than a slot is a 400
  ``exceed_context_size_error``; the answer names the alias whatever ``model`` the
  request gave; ``usage.prompt_tokens_details.cached_tokens`` and ``timings``
  (``cache_n``, ``prompt_n``, ``prompt_ms``…, in modelled time; ``prompt_ms`` counts from
  arrival, so it includes a wait for a slot) on the plain answer, on the stream's finish
  chunk and on its ``include_usage`` chunk. A chat stream starts after prefill: the first
  event is ``delta: {"role": "assistant", "content": null}``, then the content deltas.
* No ``rid`` and no abort endpoint: closing the connection of a *streamed* request frees
  its slot; a plain request runs to its end even if its client left. After a streamed
  response the connection is closed (the real server does it without saying so; here it
  says ``Connection: close``).

Always reported, unlike SGLang's: cached tokens (no ``enable_cache_report`` needed). Not
modelled: sampling parameters, ``id_slot`` pinning, ``/slots`` save/restore, embeddings.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from simulator.config import SimConfig
from simulator.http import api
from simulator.http.api import ApiError
from simulator.http.sglang import Handler, HttpWorker, json_response, route_table
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
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_METRICS: tuple[tuple[str, str, str], ...] = (
    ("prompt_tokens_total", "counter", "Number of prompt tokens processed."),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache."),
    ("prompt_seconds_total", "counter", "Prompt process time"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed."),
    ("tokens_predicted_seconds_total", "counter", "Predict process time"),
    ("n_decode_total", "counter", "Total number of llama_decode() calls"),
    ("n_tokens_max", "counter", "Largest observed n_tokens."),
    ("n_busy_slots_per_decode", "counter", "Average number of busy slots per llama_decode() call"),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s."),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s."),
    ("requests_processing", "gauge", "Number of requests processing."),
    ("requests_deferred", "gauge", "Number of requests deferred."),
)


Events = Callable[[RequestHandle], list[dict[str, Any]]]
TextEvent = Callable[[RequestHandle, str], dict[str, Any]]


def llama_error(status: int, message: str, err_type: str, **extra: Any) -> ApiError:
    """llama.cpp's error body: ``{"error": {"code", "message", "type", ...}}``."""
    return ApiError(
        status, {"error": {"code": status, "message": message, "type": err_type, **extra}}
    )


class LlamaCppWorker(HttpWorker):
    """One simulated llama.cpp server: ``engine`` is the :class:`SlotWorkerModel`."""

    def __init__(
        self, config: SimConfig, host: str = "127.0.0.1", port: int = 0, index: int = 0
    ) -> None:
        super().__init__(config, host, port, index)
        self.engine = SlotWorkerModel.from_config(config)
        self.n_ctx: int = self.engine.n_ctx or 0
        self._slot_ids: dict[str, int] = {}  # rid → slot, for handlers that asked

    def _driven_model(self) -> DrivenModel:
        return self.engine

    # ------------------------------------------------------------------ routing
    def _build_routes(self) -> dict[str, dict[str, Handler]]:
        get, post = ("GET",), ("POST",)
        table: list[tuple[str, tuple[str, ...], Handler]] = [
            ("/health", get, self._health),
            ("/v1/health", get, self._health),
            ("/props", get, self._props),
            ("/slots", get, self._slots),
            ("/v1/models", get, self._models),
            ("/models", get, self._models),
            ("/v1/chat/completions", post, self._inference(self._chat, openai=False)),
            ("/chat/completions", post, self._inference(self._chat, openai=False)),
            ("/completion", post, self._inference(self._completion, openai=False)),
            ("/v1/completions", post, self._inference(self._text_completion, openai=False)),
            ("/completions", post, self._inference(self._text_completion, openai=False)),
            ("/tokenize", post, self._tokenize),
            ("/apply-template", post, self._apply_template),
            ("/_sim/faults", ("GET", "POST"), self._sim_faults),
            ("/_sim/stats", get, self._sim_stats),
        ]
        if self.config.enable_metrics:
            table.append(("/metrics", get, self._metrics))
        return route_table(table)

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

    # ------------------------------------------------------------------ inference
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

    # ------------------------------------------------------------------ info and load
    async def _health(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.faults.fail_health or self._stopping:
            error = {"code": 503, "message": "Loading model", "type": "unavailable_error"}
            return json_response({"error": error}, 503)
        return json_response({"status": "ok"})

    def _slot_json(self, i: int) -> dict[str, Any]:
        slot = self.engine.slot_list[i]
        out: dict[str, Any] = {
            "id": slot.id,
            "n_ctx": slot.n_ctx,
            "speculative": False,
            "is_processing": slot.is_processing,
        }
        if slot.used:
            out.update(
                {
                    "id_task": slot.task_id,
                    "n_prompt_tokens": slot.n_prompt_tokens + slot.n_decoded,
                    "n_prompt_tokens_processed": slot.n_prompt_tokens_processed,
                    "n_prompt_tokens_cache": 0,
                    "params": {"n_predict": slot.n_decoded + slot.n_remain, "stream": True},
                    "next_token": [
                        {
                            "has_next_token": slot.is_processing,
                            "has_new_line": False,
                            "n_remain": slot.n_remain,
                            "n_decoded": slot.n_decoded,
                        }
                    ],
                }
            )
        return out

    async def _slots(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.query.get("fail_on_no_slot") and self.engine.requests_processing >= len(
            self.engine.slot_list
        ):
            raise llama_error(503, "no slot available", "unavailable_error")
        return json_response([self._slot_json(i) for i in range(len(self.engine.slot_list))])

    async def _props(self, request: web.BaseRequest) -> web.StreamResponse:
        settings = {
            "id": 0,
            "id_task": -1,
            "n_ctx": self.n_ctx,
            "speculative": False,
            "is_processing": False,
            "params": {"n_predict": -1, "temperature": 0.8, "stream": True},
        }
        return json_response(
            {
                "default_generation_settings": settings,
                "total_slots": len(self.engine.slot_list),
                "model_alias": self.model,
                "model_path": self.config.model_path,
                "modalities": {"vision": False, "audio": False},
                "endpoint_slots": True,
                "endpoint_props": False,
                "endpoint_metrics": self.config.enable_metrics,
                "chat_template": CHATML_TEMPLATE,
                "bos_token": "<s>",
                "eos_token": "<|im_end|>",
                "build_info": BUILD_INFO,
                "is_sleeping": False,
            }
        )

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse:
        meta = {
            "vocab_type": 1,
            "n_vocab": self.tokenizer.vocab_size,
            "n_ctx": self.n_ctx,
            "n_ctx_train": self.config.context_length or self.profile.context_length,
            "n_embd": 512,
            "n_params": 0,
            "size": int(self.profile.weight_gb * 2**30),
        }
        card = {
            "name": self.model,
            "model": self.model,
            "type": "model",
            "capabilities": ["completion"],
        }
        entry = {
            "id": self.model,
            "object": "model",
            "created": int(self._started),
            "owned_by": "llamacpp",
            "meta": meta,
        }
        return json_response({"models": [card], "object": "list", "data": [entry]})

    async def _metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        engine = self.engine
        c = engine.counters
        values = {
            "prompt_tokens_total": c.prompt_tokens,
            "prompt_tokens_cached_total": c.prompt_tokens_cached,
            "prompt_seconds_total": c.prompt_seconds,
            "tokens_predicted_total": c.tokens_predicted,
            "tokens_predicted_seconds_total": c.tokens_predicted_seconds,
            "n_decode_total": c.n_decode,
            "n_tokens_max": c.n_tokens_max,
            "n_busy_slots_per_decode": c.n_busy_slots / c.n_decode if c.n_decode else 0.0,
            "prompt_tokens_seconds": (
                c.prompt_tokens / c.prompt_seconds if c.prompt_seconds else 0.0
            ),
            "predicted_tokens_seconds": (
                c.tokens_predicted / c.tokens_predicted_seconds
                if c.tokens_predicted_seconds
                else 0.0
            ),
            "requests_processing": engine.requests_processing,
            "requests_deferred": engine.requests_deferred,
        }
        lines: list[str] = []
        for name, kind, help_text in _METRICS:
            lines.append(f"# HELP llamacpp:{name} {help_text}")
            lines.append(f"# TYPE llamacpp:{name} {kind}")
            lines.append(f"llamacpp:{name} {values[name]}")
        body = ("\n".join(lines) + "\n").encode()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _tokenize(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise llama_error(400, "'content' must be a string", "invalid_request_error")
        return json_response({"tokens": self.tokenizer.encode(content)})

    async def _apply_template(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise llama_error(400, "'messages' is required", "invalid_request_error")
        return json_response({"prompt": self.tokenizer.apply_chat_template(messages)})

    # ------------------------------------------------------------------ simulator control
    async def _sim_stats(self, request: web.BaseRequest) -> web.StreamResponse:
        return json_response(self.sim_stats())

    def sim_stats(self) -> dict[str, Any]:
        engine = self.engine
        c = engine.counters
        return {
            "requests": self.stats.requests,
            "aborts": self.stats.aborts,
            "faults_injected": self.stats.faults_injected,
            "in_flight": self.stats.in_flight,
            "last_request_body": self.stats.last_request_body,
            "last_request_path": self.stats.last_request_path,
            "engine": "llamacpp",
            "running": engine.requests_processing,
            "waiting": engine.requests_deferred,
            "model_time": self.driver.now() if self._driver is not None else 0.0,
            "slot_tokens": [s.tokens for s in engine.slot_list],
            "prompt_tokens_total": c.prompt_tokens + c.prompt_tokens_cached,
            "cached_tokens_total": c.prompt_tokens_cached,
            "generation_tokens_total": c.tokens_predicted,
            "finished_total": c.finished,
            "faults": self.faults.as_dict(),
        }
