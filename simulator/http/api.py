"""Wire formats of SGLang 0.5.23 (SGLANG_API.md §1, §2): bodies, chunks and errors.

Pure functions from the simulator's request state to JSON-able dicts and bytes; the HTTP
handlers in :mod:`simulator.http.sglang` decide when to send what. Field order follows the
reference (SGLang serializes with orjson / pydantic in declaration order).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

from simulator.model.requests import Finish

WEIGHT_VERSION = "default"
DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """An HTTP error response with an exact body."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body


def error_object(message: str, err_type: str, code: int) -> dict[str, Any]:
    """SGLang's ``ErrorResponse``: top-level, not wrapped in ``{"error": ...}``."""
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": code}


def openai_error(status: int, message: str, err_type: str | None = None) -> ApiError:
    return ApiError(status, error_object(message, err_type or str(status), status))


def scheduler_abort_error(status: int, message: str) -> ApiError:
    """A scheduler abort with a status on a non-streamed OpenAI request: 400 is raised as
    a ``ValueError`` (``BadRequestError``), any other status as an ``HTTPException``
    (type = the status as a string), as 0.5.23's ``_handle_abort_finish_reason``."""
    return bad_request(message) if status == 400 else openai_error(status, message)


def stream_error(message: str, status: int) -> bytes:
    """The error event of a streamed chat or completions request that the scheduler aborted
    with a status: ``create_streaming_error_response``, serialized by ``json.dumps`` (spaces
    after separators, unlike the chunks), type = the status's name."""
    try:
        err_type = HTTPStatus(status).name
    except ValueError:
        err_type = str(status)
    error = error_object(message, err_type, status)
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def bad_request(message: str) -> ApiError:
    """A ``ValueError`` from generation (context too long, duplicate rid) on OpenAI routes."""
    return ApiError(400, error_object(message, "BadRequestError", 400))


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """FastAPI ``RequestValidationError`` as SGLang's global handler renders it (400)."""
    exc_str = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:\n" + "".join(
        f"  {err}\n" for err in errors
    )
    return ApiError(400, error_object(f"{exc_str} {errors}", HTTPStatus.BAD_REQUEST.phrase, 400))


def json_invalid(error: str, position: int) -> ApiError:
    return validation_error(
        [
            {
                "type": "json_invalid",
                "loc": ("body", position),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": error},
            }
        ]
    )


def missing_field(field: str, body: Any) -> ApiError:
    return validation_error(
        [{"type": "missing", "loc": ("body", field), "msg": "Field required", "input": body}]
    )


def wrong_type(field: str, expected: str, value: Any) -> ApiError:
    return validation_error(
        [
            {
                "type": f"{expected}_type",
                "loc": ("body", field),
                "msg": f"Input should be a valid {expected}",
                "input": value,
            }
        ]
    )


def unsupported_media_type() -> ApiError:
    return validation_error(
        [
            {
                "loc": ["header", "content-type"],
                "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                "type": "value_error",
            }
        ]
    )


def context_too_long(prompt_tokens: int, context_length: int) -> str:
    return (
        f"The input ({prompt_tokens} tokens) is longer than the model's context length "
        f"({context_length} tokens)."
    )


def total_too_long(prompt_tokens: int, max_new_tokens: int, context_length: int) -> str:
    return (
        f"Requested token count exceeds the model's maximum context length of "
        f"{context_length} tokens. You requested a total of {max_new_tokens + prompt_tokens} "
        f"tokens: {prompt_tokens} tokens from the input messages and {max_new_tokens} tokens "
        f"for the completion. Please reduce the number of tokens in the input messages or "
        f"the completion to fit within the limit."
    )


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# ---------------------------------------------------------------------- finish reasons
def native_finish_reason(finish: Finish | None) -> dict[str, Any] | None:
    if finish is None:
        return None
    if finish.kind == "stop":
        return {"type": "stop", "matched": finish.matched}
    if finish.kind == "length":
        return {"type": "length", "length": finish.length}
    # 0.5.23 always carries status_code and err_type (null for a graceful abort: checked
    # on the real server after /abort_request)
    reason: dict[str, Any] = {"type": "abort", "message": finish.message}
    code = finish.status_code
    reason["status_code"] = code
    reason["err_type"] = None if code is None else finish.err_type or HTTPStatus(code).name
    return reason


def openai_finish_reason(finish: Finish | None) -> tuple[str | None, int | None]:
    """``(finish_reason, matched_stop)``."""
    if finish is None:
        return None, None
    if finish.kind == "stop":
        return "stop", finish.matched
    if finish.kind == "length":
        return "length", None
    return "abort", None


# ---------------------------------------------------------------------- usage
def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    cache_report: bool,
) -> dict[str, Any]:
    """``UsageInfo``: ``prompt_tokens_details`` with ``--enable-cache-report``, hit or miss
    (``{"cached_tokens": 0}`` on a miss, as the real 0.5.23 server reports), else null."""
    details = {"cached_tokens": cached_tokens} if cache_report else None
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def usage_excluding_none(u: dict[str, Any]) -> dict[str, Any]:
    """The completions stream's usage chunk is serialized with ``exclude_none=True``."""
    return {k: v for k, v in u.items() if v is not None}


# ---------------------------------------------------------------------- sglext
def sglext(cached_tokens_details: dict[str, int] | None) -> dict[str, Any] | None:
    """The OpenAI routes' ``sglext`` object (0.5.9+) when the request set
    ``return_cached_tokens_details``: its set fields only, null when there is none."""
    if cached_tokens_details is None:
        return None
    return {"cached_tokens_details": cached_tokens_details}


def with_sglext(response: dict[str, Any], ext: dict[str, Any] | None) -> dict[str, Any]:
    """A non-streamed response with ``sglext`` last, omitted when null (0.5.23's
    serializer)."""
    if ext is not None:
        response["sglext"] = ext
    return response


def sglext_chunk(rid: str, created: int, model: str, kind: str, ext: dict[str, Any]) -> bytes:
    """The extra stream chunk carrying ``sglext`` (``choices`` empty, ``usage`` null),
    after the last content chunk and before the usage chunk; ``kind`` is the chunks'
    ``object``."""
    return sse(
        {
            "id": rid,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [],
            "usage": None,
            "sglext": ext,
        }
    )


# ---------------------------------------------------------------------- chat
def chat_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: Finish | None,
    u: dict[str, Any],
    ext: dict[str, Any] | None = None,
) -> dict[str, Any]:
    reason, matched = openai_finish_reason(finish)
    return with_sglext(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "reasoning_content": None},
                    "logprobs": None,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            ],
            "usage": u,
            "metadata": metadata(u["completion_tokens"]),
        },
        ext,
    )


def weight_versions(completion_tokens: int) -> list[dict[str, Any]]:
    """0.5.23's spans of output tokens per weight version: one span here (weights never
    change)."""
    return [{"version": WEIGHT_VERSION, "start": 0, "end": completion_tokens}]


def metadata(completion_tokens: int) -> dict[str, Any]:
    """The non-streamed OpenAI responses' ``metadata`` (0.5.23 adds ``weight_versions``)."""
    return {"weight_version": WEIGHT_VERSION, "weight_versions": weight_versions(completion_tokens)}


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish: Finish | None = None,
    u: dict[str, Any] | None = None,
) -> bytes:
    reason, matched = openai_finish_reason(finish)
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
        ],
    }
    if u is not None:
        chunk["usage"] = u
    return sse(chunk)


def chat_usage_chunk(rid: str, created: int, model: str, u: dict[str, Any]) -> bytes:
    return sse(
        {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": u,
        }
    )


# ---------------------------------------------------------------------- completions
def completion_choice(index: int, text: str, finish: Finish | None) -> dict[str, Any]:
    reason, matched = openai_finish_reason(finish)
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": reason,
        "matched_stop": matched,
    }


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    u: dict[str, Any],
    ext: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return with_sglext(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": u,
            "metadata": metadata(u["completion_tokens"]),
        },
        ext,
    )


def completion_chunk(
    rid: str, created: int, model: str, choice: dict[str, Any], u: dict[str, Any] | None = None
) -> bytes:
    return sse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": u,
        }
    )


def completion_usage_chunk(rid: str, created: int, model: str, u: dict[str, Any]) -> bytes:
    return sse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage_excluding_none(u),
        }
    )


# ---------------------------------------------------------------------- /generate
def generate_output(
    rid: str,
    text: str,
    output_ids: list[int],
    finish: Finish | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    e2e_latency: float | None,
    sent_ts: float | None,
    timing: GenerateTiming | None = None,
    dp_rank: int | None = None,
    cached_details: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``/generate``'s body (or one streamed chunk) in 0.5.23's key order.

    Checked against the real server (``tests/sglang``): ``cached_tokens_details`` is null
    (no HiCache), ``dp_rank`` null, ``weight_versions`` only once finished; with
    ``--enable-metrics`` (``timing`` given) the scheduler's stamps come first and the
    request's timings at finish. ``response_sent_to_client_ts`` is on every chunk.
    ``dp_rank`` is the rank that served the request with ``--dp-size`` (null without).
    ``cached_details``: ``{"device": N, "host": M}`` with HiCache (:func:`cached_details`).
    """
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": native_finish_reason(finish),
        "prompt_tokens": prompt_tokens,
        "weight_version": WEIGHT_VERSION,
        "num_retractions": 0,
    }
    if timing is not None:
        meta["storage_prefetch_wait"] = 0.0
        meta["storage_staging_wait"] = 0.0
        meta["forward_entry_time"] = timing.received_ts
        meta["prefill_finished_time"] = timing.received_ts + timing.ttft_s
        meta["queue_time"] = 0.0
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = completion_tokens
    meta["cached_tokens"] = cached_tokens
    if e2e_latency is not None:
        meta["weight_versions"] = weight_versions(completion_tokens)
    meta["cached_tokens_details"] = cached_details
    meta["dp_rank"] = dp_rank
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
        if timing is not None:
            meta["request_received_ts"] = timing.received_ts
            meta["first_token_latency"] = timing.ttft_s
            meta["api_server_dispatch_finish_ts"] = timing.received_ts
    meta["response_sent_to_client_ts"] = sent_ts if sent_ts is not None else time.time()
    if e2e_latency is not None and timing is not None:
        meta["request_finished_ts"] = timing.received_ts + e2e_latency
        decode_s = e2e_latency - timing.ttft_s
        meta["decode_throughput"] = completion_tokens / decode_s if decode_s > 0 else 0.0
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def cached_details(cached_tokens: int, cached_host: int) -> dict[str, int] | None:
    """SGLang's ``cached_tokens_details`` (``get_cached_tokens_details``): null without a
    hit, else the hit split by tier, ``{"device": N, "host": M}`` (no ``storage`` key: the
    simulator has no L3 backend). Reported when HiCache is on."""
    if cached_tokens <= 0:
        return None
    return {"device": cached_tokens - cached_host, "host": cached_host}


@dataclass(frozen=True, slots=True)
class GenerateTiming:
    """The stamps ``/generate`` reports with ``--enable-metrics``: wall-clock arrival and
    the modelled time to first token (0 until the first token)."""

    received_ts: float
    ttft_s: float


def generate_stream_error(message: str) -> bytes:
    return sse(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        }
    )
