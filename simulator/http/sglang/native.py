"""SGLang's native routes: ``/generate`` (POST or PUT), ``/tokenize`` and ``/detokenize``
(also under ``/v1/``).

``/generate`` takes ``text`` or ``input_ids``, one prompt or a list of them (a batch: answered
as a list, never streamed; rids from a ``rid`` list, else ``rid_0``, ``rid_1``…), and
``routed_dp_rank`` (or ``data_parallel_rank``) for every prompt (:mod:`.dp`); with DP ranks
``meta_info.dp_rank`` is the rank that served it. Without
``sampling_params.max_new_tokens`` a request runs to its natural stop or the context's end.
A streamed answer repeats the cumulative ``text`` and ``output_ids`` with ``meta_info`` in
every chunk. Errors have SGLang's native shape, ``{"error": ...}``, not OpenAI's.
``/tokenize`` takes a ``prompt`` (a string or a list of them) or chat ``messages``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from aiohttp import web

from simulator.http import api
from simulator.http.api import ApiError
from simulator.http.base import json_response
from simulator.http.sglang.core import SSE_HEADERS, GenRequest, SGLangCore
from simulator.http.sglang.dp import routed_rank
from simulator.model.driver import RequestHandle


class NativeRoutes(SGLangCore):
    """The native generation and token handlers (see module docstring)."""

    # ------------------------------------------------------------------ /generate
    async def _generate(self, request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        dp_rank = routed_rank(body, native=True)
        text, input_ids = body.get("text"), body.get("input_ids")
        if text is None and input_ids is None:
            message = "Either text, input_ids or input_embeds should be provided."
            raise ApiError(400, {"error": message})
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise api.wrong_type("sampling_params", "dictionary", params)
        stream = bool(body.get("stream", False))
        if input_ids is not None:
            batched = isinstance(input_ids, list) and bool(input_ids)
            batched = batched and isinstance(input_ids[0], list)
            if batched:
                prompts = [self._token_ids("input_ids", p) for p in input_ids]
            else:
                prompts = [self._token_ids("input_ids", input_ids)]
        elif isinstance(text, str):
            prompts, batched = [self.tokenizer.encode(text)], False
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            prompts, batched = [self.tokenizer.encode(t) for t in text], True
        else:
            raise api.wrong_type("text", "string", text)
        max_new = self._int(params, "max_new_tokens", 128)
        assert max_new is not None
        rid_value = body.get("rid")
        if batched:
            if stream:
                message = "The simulated worker does not stream batches."
                raise ApiError(400, {"error": {"message": message}})
            if isinstance(rid_value, list):
                rids = rid_value
            else:
                rids = [
                    f"{rid_value}_{i}" if rid_value else uuid.uuid4().hex
                    for i in range(len(prompts))
                ]
        else:
            rids = [self._rid(body)]
        gens = [
            GenRequest(
                rid=str(rid),
                prompt_ids=prompt,
                max_new_tokens=max_new,
                explicit_max="max_new_tokens" in params,
                ignore_eos=bool(params.get("ignore_eos", False)),
                namespace=self._namespace(body),
                adapter=self._adapter(body),
                stream=stream,
                dp_rank=dp_rank,
            )
            for rid, prompt in zip(rids, prompts, strict=False)
        ]
        if stream:
            return await self._generate_stream(request, gens[0])
        handles: list[RequestHandle] = []
        try:
            for gen in gens:
                handles.append(self._submit(gen, stream_outputs=False))
        except ValueError as exc:
            for handle in handles:
                self._abort(handle.rid)
            return json_response({"error": {"message": str(exc)}}, 400)
        with contextlib.ExitStack() as stack:
            for handle in handles:
                stack.enter_context(self._aborting_on_exit(handle))
            for handle in handles:
                await self._wait_done(handle)
        outputs = []
        for handle in handles:
            finish = handle.finish
            if finish is not None and finish.status_code == 400:  # raised as a ValueError
                return json_response({"error": {"message": finish.message or "aborted"}}, 400)
            if finish is not None and finish.status_code is not None:
                raise api.openai_error(finish.status_code, finish.message or "aborted")
            outputs.append(self._generate_body(handle, handle.completion_tokens))
        return json_response(outputs if batched else outputs[0])

    def _generate_body(self, handle: RequestHandle, n: int, text: str | None = None) -> Any:
        ids = list(handle.output_ids[:n])
        done = handle.done
        e2e = None
        if done and handle.finish_time is not None:
            e2e = round(handle.finish_time - handle.arrival, 6)
        return api.generate_output(
            rid=handle.rid,
            text=self.tokenizer.decode(ids) if text is None else text,
            output_ids=ids,
            finish=handle.finish if done else None,
            prompt_tokens=handle.prompt_tokens,
            completion_tokens=n,
            cached_tokens=handle.cached_tokens,
            e2e_latency=e2e,
            sent_ts=time.time(),
            timing=self._timing(handle) if self.config.enable_metrics else None,
            dp_rank=handle.dp_rank,
            cached_details=(
                api.cached_details(handle.cached_tokens, handle.cached_host)
                if self.config.enable_hierarchical_cache
                else None
            ),
        )

    @staticmethod
    def _timing(handle: RequestHandle) -> api.GenerateTiming:
        first = handle.first_token_time
        ttft = round(first - handle.arrival, 6) if first is not None else 0.0
        return api.GenerateTiming(received_ts=handle.received_ts, ttft_s=ttft)

    async def _generate_stream(
        self, request: web.BaseRequest, gen: GenRequest
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            handle = self._submit(gen, stream_outputs=True)
        except ValueError as exc:
            await resp.write(api.generate_stream_error(str(exc)))
            await resp.write(api.DONE)
            return resp
        with self._aborting_on_exit(handle):
            sent = 0
            text = ""
            chunks = 0
            while True:
                await handle.wait()
                n = handle.completion_tokens
                if n > sent or handle.done:
                    text += self._text(handle, sent, n)
                    sent = n
                    await resp.write(api.sse(self._generate_body(handle, n, text)))
                    chunks += 1
                    if self._maybe_drop(request, chunks):
                        return resp
                if handle.done:
                    break
            await resp.write(api.DONE)
        return resp

    # ------------------------------------------------------------------ tokens
    async def _tokenize(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        messages = body.get("messages")
        if messages is not None:
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise api.wrong_type("messages", "list", messages)
            tools = body.get("tools")
            tokens: Any = self.tokenizer.encode_chat(
                messages,
                tools if isinstance(tools, list) else None,
                bool(body.get("add_generation_prompt", True)),
            )
            count: Any = len(tokens)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                tokens = self.tokenizer.encode(prompt)
                count = len(tokens)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [self.tokenizer.encode(p) for p in prompt]
                count = [len(t) for t in tokens]
            else:
                raise api.missing_field("prompt", body)
        return json_response(
            {"tokens": tokens, "count": count, "max_model_len": self.context_length}
        )

    async def _detokenize(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        tokens = self._token_ids("tokens", body.get("tokens"))
        return json_response({"text": self.tokenizer.decode(tokens)})
