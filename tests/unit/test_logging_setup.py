"""Structured logging: JSON option, request id on every line, prompts redacted."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterator

import orjson
import pytest

from gateway.telemetry.hub import _CURRENT, Telemetry
from gateway.telemetry.logs import (
    REDACTED,
    REQUEST_ID,
    current_request_id,
    reset_request_id,
    set_request_id,
    setup_logging,
)


@pytest.fixture(autouse=True)
def _fresh_request_context() -> Iterator[None]:
    """begin_request binds the request to the caller's context: undo it after a test."""
    rid = REQUEST_ID.set(None)
    current = _CURRENT.set(None)
    yield
    _CURRENT.reset(current)
    REQUEST_ID.reset(rid)


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)
        h.close()
    root.setLevel(level)


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = setup_logging("DEBUG", json=True, stream=buf)
    yield buf
    root.removeHandler(handler)
    handler.close()
    root.setLevel(level)


def lines(buf: io.StringIO) -> list[dict[str, object]]:
    docs = [orjson.loads(x) for x in buf.getvalue().splitlines() if x]
    return [d for d in docs if d["logger"] == "gateway.test"]


async def test_request_id_on_every_line_of_its_task_only(stream: io.StringIO) -> None:
    log = logging.getLogger("gateway.test")

    async def handle(rid: str) -> None:
        set_request_id(rid)
        log.info("start")
        await asyncio.sleep(0)
        log.warning("middle")
        await asyncio.sleep(0)
        log.error("end")

    await asyncio.gather(handle("a"), handle("b"))
    log.info("outside")
    got = lines(stream)
    assert sorted(str(d["request_id"]) for d in got[:-1]) == ["a", "a", "a", "b", "b", "b"]
    for d in got[:-1]:
        assert {"time", "level", "logger", "message"} <= d.keys()
    assert got[-1]["request_id"] == "-"


def test_begin_request_binds_the_request_id(stream: io.StringIO) -> None:
    t = Telemetry()
    token = set_request_id(None)
    try:
        t.begin_request("rid-42", "/generate").finish(200)
        logging.getLogger("gateway.test").warning("after")
        assert current_request_id() == "rid-42"
        assert lines(stream)[-1]["request_id"] == "rid-42"
    finally:
        reset_request_id(token)
        t.shutdown()


@pytest.mark.parametrize("json", [True, False])
def test_prompt_fields_are_redacted(json: bool) -> None:
    buf = io.StringIO()
    handler = setup_logging("INFO", json=json, stream=buf)
    try:
        secret = "my secret system prompt"
        logging.getLogger("gateway.test").error(
            "bad request",
            extra={"messages": [{"content": secret}], "prompt": secret, "status": 400},
        )
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    out = buf.getvalue()
    assert secret not in out
    assert REDACTED in out
    assert "400" in out


def test_no_access_log_line_at_info(stream: io.StringIO) -> None:
    logging.getLogger("aiohttp.access").info('127.0.0.1 "POST /v1/chat/completions" 200')
    assert stream.getvalue() == ""


def test_setup_twice_keeps_one_handler() -> None:
    root = logging.getLogger()
    before = len(root.handlers)
    h1 = setup_logging("INFO", stream=io.StringIO())
    h2 = setup_logging("WARNING", stream=io.StringIO())
    assert len(root.handlers) == before + 1
    assert h1 not in root.handlers
    root.removeHandler(h2)
    h2.close()
    root.setLevel(logging.WARNING)


def test_plain_format_carries_request_id() -> None:
    buf = io.StringIO()
    handler = setup_logging("INFO", stream=buf)
    token = set_request_id("plain-1")
    try:
        logging.getLogger("gateway.test").warning("worker %s ejected", "w1")
    finally:
        reset_request_id(token)
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert "[plain-1] worker w1 ejected" in buf.getvalue()


def test_a_plain_line_cannot_be_forged() -> None:
    """What a client sends (a percent-decoded path, a model name) lands in log messages:
    in the plain format a CR, LF, NUL or line separator in it is escaped, so one record
    stays one line; a traceback still follows on lines of its own."""
    buf = io.StringIO()
    setup_logging("INFO", json=False, stream=buf)
    log = logging.getLogger("gateway.test")
    log.info("no route for %s", "/v1/x\r\n2026-01-01 INFO forged\x00 \u2028 é", extra={"k": "a\nb"})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    text = buf.getvalue().splitlines()
    assert not any(line.startswith("2026-01-01") for line in text)  # nothing forged
    assert text[0].endswith(
        "no route for /v1/x\\x0d\\x0a2026-01-01 INFO forged\\x00 \\u2028 é k=a\\x0ab"
    )
    assert text[1].endswith("failed") and text[2] == "Traceback (most recent call last):"
    assert text[-1] == "ValueError: boom"
