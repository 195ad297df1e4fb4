"""llama.cpp's other routes: ``/health``, ``/props``, ``/slots``, ``/v1/models``, ``/metrics``,
``/tokenize``, ``/apply-template``, and this personality's ``/_sim/stats`` figures.

``/health`` is ``{"status":"ok"}`` even while every slot is busy (503 with the
``fail_health`` fault or while stopping); ``/slots?fail_on_no_slot=1`` is a 503 when no slot
is idle; ``/metrics`` (with ``enable_metrics``) serves the ``llamacpp:*`` counters, live.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from simulator.http.base import json_response
from simulator.http.llamacpp.core import BUILD_INFO, LlamaCppCore, llama_error

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


class LlamaInfoRoutes(LlamaCppCore):
    """The health, information, metrics and token handlers (see module docstring)."""

    # ------------------------------------------------------------------ health, slots, props
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

    # ------------------------------------------------------------------ metrics and tokens
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
