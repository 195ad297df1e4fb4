"""OpenAI-style JSON errors: the one error shape every gateway response uses.

Contract: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as
``code``, or OpenAI's own code where it has one (``model_not_found``).
:class:`GatewayError` carries everything needed to build the response, so the request path
raises and one place (the middleware in ``gateway.http.handlers``) renders and logs it,
one line per error with the request id.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import orjson
from aiohttp import web

# OpenAI's type names for each status the gateway produces.
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


class GatewayError(Exception):
    """An error the gateway answers itself, rendered by :func:`error_response`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        err_type: str | None = None,
        retry_after: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "error")
        self.retry_after = retry_after
        self.code = code


def error_body(
    status: int,
    message: str,
    err_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": err_type or _TYPES.get(status, "error"),
                "param": param,
                "code": code or status,
            }
        }
    )


def error_response(
    status: int,
    message: str,
    *,
    err_type: str | None = None,
    param: str | None = None,
    retry_after: float | None = None,
    headers: Mapping[str, str] | None = None,
    code: str | None = None,
) -> web.Response:
    hdrs = dict(headers or {})
    if retry_after is not None:
        hdrs["Retry-After"] = str(max(1, round(retry_after)))
    return web.Response(
        status=status,
        body=error_body(status, message, err_type, param, code),
        content_type="application/json",
        headers=hdrs,
    )


def render(exc: GatewayError, headers: Mapping[str, str] | None = None) -> web.Response:
    return error_response(
        exc.status,
        exc.message,
        err_type=exc.err_type,
        param=exc.param,
        retry_after=exc.retry_after,
        headers=headers,
        code=exc.code,
    )


def stream_error_event(status: int, message: str, err_type: str | None = None) -> bytes:
    """SGLang's streaming error: one error event then ``[DONE]`` (SGLANG_API.md §1.9)."""
    payload = {
        "error": {
            "object": "error",
            "message": message,
            "type": err_type or _TYPES.get(status, "error"),
            "param": None,
            "code": status,
        }
    }
    return b"data: " + orjson.dumps(payload) + b"\n\ndata: [DONE]\n\n"


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with its control characters and line separators escaped (``\\x0a``,
    ``\\u2028``): what a client or a worker sent, quoted back or logged, stays one line
    (a CR or LF would forge a log line of its own)."""
    return _UNPRINTABLE.sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
