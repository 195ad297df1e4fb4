"""Request body → :class:`RouteRequest`: everything routing needs, parsed once.

Contract:
- The body is parsed once with orjson and validated; a bad body raises
  :class:`RequestError` (status 400) naming the field. Unknown fields are ignored here and
  reach the worker untouched: ``RouteRequest.body`` is the original bytes.
- The *canonical prompt* is what the worker will cache, approximated without a
  tokenizer, such that turn k's text is a prefix of turn k+1's:
  - chat: the ``tools`` list (JSON, sorted keys) first, then per message its role,
    content (text parts concatenated; non-text parts as stable placeholders with a hash
    of their payload) and ``tool_calls`` (JSON, sorted keys), each field and message
    closed by a separator control character;
  - completions: ``prompt``; ``/generate``: ``text`` or ``input_ids``; a batch (a list of
    prompts) is hashed on its first prompt and counted whole;
  - token ids are packed as 4 bytes each, so a 64-byte block is 16 tokens and
    ``prompt_tokens`` is exact;
  - embeddings are routed by load: counted, not hashed.
- "Characters" are bytes of the UTF-8 encoding (identical for ASCII). Prompt tokens are
  estimated here as ``ceil(chars / chars_per_token)`` with the configured prior; the
  routing core re-sizes them with the ratio learnt from the workers' answers
  (``routing.tokens``). Token-id prompts are exact (``tokens_exact``).
- The hash chain is seeded with the model and the cache namespace (``cache_salt``,
  ``extra_key``, ``lora_path``), since a worker never shares cache across them (a
  ``model: "base:adapter"`` differs from ``base`` already).
- The LoRA adapter a request names (:meth:`RouteRequest.target`: ``model:
  "base:adapter"`` first, else ``lora_path``) is read here and nowhere else.
- The prompt text is never logged or stored: only its hashes and lengths leave here.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy
from xxhash import xxh3_64_hexdigest

from gateway.config import ROUTING_KEY_HEADERS
from gateway.routing.hashing import block_hashes, seed_for

# Separators that do not occur in ordinary text: each closes a field or a message, so a
# rendering of messages 1..k is a prefix of the rendering of messages 1..k+1.
_FIELD_END = "\x1f"
_MESSAGE_END = "\x1e"
_PART_MARK = "\x1d"
_TOKEN_ID_BYTES = 4  # token ids packed as uint32
# header mappings whose get() ignores case (aiohttp's): no scan of every name after a miss
_CASE_INSENSITIVE = (CIMultiDictProxy, CIMultiDict)


class ApiKind(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    GENERATE = "generate"
    EMBEDDINGS = "embeddings"


class RequestError(Exception):
    """A request the gateway refuses; rendered by the server as an OpenAI-style error."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        err_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type


# SGLang's request member naming the DP rank (0.5.10+), and its older spelling (0.4.8 -
# 0.5.9; a deprecated alias since)
DP_RANK_KEYS = ("routed_dp_rank", "data_parallel_rank")


@dataclass(frozen=True, slots=True)
class RequestSettings:
    chars_per_token: float = 4.0
    block_chars: int = 64
    routing_key_headers: tuple[str, ...] = ROUTING_KEY_HEADERS  # lower case, first wins
    routing_key_from_user: bool = True


@dataclass(slots=True)
class RouteRequest:
    kind: ApiKind
    model: str | None
    stream: bool
    include_usage: bool
    prompt_chars: int  # UTF-8 bytes of the canonical prompt (4 per token id)
    prompt_tokens: int  # estimated from chars, exact for token ids
    block_hashes: list[int]  # chained, seeded with model + cache namespace
    routing_key: str | None
    rid: str | None  # a string rid already present in the body
    body: bytes  # the original bytes, untouched
    block_chars: int = 64  # block size the hashes were cut with
    rid_in_body: bool = False  # the body has a non-null rid (string, or a list for batches)
    tokens_exact: bool = False  # the prompt is token ids: prompt_tokens is exact
    batch: bool = False  # a list of prompts (SGLang wants a list of rids then, or none)
    lora_path: str | None = None  # SGLang's lora_path when a string: an adapter's name
    dp_rank_in_body: bool = False  # the body names a DP rank (routed_dp_rank or its alias)

    def target(self, served: Collection[str]) -> tuple[str | None, str | None]:
        """(base model, LoRA adapter) this request names, given the names the workers
        serve under: :func:`split_model` of ``model``, whose adapter wins over
        ``lora_path`` (SGLang's ``serving_base._resolve_lora_path``)."""
        base, adapter = split_model(self.model, served)
        return base, adapter or self.lora_path

    def matched_tokens(self, blocks: int) -> int:
        """Tokens covered by ``blocks`` leading blocks of this prompt (estimate)."""
        if self.prompt_chars <= 0 or blocks <= 0:
            return 0
        covered = blocks * self.block_chars * self.prompt_tokens / self.prompt_chars
        return min(self.prompt_tokens, int(covered))


@dataclass(slots=True)
class _Prompt:
    """The canonical prompt of one request: text or packed ids for hashing, and lengths."""

    data: bytes = b""
    chars: int = 0
    tokens: int = 0
    extra: list[str] = field(default_factory=list)  # namespace parts found in the body
    exact: bool = False  # token ids: ``tokens`` is the count, not an estimate
    batch: bool = False  # several prompts (a list)


def parse_request(
    kind: ApiKind, body: bytes, headers: Mapping[str, str], settings: RequestSettings
) -> RouteRequest:
    """Parse and validate ``body`` for ``kind``; raise :class:`RequestError` on bad input."""
    obj = _load(body)
    model = _opt_type(obj, "model", str, "a string")
    stream = bool(_opt_type(obj, "stream", bool, "a boolean"))
    include_usage = _include_usage(obj)
    _check_numbers(obj)
    prompt = _PROMPT_READERS[kind](obj, settings)
    namespace = _namespace(obj)
    hashes: list[int] = []
    if kind is not ApiKind.EMBEDDINGS and prompt.data:
        hashes = block_hashes(prompt.data, settings.block_chars, seed_for(model, namespace))
    rid_value = obj.get("rid")
    return RouteRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        prompt_chars=prompt.chars,
        prompt_tokens=prompt.tokens,
        block_hashes=hashes,
        routing_key=_routing_key(obj, headers, settings),
        rid=rid_value if isinstance(rid_value, str) else None,
        body=body,
        block_chars=settings.block_chars,
        rid_in_body=rid_value is not None,
        tokens_exact=prompt.exact,
        batch=prompt.batch,
        lora_path=_lora_path(obj),
        dp_rank_in_body=any(k in obj for k in DP_RANK_KEYS),
    )


def _lora_path(obj: Mapping[str, Any]) -> str | None:
    """``lora_path`` as a string (a batch's list: its first adapter); else None."""
    value = obj.get("lora_path")
    if isinstance(value, list):
        value = next((v for v in value if v), None)
    if value is not None and not isinstance(value, str):
        raise RequestError(400, "'lora_path' must be a string or a list of strings", "lora_path")
    return value or None


def split_model(model: str | None, served: Collection[str]) -> tuple[str | None, str | None]:
    """``"base:adapter"`` → (base, adapter), SGLang's ``_parse_model_parameter``: a name
    some worker serves under is a base model whole, colons and all; a served name followed
    by ``:`` is split after it (the longest such name: the same split whatever the order
    of ``served``); otherwise at the first colon; nothing after it names no adapter."""
    if model is None or ":" not in model or model in served:
        return model, None
    prefixes = [name for name in served if model.startswith(f"{name}:")]
    base = max(prefixes, key=lambda name: (len(name), name)) if prefixes else None
    if base is None:
        base, adapter = model.split(":", 1)
    else:
        adapter = model[len(base) + 1 :]
    return base.strip(), adapter.strip() or None


def _load(body: bytes) -> dict[str, Any]:
    if not body or not body.strip():
        raise RequestError(400, "request body is empty; expected a JSON object")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"request body is not valid JSON (UTF-8): {exc}") from None
    if not isinstance(obj, dict):
        raise RequestError(400, "request body must be a JSON object")
    return obj


def _opt_type(obj: Mapping[str, Any], key: str, typ: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    # bool is an int subclass: a boolean where a number is expected is still an error
    if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
        raise RequestError(400, f"'{key}' must be {what}", param=key)
    return value


def _include_usage(obj: Mapping[str, Any]) -> bool:
    options = _opt_type(obj, "stream_options", dict, "an object")
    if options is None:
        return False
    return bool(_opt_type(options, "include_usage", bool, "a boolean"))


_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "top_k", "seed", "min_tokens")
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")
_STRING_FIELDS = ("user", "cache_salt", "extra_key")  # lora_path may be a list (batches)


def _check_numbers(obj: Mapping[str, Any]) -> None:
    # a field absent (or null) is skipped before any call: most bodies have one or two
    get = obj.get
    for key in _INT_FIELDS:
        if get(key) is not None:
            value = _opt_type(obj, key, int, "an integer")
            if key != "seed" and key != "top_k" and value < 0:
                raise RequestError(400, f"'{key}' must be a non-negative integer", param=key)
    for key in _NUMBER_FIELDS:
        if get(key) is not None:
            _opt_type(obj, key, (int, float), "a number")
    for key in _STRING_FIELDS:
        if get(key) is not None:
            _opt_type(obj, key, str, "a string")
    params = _opt_type(obj, "sampling_params", dict, "an object")
    if params is not None:
        value = _opt_type(params, "max_new_tokens", int, "an integer")
        if value is not None and value < 0:
            raise RequestError(400, "'sampling_params.max_new_tokens' must be >= 0")


def _namespace(obj: Mapping[str, Any]) -> str | None:
    parts = [obj.get(k) for k in ("cache_salt", "extra_key", "lora_path")]
    if not any(parts):
        return None
    return "\x00".join(p if isinstance(p, str) else _json(p) if p else "" for p in parts)


def _routing_key(
    obj: Mapping[str, Any], headers: Mapping[str, str], settings: RequestSettings
) -> str | None:
    for name in settings.routing_key_headers:
        value = _header(headers, name)
        if value:
            return value
    if settings.routing_key_from_user:
        user = obj.get("user")
        if isinstance(user, str) and user:
            return user
    return None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)  # case-insensitive already for aiohttp's CIMultiDict
    if value is not None or isinstance(headers, _CASE_INSENSITIVE):
        return value
    for key, val in headers.items():
        if key.lower() == name:
            return val
    return None


# --- prompts -------------------------------------------------------------------------


def _text_prompt(text: str, settings: RequestSettings) -> _Prompt:
    data = text.encode()
    return _Prompt(data, len(data), _estimate_tokens(len(data), settings))


def _estimate_tokens(chars: int, settings: RequestSettings) -> int:
    return math.ceil(chars / settings.chars_per_token) if chars else 0


def _ids_prompt(ids: list[Any], param: str) -> _Prompt:
    try:
        packed = array("I", ids)  # validates: non-negative ints below 2**32
    except (TypeError, OverflowError):
        raise RequestError(
            400, f"'{param}' must be a list of non-negative integer token ids", param=param
        ) from None
    data = packed.tobytes()
    return _Prompt(data, len(ids) * _TOKEN_ID_BYTES, len(ids), exact=True)


def _prompt_value(value: Any, param: str, settings: RequestSettings, allow_text: bool) -> _Prompt:
    """A str, list[str], list[int] or list[list[int]]; batches hash their first prompt."""
    bad = RequestError(400, _prompt_shape_message(param, allow_text), param=param)
    if isinstance(value, str):
        if not allow_text:
            raise bad
        return _text_prompt(value, settings)
    if not isinstance(value, list) or not value:
        raise bad
    first = value[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return _ids_prompt(value, param)
    if isinstance(first, str) and allow_text:
        if not all(isinstance(v, str) for v in value):
            raise bad
        parts = [_text_prompt(v, settings) for v in value]
    elif isinstance(first, list):
        if not all(isinstance(v, list) and v for v in value):
            raise bad
        parts = [_ids_prompt(v, param) for v in value]
    else:
        raise bad
    chars, tokens = sum(p.chars for p in parts), sum(p.tokens for p in parts)
    exact = all(p.exact for p in parts)
    return _Prompt(parts[0].data, chars, tokens, exact=exact, batch=True)


def _prompt_shape_message(param: str, allow_text: bool) -> str:
    if allow_text:
        return (
            f"'{param}' must be a non-empty string, list of strings, list of token ids "
            "or list of lists of token ids"
        )
    return f"'{param}' must be a non-empty list of token ids or list of lists of token ids"


def _completions_prompt(obj: Mapping[str, Any], settings: RequestSettings) -> _Prompt:
    if "prompt" not in obj or obj["prompt"] is None:
        raise RequestError(400, "'prompt' is required", param="prompt")
    return _prompt_value(obj["prompt"], "prompt", settings, allow_text=True)


def _generate_prompt(obj: Mapping[str, Any], settings: RequestSettings) -> _Prompt:
    text, ids = obj.get("text"), obj.get("input_ids")
    if text is not None and ids is not None:
        raise RequestError(400, "give either 'text' or 'input_ids', not both", param="text")
    if text is not None:
        return _prompt_value(text, "text", settings, allow_text=True)
    if ids is not None:
        return _prompt_value(ids, "input_ids", settings, allow_text=False)
    if obj.get("input_embeds") is not None:
        return _Prompt()  # embeddings in, nothing to hash; routed by load
    raise RequestError(400, "one of 'text' or 'input_ids' is required", param="text")


def _embeddings_prompt(obj: Mapping[str, Any], settings: RequestSettings) -> _Prompt:
    if "input" not in obj or obj["input"] is None:
        raise RequestError(400, "'input' is required", param="input")
    return _prompt_value(obj["input"], "input", settings, allow_text=True)


def _chat_prompt(obj: Mapping[str, Any], settings: RequestSettings) -> _Prompt:
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of objects", "messages")
    out: list[str] = []
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError(400, "'tools' must be a list", param="tools")
        out += ["tools", _FIELD_END, _json(tools), _MESSAGE_END]
    for i, message in enumerate(messages):
        _render_message(message, i, out)
    return _text_prompt("".join(out), settings)


def _render_message(message: Any, i: int, out: list[str]) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(400, f"'{where}' must be an object", param=where)
    role = message.get("role")
    if not isinstance(role, str):
        raise RequestError(400, f"'{where}.role' must be a string", param=f"{where}.role")
    out += [role, _FIELD_END]
    _render_content(message.get("content"), where, out)
    out.append(_FIELD_END)
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        out += [_json(tool_calls), _FIELD_END]
    out.append(_MESSAGE_END)


def _render_content(content: Any, where: str, out: list[str]) -> None:
    if content is None:
        return
    if isinstance(content, str):
        out.append(content)
        return
    if not isinstance(content, list):
        raise RequestError(
            400,
            f"'{where}.content' must be a string, a list of content parts or null",
            param=f"{where}.content",
        )
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise RequestError(
                400, f"'{where}.content[{j}]' must be an object", param=f"{where}.content"
            )
        out.append(_render_part(part, f"{where}.content[{j}]"))


def _render_part(part: Mapping[str, Any], where: str) -> str:
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(400, f"'{where}.text' must be a string", param=f"{where}.text")
        return text
    # A stable placeholder: the same image (URL or data URL) gives the same text.
    payload = part.get(kind) if isinstance(kind, str) else None
    if kind == "image_url" and isinstance(payload, dict):
        payload = payload.get("url")
    digest = xxh3_64_hexdigest(_json(payload if payload is not None else part).encode())
    return f"{_PART_MARK}{kind}:{digest}{_PART_MARK}"


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # e.g. integers beyond 64 bits: still deterministic
        return repr(value)


_PROMPT_READERS = {
    ApiKind.CHAT: _chat_prompt,
    ApiKind.COMPLETIONS: _completions_prompt,
    ApiKind.GENERATE: _generate_prompt,
    ApiKind.EMBEDDINGS: _embeddings_prompt,
}
