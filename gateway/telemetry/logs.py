"""Structured logging: plain or JSON lines, the request id on every line, no prompts.

The request id lives in a :class:`contextvars.ContextVar`. aiohttp runs every request
handler in its own task, so :func:`set_request_id` at the top of a handler tags every
line logged while that request is served (and by tasks it spawns), and nothing else.

Contracts:
- no per-request line at INFO: aiohttp's access log is raised to WARNING; the gateway
  should also pass ``access_log=None`` to its ``AppRunner``;
- prompts are never logged: ``extra`` fields named like request content (``messages``,
  ``prompt``, ``text``, ``input_ids``, ``body``...) are replaced by ``"[redacted]"``.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from typing import IO, Any

import orjson

from gateway.errors import one_line

# A context variable is per-task storage, not shared mutable state.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "gateway_request_id", default=None
)
REDACTED = "[redacted]"
PROMPT_FIELDS = frozenset(
    {"messages", "prompt", "text", "input_ids", "body", "content", "tools", "prompt_text"}
)
_HANDLER_NAME = "gateway-log-handler"
# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD_ATTRS = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()
    | {"message", "asctime", "request_id", "taskName"}
)
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def set_request_id(request_id: str | None) -> contextvars.Token[str | None]:
    """Tag log lines of the current task (and tasks it creates) with ``request_id``."""
    return REQUEST_ID.set(request_id)


def reset_request_id(token: contextvars.Token[str | None]) -> None:
    """Undo a :func:`set_request_id`."""
    REQUEST_ID.reset(token)


def current_request_id() -> str | None:
    """The request id bound to the current context, if any."""
    return REQUEST_ID.get()


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (``"-"`` outside a request) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get() or "-"
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.__dict__.items():
        if key in _STANDARD_ATTRS or key.startswith("_"):
            continue
        out[key] = REDACTED if key in PROMPT_FIELDS else value
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, extras."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None) or REQUEST_ID.get(),
        }
        doc.update(_extras(record))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class PlainFormatter(logging.Formatter):
    """Human-readable lines; extras appended as ``key=value`` (prompt fields redacted)."""

    def __init__(self) -> None:
        super().__init__(PLAIN_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        # one record, one line: a CR or LF from a client (a path, a model name) or a
        # worker would forge a line of its own; a traceback is appended after this
        return one_line(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={one_line(str(v))}" for k, v in extras.items())
        return line


def setup_logging(
    level: str | int = "INFO", *, json: bool = False, stream: IO[str] | None = None
) -> logging.Handler:
    """Configure the root logger once; calling again replaces the handler it installed.

    Returns the installed handler (tests read from its stream).
    """
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if json else PlainFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return handler
