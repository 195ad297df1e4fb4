"""A hostile worker's ``kv_events`` descriptor must not aim the gateway's ZMQ sockets at
another host (docs/SECURITY.md).

The gateway connects a SUB (and a replay DEALER) per rank to the descriptor's
``endpoint_host``. Before, any host a worker named was connected to, bypassing the
allow-list that guards worker URLs (``server.worker_allowlist``): a worker could make the
gateway open connections to the cloud metadata address or any public host. Now the host
(wildcard substituted) must be the worker URL's own or pass that allow-list; otherwise
the worker is not followed and its reason says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
import test_exact_hostile
from aiohttp.test_utils import TestServer

from gateway.config import KVEventsConfig
from gateway.config.allowlist import DEFAULT_ALLOWED, HostAllowList
from gateway.exact.manager import FollowedWorker, KVEventsManager
from gateway.exact.wire import Descriptor, same_host
from simulator.model.tokenizer import default_tokenizer

REFUSED = "is not the worker's host and not allowed"


@pytest.mark.parametrize(
    ("host", "url", "same"),
    [
        ("127.0.0.1", "http://127.0.0.1:30000", True),  # SGLang bound to 127.0.0.1
        ("127.0.0.1", "http://localhost:30000", True),  # both this machine
        ("LOCALHOST.", "http://127.0.0.2:1", True),
        ("::1", "http://[::1]:30000", True),
        ("::ffff:127.0.0.1", "http://localhost:1", True),
        ("Worker-1.internal", "http://worker-1.internal:30000", True),
        ("10.0.0.5", "http://10.0.0.5:30000", True),
        ("10.0.0.6", "http://10.0.0.5:30000", False),
        ("169.254.169.254", "http://127.0.0.1:30000", False),
        ("10.0.0.5", "http://worker-1.internal:30000", False),  # nothing is resolved
        ("localhost", "http://10.0.0.5:30000", False),  # the gateway's machine, not the worker's
    ],
)
def test_same_host(host: str, url: str, same: bool) -> None:
    assert same_host(host, url) is same


@pytest.mark.parametrize("wildcard", ["*", "0.0.0.0", "::", ""])
def test_a_wildcard_is_the_worker_host(wildcard: str) -> None:
    raw = {"publisher": "zmq", "endpoint_host": wildcard, "endpoint_port_base": 5557}
    desc = Descriptor.parse(raw, "http://10.0.0.5:30000")
    assert desc is not None and same_host(desc.host, "http://10.0.0.5:30000")


info_server = test_exact_hostile.info_server  # /<worker>/server_info, editable


def _kv(host: str) -> dict[str, Any]:
    return {
        "publisher": "zmq", "endpoint_host": host, "endpoint_port_base": 5557,
        "replay_endpoint_port_base": 6557, "block_size": 16, "dp_size": 2,
    }  # fmt: skip


async def _resolve(host: str) -> Sequence[str]:
    return {"cache.internal": ["10.1.1.1"], "evil.example": ["10.1.1.2", "93.184.216.34"]}.get(
        host, []
    )


async def _discover(
    server: TestServer, allowlist: HostAllowList | None
) -> tuple[dict[str, tuple[str, str]], int]:
    """Each worker's (mode, reason) after one discovery, and the feeds opened."""
    async with aiohttp.ClientSession() as session:
        workers = [FollowedWorker(w, str(server.make_url(f"/{w}"))) for w in _INFOS]
        mgr = KVEventsManager(
            KVEventsConfig(replay_timeout_s=0.05),
            default_tokenizer(),
            lambda: workers,
            session,
            allowlist=allowlist,
        )
        try:
            await mgr.discover()
            seen = {w: (mgr.mode(w), mgr.reason(w)) for w in _INFOS}
            return seen, sum(len(s.feeds) for s in mgr._states.values())
        finally:
            await mgr.close()


_INFOS = {
    "wildcard": {"kv_events": _kv("*")},
    "loopback": {"kv_events": _kv("127.0.0.1")},  # the worker URL's own host
    "localhost": {"kv_events": _kv("localhost")},
    "metadata": {"kv_events": _kv("169.254.169.254")},
    "public": {"kv_events": _kv("93.184.216.34")},
    "private": {"kv_events": _kv("10.9.9.9")},  # another host, inside the default list
    "named": {"kv_events": _kv("cache.internal")},  # resolves inside the list
    "rebinding": {"kv_events": _kv("evil.example")},  # one address outside
}


async def test_events_are_read_only_where_the_worker_is(
    info_server: tuple[TestServer, dict[str, Any]],
) -> None:
    server, infos = info_server
    infos.update(_INFOS)
    seen, feeds = await _discover(server, HostAllowList(DEFAULT_ALLOWED, _resolve))
    followed = {w for w, (mode, _) in seen.items() if mode == "exact"}
    assert followed == {"wildcard", "loopback", "localhost", "private", "named"}
    assert feeds == 2 * len(followed)  # dp_size 2: no socket for a refused worker
    for wid in ("metadata", "public", "rebinding"):
        mode, reason = seen[wid]
        assert mode == "approximate" and REFUSED in reason, wid
    assert "'169.254.169.254'" in seen["metadata"][1]
    assert "following its KV events (tcp://10.9.9.9:5557" in seen["private"][1]


async def test_without_an_allowlist_only_the_worker_host(
    info_server: tuple[TestServer, dict[str, Any]],
) -> None:
    server, infos = info_server
    infos.update(_INFOS)
    seen, _ = await _discover(server, None)
    followed = {w for w, (mode, _) in seen.items() if mode == "exact"}
    assert followed == {"wildcard", "loopback", "localhost"}


async def test_a_descriptor_that_moves_elsewhere_is_dropped(
    info_server: tuple[TestServer, dict[str, Any]],
) -> None:
    server, infos = info_server
    infos["w"] = {"kv_events": _kv("*")}
    url = str(server.make_url("/w"))
    async with aiohttp.ClientSession() as session:
        workers = [FollowedWorker("w", url)]
        mgr = KVEventsManager(KVEventsConfig(), default_tokenizer(), lambda: workers, session)
        try:
            await mgr.discover()
            assert mgr.mode("w") == "exact"
            infos["w"] = {"kv_events": _kv("169.254.169.254"), "startup_time": 2}
            await mgr.discover()
            assert mgr.mode("w") == "approximate" and REFUSED in mgr.reason("w")
            assert not mgr._states["w"].feeds
        finally:
            await mgr.close()
