"""Server-sent events as the WHATWG HTML standard reads them (§9.2.6, "Interpreting an event
stream"), incrementally and bounded, for the relay.

Why our own: the relay needs whole events as *bytes* to pass through (it never rebuilds
an event, so usage chunks, ids and comments reach the client as the worker wrote them),
plus where each event ends and whether ``data: [DONE]`` came; the maintained SSE
libraries (sse-starlette, httpx-sse, aiohttp-sse-client) produce decoded event objects
for an application and cost a Python object per field. This module is small and its
spec cases are tested (``tests/unit/test_sse.py``, ``tests/property/``).

Contract:
- :class:`EventFramer` is fed the body bytes of one stream (:meth:`~EventFramer.feed`) and
  returns the whole events they complete, line ends normalised to LF (CRLF, CR and LF all
  end a line; a CR at the end of one piece and an LF at the start of the next are one line
  end), or ``b""``. Bytes after the last blank line wait for the rest of their event.
  The common case (no CR, nothing pending, ends in a blank line) is the input itself.
- :meth:`~EventFramer.end` is called at the clean end of the body: a last event without
  its blank line is returned terminated (the worker's end of body ends it; a browser's
  EventSource would drop it, but the gateway's clients are programs that read the last
  event, usually ``[DONE]``). After a broken body it is not called: the partial event is
  dropped, as the standard says.
- ``done`` turns true once an event whose data is exactly ``[DONE]`` (OpenAI's and
  SGLang's end of stream) was returned.
- At most ``max_event_bytes`` wait for an event's end; one byte more raises
  :class:`EventTooLarge` and the held bytes are released (nothing beyond the bound). An
  event over the bound that came whole in one piece is refused too: the events before
  it are returned, the error is raised by the next call.
- :func:`parse` interprets whole, LF-normalised events (fields ``data``, ``event``, ``id``,
  ``retry``; comments; a field name alone; one space after the colon removed; a leading
  BOM) into :class:`Event` values: used for ``[DONE]`` and by tests.

Cost: the common case is two ``bytes`` scans (``\\r`` and the ending); otherwise one copy of
the new bytes into the pending buffer plus a search from where the last one stopped, so an
event arriving a byte at a time costs O(its length), not O(its length squared).
"""

from __future__ import annotations

from dataclasses import dataclass

_BLANK = b"\n\n"
_DONE_MARK = b"[DONE]"
_DONE_EVENTS = (b"data: [DONE]\n\n", b"data:[DONE]\n\n")
_BOM = "\ufeff"


class EventTooLarge(Exception):
    """An event grew past the per-stream bound before its end arrived."""


@dataclass(frozen=True, slots=True)
class Event:
    data: str
    type: str = "message"
    id: str | None = None  # the last event id in force when it was dispatched
    retry: int | None = None  # a reconnection time set by this event's fields


class EventFramer:
    __slots__ = ("_after_cr", "_max", "_pending", "_too_large", "done")

    def __init__(self, max_event_bytes: int) -> None:
        self._max = max_event_bytes
        self._pending = bytearray()
        self._after_cr = False  # the last piece ended in CR: a leading LF belongs to it
        self._too_large: EventTooLarge | None = None  # raised at the next call
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """The whole events ``data`` completes (LF line ends), or ``b""``."""
        if self._too_large is not None:
            raise self._too_large
        if not data:  # nothing read: a CR that ended the last piece still waits for its LF
            return b""
        if self._after_cr:
            self._after_cr = False
            if data[:1] == b"\n":
                data = data[1:]
        if b"\r" in data:
            self._after_cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        pending = self._pending
        if not pending and data.endswith(_BLANK):  # the common case: whole events, no copy
            return self._emit(data)
        start = max(0, len(pending) - 1)  # a blank line may straddle the old end
        pending += data
        end = pending.rfind(_BLANK, start)
        if end < 0:
            self._check_bound()
            return b""
        out = bytes(pending[: end + 2])
        del pending[: end + 2]
        self._check_bound()
        return self._emit(out)

    def end(self) -> bytes:
        """At the clean end of the body: the last event, terminated, if one is pending."""
        if self._too_large is not None:
            raise self._too_large
        pending, self._pending = self._pending, bytearray()
        if not pending.strip(b"\n"):
            return b""
        tail = bytes(pending) + (b"\n" if pending.endswith(b"\n") else _BLANK)
        return self._emit(tail)

    def _check_bound(self) -> None:
        if len(self._pending) > self._max:
            self._pending = bytearray()
            raise EventTooLarge(f"an event exceeds {self._max} bytes")

    def _emit(self, events: bytes) -> bytes:
        if len(events) > self._max:  # whole events that came in one piece obey it too
            events = self._within_bound(events)
        if not self.done and _DONE_MARK in events:
            self.done = ends_with_done(events) or any(e.data == "[DONE]" for e in parse(events))
        return events

    def _within_bound(self, events: bytes) -> bytes:
        """The events before the first one over the bound; that one is reported at the
        next call (so the client gets every event before it)."""
        parts = events.split(_BLANK)
        for index, part in enumerate(parts):
            if len(part) > self._max:
                self._too_large = EventTooLarge(f"an event exceeds {self._max} bytes")
                return b"".join(p + _BLANK for p in parts[:index])
        return events


def ends_with_done(events: bytes) -> bool:
    """Whole, LF-normalised ``events`` (from an event's start) end with an event that is
    the one line ``data: [DONE]`` (or ``data:[DONE]``), alone or after a blank line: the
    common end of a stream, found without decoding anything. False says nothing
    (:func:`parse` decides)."""
    for last in _DONE_EVENTS:
        if events.endswith(last):
            size = len(last)
            return len(events) == size or events[-size - 2 : -size] == _BLANK
    return False


def parse(events: bytes) -> list[Event]:
    """Whole, LF-normalised events → :class:`Event` values (see the module contract)."""
    text = events.decode("utf-8", "replace")
    if text.startswith(_BOM):
        text = text[1:]
    out: list[Event] = []
    data: list[str] = []
    kind = ""
    last_id: str | None = None
    retry: int | None = None
    for line in text.split("\n"):
        if not line:  # dispatch
            if data:
                out.append(Event("\n".join(data), kind or "message", last_id, retry))
            data, kind, retry = [], "", None
            continue
        if line.startswith(":"):
            continue  # a comment
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            kind = value
        elif name == "id":
            if "\x00" not in value:
                last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            retry = int(value)
    return out
