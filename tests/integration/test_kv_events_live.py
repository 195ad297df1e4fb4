"""Exact mode live: simulated workers publish KV events, the gateway's manager follows them.

Capacity pressure makes a worker evict a prompt: the exact index stops predicting the hit
(and the worker confirms it cached nothing) while the approximate index still predicts
it. Stopping a worker's publisher turns it ``degraded`` after a dispatch; restarting the
worker brings it back to ``exact``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from gateway.exact.manager import (
    MODE_DEGRADED,
    MODE_EXACT,
    FollowedWorker,
    KVEventsManager,
    KVEventsSettings,
)
from gateway.exact.tokenizer import Tokenizer, load_tokenizer
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RequestSettings, parse_request
from loadtests.harness.inprocess import SIM_TOKENIZER
from simulator.fleet import SimConfig, SimulatedFleet, SimulatedWorker

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*",'
    '"replay_endpoint":"tcp://127.0.0.1:*","topic":"kv"}'
)
NS0 = (None, None, None)


@pytest.fixture
async def kv_fleet() -> AsyncIterator[SimulatedFleet]:
    config = SimConfig(speed=50.0, page_size=16, capacity_tokens=6000, kv_events_config=KV_CONFIG)
    async with await SimulatedFleet.start(2, config) as fleet:
        yield fleet


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def _text(doc: int, words: int) -> str:
    return " ".join(f"d{doc}w{i}" for i in range(words))


async def _until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


class _Client:
    """Sends /generate to a worker, recording in both indexes as the router would."""

    def __init__(self, session: aiohttp.ClientSession, mgr: KVEventsManager) -> None:
        self.session, self.mgr = session, mgr
        self.approx = PrefixIndex()
        self.settings = RequestSettings()

    def _tokenizer(self, wid: str) -> Tokenizer:
        tok = self.mgr.tokenizer_for(wid)
        assert tok is not None, f"{wid} is not followed"
        return tok

    def body(self, text: str) -> bytes:
        return b'{"text":"' + text.encode() + b'","sampling_params":{"max_new_tokens":1}}'

    def predictions(self, text: str, wid: str) -> tuple[int, int]:
        body = self.body(text)
        req = parse_request(ApiKind.GENERATE, body, {}, self.settings)
        approx = req.matched_tokens(self.approx.match(req.block_hashes).get(wid, 0))
        ids, ns = self.mgr.prepare("generate", body).tokens(self._tokenizer(wid))
        return self.mgr.match(ids, ns, [wid]).get(wid, -1), approx

    async def send(self, url: str, wid: str, text: str) -> dict[str, Any]:
        body = self.body(text)
        req = parse_request(ApiKind.GENERATE, body, {}, self.settings)
        self.approx.record(req.block_hashes, wid)
        ids, ns = self.mgr.prepare("generate", body).tokens(self._tokenizer(wid))
        self.mgr.dispatched(wid, ids, ns)
        async with self.session.post(f"{url}/generate", data=body) as resp:
            assert resp.status == 200, await resp.text()
            out: dict[str, Any] = await resp.json()
            return out


async def _manager(
    fleet: SimulatedFleet, session: aiohttp.ClientSession, **overrides: Any
) -> KVEventsManager:
    settings = KVEventsSettings(enabled="true", discovery_interval_s=0.1, **overrides)
    workers = [FollowedWorker(f"w{i}", url) for i, url in enumerate(fleet.urls)]
    mgr = KVEventsManager(settings, load_tokenizer(SIM_TOKENIZER), lambda: workers, session)
    await mgr.start()
    return mgr


async def test_exact_mode_sees_evictions_approximate_does_not(
    kv_fleet: SimulatedFleet, session: aiohttp.ClientSession
) -> None:
    mgr = await _manager(kv_fleet, session, hybrid=False)
    client = _Client(session, mgr)
    url = kv_fleet.urls[0]
    try:
        assert mgr.modes() == {"w0": MODE_EXACT, "w1": MODE_EXACT}
        target = _text(0, 300)
        first = await client.send(url, "w0", target)
        prompt = first["meta_info"]["prompt_tokens"]
        await _until(lambda: client.predictions(target, "w0")[0] > 0)
        exact, approx = client.predictions(target, "w0")
        assert exact == (prompt - 1) // 16 * 16 and approx > 0  # as cached_tokens: < prompt
        assert client.predictions(target, "w1")[0] == 0
        for doc in range(1, 12):  # well over the 6000-token pool: the target is evicted
            await client.send(url, "w0", _text(doc, 300))
        await _until(lambda: client.predictions(target, "w0")[0] == 0)
        exact, approx = client.predictions(target, "w0")
        assert exact == 0 and approx > 0  # the approximate index still believes it
        again = await client.send(url, "w0", target)
        assert again["meta_info"]["cached_tokens"] == 0  # the worker agrees with exact
    finally:
        await mgr.close()


async def test_degraded_when_publisher_stops_and_back_after_restart(
    kv_fleet: SimulatedFleet, session: aiohttp.ClientSession
) -> None:
    mgr = await _manager(kv_fleet, session, stale_timeout_s=0.3)
    client = _Client(session, mgr)
    try:
        await client.send(kv_fleet.urls[0], "w0", _text(0, 50))
        await _until(lambda: mgr.index.blocks("w0") > 0)
        worker = kv_fleet.workers[0]
        assert isinstance(worker, SimulatedWorker)
        publisher = worker.kv_events
        assert publisher is not None
        await publisher.close()  # events stop; HTTP keeps serving
        await client.send(kv_fleet.urls[0], "w0", _text(1, 50))
        await _until(lambda: mgr.mode("w0") == MODE_DEGRADED, within_s=3.0)
        assert mgr.mode("w1") == MODE_EXACT
        assert "w0" not in mgr.match([1] * 64, NS0, ["w0", "w1"])  # router falls back
        await kv_fleet.restart_worker(0)  # new process: new startup_time and ports
        await _until(lambda: mgr.mode("w0") == MODE_EXACT, within_s=3.0)
        assert mgr.index.blocks("w0") == 0  # the restarted worker's cache is empty
        await client.send(kv_fleet.urls[0], "w0", _text(2, 50))
        await _until(lambda: mgr.index.blocks("w0") > 0)
    finally:
        await mgr.close()


async def test_server_info_descriptor(
    kv_fleet: SimulatedFleet, session: aiohttp.ClientSession
) -> None:
    async with session.get(f"{kv_fleet.urls[1]}/server_info") as resp:
        info = await resp.json()
    desc = info["kv_events"]
    worker = kv_fleet.workers[1]
    assert isinstance(worker, SimulatedWorker)
    publisher = worker.kv_events
    assert publisher is not None
    assert desc == {
        "publisher": "zmq",
        "endpoint_host": "127.0.0.1",
        "endpoint_port_base": publisher.port,
        "topic": "kv",
        "block_size": 16,
        "dp_size": 1,
        "replay_endpoint_port_base": publisher.replay_port,
    }
    assert info["kv_events_config"] == KV_CONFIG and info["page_size"] == 16


def test_cli_flags() -> None:
    from simulator.__main__ import build_parser, config_from_args

    args = build_parser().parse_args(
        ["--kv-events-config", KV_CONFIG, "--kv-events-legacy-array", "--page-size", "16"]
    )
    config = config_from_args(args)
    assert config.kv_events_config == KV_CONFIG and config.kv_events_legacy_array
    config.validate()


async def test_legacy_array_encoding_live(session: aiohttp.ClientSession) -> None:
    config = SimConfig(
        speed=50.0, page_size=16, kv_events_config=KV_CONFIG, kv_events_legacy_array=True
    )
    async with await SimulatedFleet.start(1, config) as fleet:
        url = fleet.urls[0]
        async with session.post(
            f"{url}/generate", json={"text": _text(5, 80), "sampling_params": {"max_new_tokens": 1}}
        ) as resp:
            assert resp.status == 200
        # the manager starts after the traffic: its catch-up replay (legacy reply frames)
        # rebuilds the worker's blocks
        mgr = await _manager(fleet, session)
        try:
            await _until(lambda: mgr.index.blocks("w0") > 0, within_s=3.0)
            client = _Client(session, mgr)
            exact, _ = client.predictions(_text(5, 80), "w0")
            assert exact > 0
        finally:
            await mgr.close()
