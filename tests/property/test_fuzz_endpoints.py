"""Bad input fuzzing (hypothesis) of every endpoint's body, over real HTTP.

One simulated worker and one gateway run on a private event loop in a thread for the
module; each example is sent with ``http.client`` as exact bytes (so invalid UTF-8,
duplicate keys, NaN and wrong content types reach the gateway unchanged). The property:
never a 5xx, never a dropped connection; every 4xx the gateway makes is an OpenAI-style
JSON error; and the gateway still answers ``/health`` at the end. Example counts are
modest (the machine is shared); each test prints how many cases it tried.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtests.harness.inprocess import BackgroundGateway

MAX_BODY = 64 * 1024
POST_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/embeddings",
    "/workers",
    "/add_worker",
    "/remove_worker",
    "/workers/nope/drain",
)
GET_PATHS = ("/v1/models", "/health", "/readiness", "/workers", "/list_workers", "/metrics")
CONTENT_TYPES = (
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "",
)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


class LiveGateway(BackgroundGateway):
    """The background gateway, sending exact bytes and counting what it sent."""

    def __init__(self) -> None:
        super().__init__(
            server__max_payload_size=MAX_BODY,
            server__worker_allowlist=["allowed.invalid"],  # fuzzed adds never register
        )
        self.tried = 0

    def send(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        self.tried += 1
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[LiveGateway]:
    with LiveGateway() as gw:
        yield gw
        status, _ = gw.send("GET", "/health", b"", {})
        assert status == 200, "the gateway stopped answering after the fuzzing"
        print(f"\nfuzzing: {gw.tried} requests sent to the gateway in this module")


def check(status: int, body: bytes, *, gateway_made: bool) -> None:
    assert status < 500, (status, body[:300])
    if status >= 400:
        doc: Any = json.loads(body)
        assert isinstance(doc, dict)
        if gateway_made:
            err = doc["error"]
            assert err["code"] == status and isinstance(err["message"], str) and err["type"]
        else:  # a worker's own 4xx, relayed as is
            assert "error" in doc or "message" in doc or "detail" in doc


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = (
    "model",
    "messages",
    "prompt",
    "text",
    "input",
    "input_ids",
    "stream",
    "max_tokens",
    "stream_options",
    "rid",
    "url",
    "temperature",
    "n",
    "user",
    "tools",
)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> bytes:
    """A plausible request object whose known fields hold arbitrary JSON values."""
    obj = {f: draw(json_value) for f in draw(st.lists(st.sampled_from(FIELDS), max_size=5))}
    return json.dumps(obj).encode()


SPECIAL = st.sampled_from(
    [
        b"",
        b" ",
        b"null",
        b"[]",
        b'"x"',
        b"{",
        b'{"messages": NaN}',
        b'{"model": "m", "prompt": Infinity}',
        b'{"model":"m","model":1,"prompt":"a","prompt":[]}',
        b'{"messages":[{"role":"user","content":"\xff\xfe"}]}',
        b'{"prompt":"\xed\xa0\x80"}',
        b"\xef\xbb\xbf{}",
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 2000 + b"1" + b"}" * 2000,
        b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}',
        b'{"messages": [' + b'{"role":"user","content":"hi"},' * 10 + b"1]}",
        b'{"text": "hi", "max_tokens": 1e400}',
        b'{"input_ids": [1, 2, -1, 99999999999999999999]}',
        b'{"url": "http://127.0.0.1"}',
        b'{"url": "file:///etc/passwd"}',
        b'{"url": 5}',
    ]
)
bodies = (
    SPECIAL
    | mutated_bodies()
    | st.binary(max_size=300)
    | json_value.map(lambda v: json.dumps(v).encode())
)


@FUZZ
@given(
    path=st.sampled_from(POST_PATHS),
    body=bodies,
    ctype=st.sampled_from(CONTENT_TYPES),
)
def test_post_bodies_never_5xx(gateway: LiveGateway, path: str, body: bytes, ctype: str) -> None:
    headers = {"Content-Type": ctype} if ctype else {}
    status, answer = gateway.send("POST", path, body, headers)
    check(
        status,
        answer,
        gateway_made=status in (401, 403, 404, 405, 413, 415)
        or (status == 400 and not answer.startswith(b'{"object"')),
    )


@FUZZ
@given(
    path=st.sampled_from(GET_PATHS + POST_PATHS),
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    query=st.text(max_size=30),
)
def test_methods_and_queries_never_5xx(
    gateway: LiveGateway, path: str, method: str, query: str
) -> None:
    from urllib.parse import quote

    target = path + ("?url=" + quote(query) if query else "")
    if method == "DELETE" and path.startswith("/workers"):
        target = "/workers/" + quote(query or "unknown", safe="")
    status, answer = gateway.send(method, target, b"", {})
    check(status, answer, gateway_made=status >= 400)
