"""The relay's fast paths give what the general ones give: the [DONE] byte test against
the SSE parser, the cut after [DONE], and the stall ticker shared by every stream."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.forward import relay
from gateway.forward.sse import EventFramer, ends_with_done, parse

CASES = [
    (b"data: [DONE]\n\n", True),
    (b"data:[DONE]\n\n", True),
    (b'data: {"a":1}\n\ndata: [DONE]\n\n', True),
    (b'data: {"a":1}\n\n\ndata: [DONE]\n\n', True),
    # [DONE] as one line of a longer event's data: not the end
    (b'data: {"a":1}\ndata: [DONE]\n\n', False),
    (b"id: 7\ndata: [DONE]\n\n", True),  # another field: data is still [DONE]
    (b": comment\ndata: [DONE]\n\n", True),
    (b"data:  [DONE]\n\n", False),  # two spaces: the data is " [DONE]"
    (b'data: {"text":"[DONE]"}\n\n', False),
    (b"\xef\xbb\xbfdata: [DONE]\n\n", True),  # a leading BOM
    (b"data: [DONE]\n\ndata: late\n\n", True),
    (b"event: done\ndata: [DONE]\n\n", True),
]


def _parsed_done(events: bytes) -> bool:
    return any(e.data == "[DONE]" for e in parse(events))


@pytest.mark.parametrize(("events", "done"), CASES)
def test_done_byte_test_never_says_more_than_the_parser(events: bytes, done: bool) -> None:
    assert _parsed_done(events) is done
    if ends_with_done(events):  # a True is always right; a False defers to the parser
        assert done


@pytest.mark.parametrize(("events", "done"), CASES)
def test_framer_done_as_the_parser_says(events: bytes, done: bool) -> None:
    framer = EventFramer(1 << 20)
    assert framer.feed(events) == events
    assert framer.done is done


def _through_done_slow(events: bytes) -> bytes:
    end = 0
    for part in events.split(b"\n\n"):
        end += len(part) + 2
        if b"[DONE]" in part and _parsed_done(part + b"\n\n"):
            return events[:end]
    return events


@pytest.mark.parametrize(
    "events",
    [events for events, _ in CASES]
    + [
        b'data: {"t":"[DONE]"}\n\ndata: [DONE]\n\n',
        b"data: [DONE]\n\ndata: [DONE]\n\n",
        b'data: {"a":1}\n\ndata: [DONE]\n\ndata: {"late":2}\n\n',
    ],
)
def test_cut_after_done_is_the_general_one(events: bytes) -> None:
    assert relay._through_done(events) == _through_done_slow(events)


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Request:
    def __init__(self) -> None:
        self.transport = _Transport()


def _watch(limit_s: float) -> tuple[relay._WriteWatch, _Request]:
    request = _Request()
    fake: Any = request
    return relay._WriteWatch(fake, limit_s), request


def _tick(ticker: Any) -> None:
    """One check now (the scheduled one, 15 s away with a 60 s limit, is replaced)."""
    if ticker._timer is not None:
        ticker._timer.cancel()
    ticker._tick()


def _armed(ticker: Any) -> bool:
    return ticker._timer is not None


async def test_one_ticker_cuts_only_the_stalled_write_and_stops_when_idle() -> None:
    loop = asyncio.get_running_loop()
    stalled, stalled_req = _watch(60.0)
    moving, moving_req = _watch(60.0)
    idle, idle_req = _watch(60.0)
    ticker = stalled._ticker
    assert ticker is not None and moving._ticker is ticker and idle._ticker is ticker
    stalled.since = loop.time() - 61.0  # a write pending for longer than the limit
    moving.since = loop.time() - 1.0  # one pending for less
    _tick(ticker)
    assert stalled_req.transport.aborted
    assert not moving_req.transport.aborted and not idle_req.transport.aborted
    assert _armed(ticker)  # two streams still watched
    for watch in (stalled, moving, idle):
        watch.stop()
    _tick(ticker)  # nothing left to watch: the timer stops, the ticker is dropped
    assert not _armed(ticker) and not ticker.members
    again, _ = _watch(60.0)
    fresh = again._ticker
    assert fresh is not None and fresh is not ticker and _armed(fresh)
    again.stop()
    _tick(fresh)
    assert not _armed(fresh)


async def test_no_limit_no_ticker() -> None:
    watch, _ = _watch(0.0)
    assert watch._ticker is None
    watch.stop()
