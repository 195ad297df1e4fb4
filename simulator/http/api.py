"""Wire formats of SGLang 0.5.23 (SGLANG_API.md §1, §2): bodies, chunks and errors.

Pure functions from the simulator's request state to JSON-able dicts and bytes; the HTTP
handlers in :mod:`simulator.http.sglang` decide when to send what. Field order follows the
reference (SGLang serializes with orjson / pydantic in declaration order).
"""

from __future__ import annotations

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
    reason: dict[str, Any] = {"type": "abort", "message": finish.message}
    if finish.status_code is not None:
        reason["status_code"] = finish.status_code
        reason["err_type"] = HTTPStatus(finish.status_code).name
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
    """``UsageInfo``: ``prompt_tokens_details`` only with ``--enable-cache-report`` and a hit."""
    details = {"cached_tokens": cached_tokens} if cache_report and cached_tokens > 0 else None
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


# ---------------------------------------------------------------------- chat
def chat_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: Finish | None,
    u: dict[str, Any],
) -> dict[str, Any]:
    reason, matched = openai_finish_reason(finish)
    return {
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
        "metadata": {"weight_version": WEIGHT_VERSION},
    }


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
    rid: str, created: int, model: str, choices: list[dict[str, Any]], u: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": u,
        "metadata": {"weight_version": WEIGHT_VERSION},
    }


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
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": native_finish_reason(finish),
        "prompt_tokens": prompt_tokens,
        "weight_version": WEIGHT_VERSION,
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "cached_tokens_details": {"device": cached_tokens, "host": 0},
    }
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
        meta["response_sent_to_client_ts"] = sent_ts
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


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
