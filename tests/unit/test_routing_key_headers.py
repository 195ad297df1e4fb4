"""Session keys from the headers the ecosystem sends (issue 22): each default header sets
the routing key, the first present (and non-empty) wins in the configured order, and the
configuration's default, the parser's default and config/gateway.yaml agree."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import orjson
import pytest
import yaml
from multidict import CIMultiDict

from gateway.config import ROUTING_KEY_HEADERS, GatewayConfig, config_from_dict
from gateway.routing.request import ApiKind, RequestSettings, parse_request

BODY = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "user": "the-user"})
DOC = Path(__file__).resolve().parents[2] / "config" / "gateway.yaml"

# What each source reads or sends (docs: config/gateway.yaml, README "Session keys")
EXPECTED = {
    "x-session-id",  # llm-d session-affinity default; OpenCode (Dynamo)
    "x-smg-routing-key",  # SGLang Model Gateway
    "x-dynamo-session-id",  # Dynamo
    "x-session-affinity",  # aiperf's default; OpenCode (llm-d)
    "x-claude-code-session-id",  # Claude Code (Dynamo, llm-d)
    "thread-id",  # Codex (Dynamo)
    "session-id",  # Codex (llm-d)
    "x-deepseek-harness-session-id",  # DeepSeek harness (Dynamo)
}


def _key(headers: dict[str, str], settings: RequestSettings | None = None) -> str | None:
    return parse_request(
        ApiKind.CHAT, BODY, CIMultiDict(headers), settings or RequestSettings()
    ).routing_key


def test_the_defaults_are_the_ecosystems_headers_in_one_place() -> None:
    assert set(ROUTING_KEY_HEADERS) == EXPECTED
    assert len(ROUTING_KEY_HEADERS) == len(EXPECTED)  # no duplicates
    assert ROUTING_KEY_HEADERS[:2] == ("x-session-id", "x-smg-routing-key")  # order kept
    assert all(h == h.lower() for h in ROUTING_KEY_HEADERS)
    assert RequestSettings().routing_key_headers == ROUTING_KEY_HEADERS
    assert GatewayConfig().request.routing_key_headers == ROUTING_KEY_HEADERS
    documented = yaml.safe_load(DOC.read_text())["request"]["routing_key_headers"]
    assert tuple(documented) == ROUTING_KEY_HEADERS


@pytest.mark.parametrize("header", ROUTING_KEY_HEADERS)
def test_each_default_header_sets_the_routing_key(header: str) -> None:
    assert _key({header: "s-42"}) == "s-42"
    assert _key({header.upper(): "S-43"}) == "S-43"  # header names are case-insensitive
    assert _key({header: ""}) == "the-user"  # empty: not a key, the next source is read
    assert _key({}) == "the-user"


def test_the_first_present_wins_in_the_configured_order() -> None:
    for i, j in combinations(range(len(ROUTING_KEY_HEADERS)), 2):
        earlier, later = ROUTING_KEY_HEADERS[i], ROUTING_KEY_HEADERS[j]
        assert _key({later: "later", earlier: "earlier"}) == "earlier", (earlier, later)
    reversed_order = RequestSettings(routing_key_headers=ROUTING_KEY_HEADERS[::-1])
    both = {"x-session-id": "generic", "x-session-affinity": "aiperf"}
    assert _key(both) == "generic"
    assert _key(both, reversed_order) == "aiperf"


def test_a_configured_list_replaces_the_defaults() -> None:
    cfg = config_from_dict({"request": {"routing_key_headers": ["x-tenant", "x-session-id"]}})
    assert cfg.request.routing_key_headers == ("x-tenant", "x-session-id")
    settings = RequestSettings(routing_key_headers=cfg.request.routing_key_headers)
    assert _key({"x-session-affinity": "a", "x-tenant": "t"}, settings) == "t"
    assert _key({"x-session-affinity": "a"}, settings) == "the-user"  # no longer read
