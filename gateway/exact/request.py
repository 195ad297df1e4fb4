"""Exact mode's view of one request: its token ids and cache namespace, computed lazily.

* :func:`request_tokens` reads a request body as the worker will cache it: the token ids
  (``chat`` rendered and tokenized by the configured tokenizer, ``completions`` /
  ``generate`` text tokenized or ids taken as given; a batch keys on its first prompt)
  and the namespace ``(LoRA, cache_salt, extra_key)``. Unknown shapes give ``None``
  tokens, so the request gets no exact hit rather than a wrong one.
* :class:`ExactRequest` is what the router holds per request: it tokenizes at most once,
  and only if some candidate worker is followed by the manager (an :class:`ExactMatcher`,
  :class:`gateway.exact.manager.KVEventsManager` in the gateway).

Cost: one JSON parse and one tokenization per request that needs tokens; none otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import orjson

from gateway.exact.index import Namespace
from gateway.exact.tokenizer import Tokenizer


class ExactMatcher(Protocol):
    """What a request asks of the manager (``KVEventsManager``): tokens, matches, modes."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    def wants_tokens(self, worker_ids: Iterable[str]) -> bool: ...

    def match(
        self, ids: Sequence[int] | None, namespace: Namespace, worker_ids: Iterable[str]
    ) -> dict[str, int]: ...

    def dispatched(
        self, worker_id: str, ids: Sequence[int] | None, namespace: Namespace
    ) -> None: ...

    def mode(self, worker_id: str) -> str: ...

    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None: ...


class ExactRequest:
    """One request as exact mode sees it; tokenized lazily, at most once."""

    __slots__ = ("_body", "_done", "_ids", "_kind", "_mgr", "_namespace")

    def __init__(self, mgr: ExactMatcher, kind: str, body: bytes) -> None:
        self._mgr, self._kind, self._body = mgr, kind, body
        self._ids: list[int] | None = None
        self._namespace: Namespace = (None, None, None)
        self._done = False

    def tokens(self) -> tuple[list[int] | None, Namespace]:
        if not self._done:
            self._ids, self._namespace = request_tokens(self._kind, self._body, self._mgr.tokenizer)
            self._done = True
        return self._ids, self._namespace

    def match(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Matched tokens of the workers in exact mode (others absent)."""
        if not self._mgr.wants_tokens(worker_ids):
            return {}
        return self._mgr.match(*self.tokens(), worker_ids)

    def dispatched(self, worker_id: str) -> None:
        if self._mgr.wants_tokens([worker_id]):
            self._mgr.dispatched(worker_id, *self.tokens())

    def mode(self, worker_id: str) -> str:
        return self._mgr.mode(worker_id)

    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None:
        self._mgr.observe(worker_id, mode, predicted, reported)


def request_tokens(
    kind: str, body: bytes, tokenizer: Tokenizer
) -> tuple[list[int] | None, Namespace]:
    """The token ids a worker caches for this body, and its namespace; None if unknown.

    ``kind`` is ``chat``, ``completions`` or ``generate`` (others: None). A batch is
    tokenized on its first prompt (routing keys on it).
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, (None, None, None)
    if not isinstance(obj, dict):
        return None, (None, None, None)
    namespace = _request_namespace(obj)
    try:
        return _tokens(kind, obj, tokenizer), namespace
    except (TypeError, ValueError, AttributeError):
        return None, namespace


def _request_namespace(obj: Mapping[str, Any]) -> Namespace:
    lora = obj.get("lora_path")
    model = obj.get("model")
    if not lora and isinstance(model, str) and ":" in model:
        lora = model.split(":", 1)[1]
    salt, extra = obj.get("cache_salt"), obj.get("extra_key")
    return (
        str(lora) if lora else None,
        str(salt) if salt else None,
        str(extra) if extra else None,
    )


def _tokens(kind: str, obj: Mapping[str, Any], tokenizer: Tokenizer) -> list[int] | None:
    if kind == "chat":
        messages = obj.get("messages")
        return tokenizer.encode_chat(messages, obj.get("tools")) if messages else None
    value = obj.get("prompt") if kind == "completions" else obj.get("text")
    if kind == "generate" and value is None:
        value = obj.get("input_ids")
    if kind not in ("completions", "generate") or value is None:
        return None
    if isinstance(value, list) and value and not isinstance(value[0], int):
        value = value[0]  # a batch: its first prompt
    if isinstance(value, str):
        return tokenizer.encode(value)
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return value
    return None
