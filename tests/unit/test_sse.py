"""gateway.forward.sse against the WHATWG event-stream rules (HTML §9.2.6): line ends,
fields, comments, dispatch, the last event, the bound; and feeding in any split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.forward.sse import Event, EventFramer, EventTooLarge, parse


def frame_all(pieces: list[bytes], bound: int = 1 << 20) -> bytes:
    framer = EventFramer(bound)
    return b"".join(framer.feed(p) for p in pieces) + framer.end()


@pytest.mark.parametrize("end", [b"\r\n", b"\r", b"\n"], ids=["crlf", "cr", "lf"])
def test_every_line_end_ends_lines_and_events(end: bytes) -> None:
    stream = b"data: a" + end + b"data: b" + end + end + b"data: [DONE]" + end + end
    framer = EventFramer(1024)
    out = framer.feed(stream)
    assert out == b"data: a\ndata: b\n\ndata: [DONE]\n\n"
    assert parse(out) == [Event("a\nb"), Event("[DONE]")]
    assert framer.done


def test_crlf_split_between_cr_and_lf_is_one_line_end() -> None:
    framer = EventFramer(1024)
    assert framer.feed(b"data: a\r\n\r") == b"data: a\n\n"
    assert framer.feed(b"\ndata: b\r\n\r\n") == b"data: b\n\n"  # the LF closed the CR
    assert parse(b"data: a\n\ndata: b\n\n") == [Event("a"), Event("b")]


def test_an_empty_read_between_cr_and_lf_keeps_them_one_line_end() -> None:
    """Found by the split property test: an empty piece between a CR and its LF made the
    LF a second line end (a blank line: the event was cut in two)."""
    stream = [b"data: a\r", b"", b"\ndata: b\n\n"]
    assert parse(frame_all(stream)) == [Event("a\nb")]


def test_partial_event_waits_for_its_blank_line() -> None:
    framer = EventFramer(1024)
    assert framer.feed(b"data: [DO") == b""
    assert not framer.done
    assert framer.feed(b"NE]\n") == b""
    assert framer.feed(b"\n") == b"data: [DONE]\n\n"
    assert framer.done


def test_fields_comments_and_defaults() -> None:
    stream = (
        b": a comment, ignored\n"
        b"event: add\n"
        b"id: 7\n"
        b"retry: 3000\n"
        b"data:no space\n"
        b"data:  two spaces\n"
        b"data\n"
        b"unknown: field\n"
        b"\n"
        b"id: bad\x00id\n"
        b"retry: 12x\n"
        b"data: second\n"
        b"\n"
        b"event: empty\n"
        b"\n"
    )
    assert parse(stream) == [
        Event("no space\n two spaces\n", "add", "7", 3000),
        Event("second", "message", "7", None),  # the last id stays; the NUL one is ignored
    ]


def test_leading_bom_is_ignored() -> None:
    assert parse(b"\xef\xbb\xbfdata: x\n\n") == [Event("x")]


def test_done_needs_exact_data() -> None:
    for stream, done in [
        (b"data: [DONE]\n\n", True),
        (b"data:[DONE]\n\n", True),
        (b'data: {"text":"[DONE]"}\n\n', False),
        (b"data: [DONE] \n\n", False),
        (b": [DONE]\n\n", False),
    ]:
        framer = EventFramer(1024)
        framer.feed(stream)
        assert framer.done is done, stream


def test_last_event_without_blank_line_is_terminated_at_the_end() -> None:
    for tail in (b"data: [DONE]", b"data: [DONE]\n", b"data: [DONE]\r"):
        framer = EventFramer(1024)
        assert framer.feed(b"data: a\n\n" + tail) == b"data: a\n\n"
        assert framer.end() == b"data: [DONE]\n\n"
        assert framer.done
    assert EventFramer(1024).end() == b""


def test_event_over_the_bound_while_pending_releases_it() -> None:
    framer = EventFramer(100)
    assert framer.feed(b"data: " + b"x" * 90) == b""
    with pytest.raises(EventTooLarge):
        framer.feed(b"x" * 20)
    assert len(framer._pending) == 0  # nothing held beyond the bound


def test_event_over_the_bound_in_one_piece_is_refused_after_the_ones_before() -> None:
    framer = EventFramer(100)
    ok = b"data: ok\n\n"
    assert framer.feed(ok + b"data: " + b"x" * 200 + b"\n\n" + ok) == ok
    with pytest.raises(EventTooLarge):
        framer.feed(ok)


def test_pending_grows_linearly_when_fed_a_byte_at_a_time() -> None:
    framer = EventFramer(1 << 20)
    event = b"data: " + b"y" * 50_000 + b"\n\n"
    out = b"".join(framer.feed(event[i : i + 1]) for i in range(len(event)))
    assert out == event


LINE_END = st.sampled_from([b"\n", b"\r", b"\r\n"])
VALUE = st.text(st.characters(blacklist_characters="\r\n\x00", codec="utf-8"), max_size=20)


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[Event]]:
    """An event stream with random line ends, and the events it holds."""
    out: list[bytes] = []
    events: list[Event] = []

    def end() -> bytes:
        # an LF right after a CR would join it into one CRLF: make it a line end of its own
        cut = draw(LINE_END)
        return b"\r\n" if cut == b"\n" and out and out[-1].endswith(b"\r") else cut

    for _ in range(draw(st.integers(0, 5))):
        lines = draw(st.lists(VALUE, min_size=1, max_size=3))
        for line in lines:
            out.append(b"data: " + line.encode())
            out.append(end())
            if draw(st.booleans()):
                out += [b": comment"]
                out.append(end())
        out.append(end())
        events.append(Event("\n".join(lines)))
    return b"".join(out), events


@given(streams(), st.data())
def test_any_split_of_any_stream_gives_its_events(
    sample: tuple[bytes, list[Event]], data: st.DataObject
) -> None:
    stream, events = sample
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert parse(frame_all(pieces)) == events
