"""The gateway's own API as an OpenAPI 3.0 document, served at ``GET /openapi.json``.

Contract: :func:`build_spec` returns the document as plain data: every inference,
model-list, probe and admin route the gateway serves, its request body schema (the
fields the gateway itself validates; any other field is allowed and forwarded untouched),
and its answers, errors as the OpenAI-style ``Error`` object. Streaming answers are
``text/event-stream``. Security schemes describe the client and admin bearer keys; which
routes need them depends on the configuration (``docs/SECURITY.md``). The document is
static: it does not depend on the running configuration, so it is safe to serve openly.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

_JSON = "application/json"
_ERROR_REF = {"$ref": "#/components/schemas/Error"}
_ERROR_STATUSES = {
    "400": "Invalid request: bad JSON, wrong types, a missing field",
    "401": "Missing or invalid API key",
    "403": "A client key used on an admin route",
    "404": "Unknown route or worker",
    "405": "Method not allowed",
    "413": "Body over the configured maximum",
    "429": "Rate limit or admission queue full (Retry-After set)",
    "502": "The worker failed",
    "503": "No routable worker, or the admission queue timed out (Retry-After set)",
    "504": "The worker timed out",
}


# A worker's own 4xx is relayed as it is (SGLang's shape), so a 400 may be either.
_WORKER_ERROR = {"type": "object", "properties": {"message": {"type": "string"}}}


def _errors(*codes: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for code in codes:
        schema = {"anyOf": [_ERROR_REF, _WORKER_ERROR]} if code == "400" else _ERROR_REF
        out[code] = {"description": _ERROR_STATUSES[code], "content": {_JSON: {"schema": schema}}}
    return out


def _object(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": True,
    }


_N = {"nullable": True}  # the gateway treats null as absent
_IDS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": 4294967295},
}
_STRING_OR_LIST = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        _IDS,
        {"type": "array", "minItems": 1, "items": _IDS},
    ]
}
_COMMON = {
    "model": {"type": "string", **_N},
    "stream": {"type": "boolean", **_N},
    "max_tokens": {"type": "integer", "minimum": 0, **_N},
    "user": {"type": "string", **_N},
    "temperature": {"type": "number", **_N},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean", **_N}},
        **_N,
    },
}
_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"type": "string"},
        "content": {"type": "string", "nullable": True},
    },
    "required": ["role"],
}
_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": _object(
        {**_COMMON, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE}},
        ["messages"],
    ),
    "/v1/completions": _object({**_COMMON, "prompt": _STRING_OR_LIST}, ["prompt"]),
    "/generate": _object(
        {**_COMMON, "text": _STRING_OR_LIST, "sampling_params": {"type": "object", **_N}},
        ["text"],
    ),
    "/v1/embeddings": _object(
        {"model": {"type": "string", **_N}, "input": _STRING_OR_LIST}, ["input"]
    ),
}


def _inference(path: str) -> dict[str, Any]:
    streams = path != "/v1/embeddings"
    # an object, or a list for a batch of prompts
    ok: dict[str, Any] = {_JSON: {"schema": {"oneOf": [{"type": "object"}, {"type": "array"}]}}}
    if streams:
        ok["text/event-stream"] = {}  # SSE events: the worker's chunks, relayed
    return {
        "post": {
            "summary": f"Routed to a worker (SGLang/OpenAI {path})",
            "security": [{"clientKey": []}, {}],
            "requestBody": {
                "required": True,
                "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{_name(path)}"}}},
            },
            "responses": {
                "200": {"description": "The worker's answer, relayed", "content": ok},
                **_errors("400", "401", "413", "429", "502", "503", "504"),
            },
        }
    }


def _name(path: str) -> str:
    return "".join(p.title() for p in path.replace("/v1/", "/").strip("/").split("/")) + "Request"


def _get(summary: str, secured: str | None, *codes: str, ctype: str = _JSON) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": {ctype: {"schema": _schema_for(ctype)}}},
            **_errors(*codes),
        },
    }
    if secured:
        op["security"] = [{secured: []}, {}]
    return {"get": op}


def _schema_for(ctype: str) -> dict[str, Any]:
    return {"type": "object"} if ctype == _JSON else {"type": "string"}


_WORKER_URL = {
    "type": "string",
    "pattern": "^https?://[a-z0-9.-]+:[1-9][0-9]{0,3}$",
    "example": "http://127.0.0.1:30001",
}
_WORKER = {"type": "object"}
_WORKER_ID = [{"name": "worker_id", "in": "path", "required": True, "schema": {"type": "string"}}]
_URL_QUERY = [{"name": "url", "in": "query", "required": True, "schema": _WORKER_URL}]
_DEADLINE_QUERY = {"name": "deadline_s", "in": "query", "schema": {"type": "number"}}


def _flag_query(name: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "schema": {"type": "string", "enum": ["true", "false"]}}


def _admin(
    method: str, summary: str, ok: str, *codes: str, ok_again: str = "", **extra: Any
) -> dict[str, Any]:
    oks = [ok, ok_again] if ok_again else [ok]
    op: dict[str, Any] = {
        "summary": summary,
        "security": [{"adminKey": []}, {}],
        "responses": {
            **{c: {"description": "OK", "content": {_JSON: {"schema": _WORKER}}} for c in oks},
            **_errors("401", "403", *codes),
        },
        **extra,
    }
    return {method: op}


def _admin_paths() -> dict[str, Any]:
    body = {
        "required": True,
        "content": {_JSON: {"schema": _object({"url": _WORKER_URL}, ["url"])}},
    }
    return {
        "/workers": {
            **_admin("get", "Every worker's live state", "200"),
            **_admin(
                "post",
                "Register a worker (allow-listed hosts only)",
                "201",
                "400",
                requestBody=body,
                ok_again="200",
            ),
        },
        "/workers/{worker_id}": {
            **_admin("get", "One worker", "200", "404", parameters=_WORKER_ID),
            **_admin(
                "delete",
                "Remove a worker (?rehome=true: re-home its prefixes first)",
                "200",
                "400",
                "404",
                parameters=[*_WORKER_ID, _flag_query("rehome")],
            ),
        },
        "/workers/{worker_id}/drain": {
            **_admin(
                "post",
                "Drain a worker (re-home and pre-warm its prefixes)",
                "202",
                "400",
                "404",
                parameters=[
                    *_WORKER_ID,
                    _flag_query("rehome"),
                    _flag_query("prewarm"),
                    _DEADLINE_QUERY,
                ],
            ),
            **_admin("get", "The worker's last drain report", "200", "404", parameters=_WORKER_ID),
        },
        "/workers/{worker_id}/join": _admin(
            "get",
            "A joining worker's slow start and pre-warm",
            "200",
            "404",
            parameters=_WORKER_ID,
        ),
        "/add_worker": _admin(
            "post", "Legacy add", "201", "400", parameters=_URL_QUERY, ok_again="200"
        ),
        "/remove_worker": _admin(
            "post", "Legacy remove", "200", "400", "404", parameters=_URL_QUERY
        ),
        "/list_workers": _admin("get", "Legacy list", "200"),
    }


def build_spec() -> dict[str, Any]:
    """The OpenAPI 3.0.3 document (see the module contract)."""
    paths: dict[str, Any] = {p: _inference(p) for p in _BODIES}
    paths["/v1/models"] = _get("Models served by the workers", "clientKey", "401")
    paths["/health"] = _get("200 while a worker is routable", None, "503")
    paths["/readiness"] = _get("Same as /health", None, "503")
    paths["/liveness"] = _get("200 while the gateway process serves", None)
    paths["/openapi.json"] = _get("This document", None)
    paths.update(_admin_paths())
    schemas: dict[str, Any] = {_name(p): s for p, s in _BODIES.items()}
    schemas["Error"] = _object(
        {
            "error": _object(
                {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": "string", "nullable": True},
                    "code": {"type": "integer"},
                },
                ["message", "type", "code"],
            )
        },
        ["error"],
    )
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "prefix-gateway",
            "version": "0.1.0",
            "description": "Prefix-aware gateway in front of SGLang workers.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "clientKey": {"type": "http", "scheme": "bearer"},
                "adminKey": {"type": "http", "scheme": "bearer"},
            },
        },
    }


def add_openapi_route(app: web.Application) -> None:
    """Serve :func:`build_spec` at ``GET /openapi.json`` (built once)."""
    import orjson

    body = orjson.dumps(build_spec())

    async def openapi(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app.router.add_get("/openapi.json", openapi)
