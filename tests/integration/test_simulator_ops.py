"""The simulated worker's operational surface: metrics, loads, cache control, aborts,
faults, fleet lifecycle, the CLI, and the "done when" checks of issue 2."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.harness.ports import free_port_range
from simulator.fleet import SimConfig, SimulatedFleet, SimulatedWorker
from simulator.http.metrics import E2E_BUCKETS, TTFT_BUCKETS

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
LONG = {**CHAT, "max_tokens": 4000, "stream": True}
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "model", "cache",
    "token", "route", "queue",
]  # fmt: skip


def english(n_words: int, seed: int) -> str:
    """Pseudo-English; the first word is unique per seed (< 15), so prompts branch at the root
    (a shared first token would be split-matched, which SGLang counts as a use)."""
    rng = random.Random(seed)
    return " ".join([WORDS[seed % len(WORDS)]] + [rng.choice(WORDS) for _ in range(n_words - 1)])


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedFleet]:
    async with await SimulatedFleet.start(2, SimConfig(speed=50.0)) as fleet:
        yield fleet


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    result: dict[str, Any] = await get_json(http, url + "/_sim/stats")
    return result


async def eventually(check: Any, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


# ---------------------------------------------------------------------- metrics and loads
async def test_metrics_exposition(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    base = sim.urls[0]
    for stream in (False, True):
        for _ in range(2):
            async with http.post(
                base + "/v1/chat/completions", json={**CHAT, "stream": stream}
            ) as resp:
                await resp.read()
    async with http.get(base + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    assert "_created" not in text
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        names = re.findall(r'(\w+)="', line[line.index("{") :])
        assert names == sorted(names), f"labels not alphabetical: {line}"
    families = {f.name: f for f in text_string_to_metric_families(text)}
    gauges = [
        "num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate",
        "kv_evictable_tokens", "kv_available_tokens", "kv_used_tokens", "num_used_tokens",
        "max_total_num_tokens",
    ]  # fmt: skip
    for name in gauges:
        family = families[f"sglang:{name}"]
        assert family.type == "gauge"
        assert family.samples[0].labels == {
            "engine_type": "unified",
            "model_name": "sim-model",
            "moe_ep_rank": "0",
            "pp_rank": "0",
            "tp_rank": "0",
        }
    assert families["sglang:max_total_num_tokens"].samples[0].value == 420_000
    assert families["sglang:kv_evictable_tokens"].samples[0].value > 0  # idle cached prefix
    assert families["sglang:token_usage"].samples[0].value == 0  # excludes the idle cache
    # counters: the parser strips _total from family names
    prompt = families["sglang:prompt_tokens"]
    assert prompt.type == "counter"
    by_stream = {s.labels["is_streaming"]: s.value for s in prompt.samples}
    assert set(by_stream) == {"true", "false"} and by_stream["true"] > 0
    assert "# TYPE sglang:prompt_tokens_total counter" in text
    requests = families["sglang:num_requests"]
    assert sum(s.value for s in requests.samples) == 4
    cached = families["sglang:cached_tokens"].samples
    assert cached[0].labels["cache_source"] == "device" and cached[0].value > 0
    assert "sglang:generation_tokens_total{" in text
    ttft = families["sglang:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    bounds = sorted(
        {float(s.labels["le"]) for s in ttft.samples if s.name.endswith("_bucket")} - {float("inf")}
    )
    assert bounds == [float(b) for b in TTFT_BUCKETS]
    e2e = families["sglang:e2e_request_latency_seconds"]
    e2e_bounds = {float(s.labels["le"]) for s in e2e.samples if s.name.endswith("_bucket")}
    assert sorted(e2e_bounds - {float("inf")}) == [float(b) for b in E2E_BUCKETS]
    count = [s for s in ttft.samples if s.name.endswith("_count")]
    assert sum(s.value for s in count) == 4


async def test_metrics_only_with_enable_metrics(http: aiohttp.ClientSession) -> None:
    config = SimConfig(enable_metrics=False)
    async with (
        await SimulatedFleet.start(1, config) as fleet,
        http.get(fleet.urls[0] + "/metrics") as resp,
    ):
        assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}


async def test_v1_loads_shape(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    base = sim.urls[0]
    body = await get_json(http, base + "/v1/loads")
    assert list(body) == ["timestamp", "version", "accelerator", "num_accelerators", "loads"]
    assert body["version"] == "0.5.23" and body["num_accelerators"] == 1
    (load,) = body["loads"]
    for key in [
        "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs",
        "num_waiting_uncached_tokens", "num_used_tokens", "num_total_tokens", "num_active_tokens",
        "num_prealloc_ready_tokens", "max_total_num_tokens", "max_running_requests",
        "token_usage", "gen_throughput", "cache_hit_rate", "utilization",
        "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments",
    ]:  # fmt: skip
        assert key in load, key
    assert load["max_total_num_tokens"] == 420_000 and load["max_running_requests"] == 2048
    assert set(load["memory"]) == {"weight_gb", "kv_cache_gb", "graph_gb", "token_capacity"}
    assert load["disaggregation"]["mode"] == "null"
    assert set(load["queues"]) == {"waiting", "grammar", "paused", "retracted", "prealloc_ready"}
    core = (await get_json(http, base + "/v1/loads?include=core"))["loads"][0]
    assert "memory" not in core and "queues" not in core
    assert (await get_json(http, base + "/v1/loads?dp_rank=3"))["loads"] == []
    async with http.get(base + "/v1/loads?include=bogus") as resp:
        assert resp.status == 400 and (await resp.json())["object"] == "error"
    async with http.get(base + "/v1/loads?format=prometheus") as resp:
        text = await resp.text()
    assert '# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs{dp_rank="0"} 0' in text
    assert "sglang_memory_token_capacity" in text
    async with http.get(base + "/get_load") as resp:
        assert resp.status == 404  # gone in 0.5.23


async def test_loads_and_gauges_follow_running_work(
    sim: SimulatedFleet, http: aiohttp.ClientSession
) -> None:
    base = sim.urls[0]
    async with http.post(base + "/v1/chat/completions", json=LONG) as resp:
        await resp.content.readline()
        load = (await get_json(http, base + "/v1/loads"))["loads"][0]
        assert load["num_running_reqs"] == 1 and load["num_used_tokens"] > 0
        assert (await stats(http, base))["running"] == 1


async def test_legacy_get_load(http: aiohttp.ClientSession) -> None:
    async with await SimulatedFleet.start(1, SimConfig(legacy_get_load=True)) as fleet:
        body = await get_json(http, fleet.urls[0] + "/get_load")
    assert body == [
        {
            "rid": None,
            "http_worker_ipc": None,
            "dp_rank": 0,
            "num_reqs": 0,
            "num_waiting_reqs": 0,
            "num_tokens": 0,
        }
    ]


# ---------------------------------------------------------------------- cache, abort
async def test_flush_cache(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    base = sim.urls[0]
    worker = sim.workers[0]
    assert isinstance(worker, SimulatedWorker)
    async with http.post(base + "/v1/chat/completions", json=CHAT) as resp:
        await resp.read()
    assert worker.engine.cache.tree_tokens > 0
    async with http.post(base + "/flush_cache") as resp:
        assert resp.status == 200
        assert (await resp.text()).startswith("Cache flushed.\n")
    assert worker.engine.cache.tree_tokens == 0
    async with http.post(base + "/v1/chat/completions", json=LONG) as stream:
        await stream.content.readline()
        async with http.get(base + "/flush_cache") as resp:
            assert resp.status == 400
            # what the real 0.5.23 server answers (the scheduler's reason is only logged)
            assert await resp.text() == "Flush cache failed.\n"


async def test_abort_request(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    base = sim.urls[0]
    async with http.post(base + "/v1/chat/completions", json={**LONG, "rid": "victim"}) as resp:
        await resp.content.readline()
        async with http.post(base + "/abort_request", json={"rid": "victim"}) as abort:
            assert abort.status == 200 and await abort.read() == b""
        raw = await resp.read()
    chunks = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert raw.endswith(b"data: [DONE]\n\n")
    assert (await stats(http, base))["aborts"] == 1
    async with http.post(base + "/abort_request", json={"rid": "unknown"}) as abort:
        assert abort.status == 200
    async with http.get(base + "/metrics") as resp:
        assert "sglang:num_aborted_requests_total{" in await resp.text()


async def test_client_disconnect_aborts(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    base = sim.urls[0]
    async with http.post(base + "/v1/chat/completions", json=LONG) as resp:
        await resp.content.readline()
        resp.close()

    async def aborted() -> bool:
        s = await stats(http, base)
        return bool(s["aborts"] == 1 and s["in_flight"] == 0 and s["running"] == 0)

    await eventually(aborted)
    timeout = aiohttp.ClientTimeout(total=0.2)
    with pytest.raises(TimeoutError):
        async with http.post(
            base + "/v1/chat/completions", json={**LONG, "stream": False}, timeout=timeout
        ) as resp:
            await resp.read()

    async def aborted_twice() -> bool:
        s = await stats(http, base)
        return bool(s["aborts"] == 2 and s["in_flight"] == 0 and s["running"] == 0)

    await eventually(aborted_twice)


# ---------------------------------------------------------------------- faults
async def test_faults(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    base = sim.urls[0]
    async with http.get(base + "/_sim/faults") as resp:
        assert (await resp.json())["error_rate"] == 0.0
    async with http.post(base + "/_sim/faults", json={"error_rate": 1.0, "error_status": 503}):
        pass
    async with http.post(base + "/v1/chat/completions", json={**CHAT, "unknown": [1]}) as resp:
        assert resp.status == 503
        body = await resp.json()
        assert body["object"] == "error" and body["code"] == 503
    seen = await stats(http, base)
    assert seen["requests"] == 1 and seen["last_request_body"]["unknown"] == [1]
    assert seen["last_request_headers"]["Content-Type"] == "application/json"
    async with http.post(base + "/_sim/faults", json={"error_rate": 0.0, "fail_health": True}):
        pass
    for path in ("/health", "/ping", "/ready"):
        async with http.get(base + path) as resp:
            assert resp.status == 503
    async with http.post(base + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200  # health faults leave inference alone
    async with http.post(base + "/_sim/faults", json={"error_rate": 2}) as resp:
        assert resp.status == 400
    async with http.post(base + "/_sim/faults", json={"bogus": 1}) as resp:
        assert resp.status == 400


async def test_drop_mid_stream_and_hang(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    base = sim.urls[0]
    sim.workers[0].faults.drop_mid_stream_after = 3
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(base + "/v1/chat/completions", json=LONG) as resp:
            assert resp.status == 200
            await resp.read()
    sim.workers[0].faults.drop_mid_stream_after = None
    sim.workers[0].faults.hang = True
    with pytest.raises(TimeoutError):
        async with http.post(
            base + "/v1/chat/completions",
            json=CHAT,
            timeout=aiohttp.ClientTimeout(total=0.3),
        ) as resp:
            await resp.read()
    sim.workers[0].faults.hang = False
    start = time.monotonic()
    sim.workers[0].faults.latency_s = 0.2
    async with http.post(base + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    assert time.monotonic() - start >= 0.2


# ---------------------------------------------------------------------- fleet lifecycle
async def test_stop_and_restart_worker(sim: SimulatedFleet, http: aiohttp.ClientSession) -> None:
    url = sim.urls[1]
    async with http.post(url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    async with http.post(url + "/v1/chat/completions", json=LONG) as resp:
        await resp.content.readline()
        await sim.stop_worker(1)
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()  # the open stream was cut, like a killed process
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(url + "/ping") as resp:
            pass
    await sim.restart_worker(1)
    assert sim.urls[1] == url
    async with http.get(url + "/ping") as resp:
        assert resp.status == 200
    fresh = await stats(http, url)
    assert fresh["requests"] == 0 and fresh["kv_evictable_tokens"] == 0
    async with http.post(sim.urls[0] + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200  # the other worker never noticed


async def test_fleet_on_fixed_ports(http: aiohttp.ClientSession) -> None:
    for attempt in range(5):
        port = free_port_range(2)
        try:
            fleet = await SimulatedFleet.start(2, SimConfig(), base_port=port)
        except OSError:
            if attempt == 4:
                raise
            continue
        async with fleet:
            assert fleet.urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
            for url in fleet.urls:
                async with http.get(url + "/ping") as resp:
                    assert resp.status == 200
        return


async def test_capacity_is_never_exceeded_over_http(http: aiohttp.ClientSession) -> None:
    config = SimConfig(speed=50.0, capacity_tokens=3000)
    async with await SimulatedFleet.start(1, config) as fleet:
        base = fleet.urls[0]
        prompts = [english(400, seed) for seed in range(8)]

        async def generate(text: str) -> dict[str, Any]:
            body = {"text": text, "sampling_params": {"max_new_tokens": 4}}
            async with http.post(base + "/generate", json=body) as resp:
                out: dict[str, Any] = await resp.json()
                return out

        for text in prompts:
            await generate(text)
            s = await stats(http, base)
            assert s["kv_used_tokens"] + s["kv_evictable_tokens"] <= 3000
        assert (await stats(http, base))["kv_evicted_tokens_total"] > 0
        assert (await generate(prompts[-1]))["meta_info"]["cached_tokens"] > 0  # recent: kept
        assert (await generate(prompts[0]))["meta_info"]["cached_tokens"] == 0  # oldest: evicted


# ---------------------------------------------------------------------- issue 2 "done when"
async def test_done_when_generate_twice_and_ttft(http: aiohttp.ClientSession) -> None:
    """The same ~4,000-token /generate twice: cached ≈ 0, then ≥ 0.9 x prompt; a streamed
    request's time to first chunk is several times shorter when cached (speed 2: wall
    times are half the modelled ones; the model says ~100 ms cold vs ~5 ms cached)."""
    config = SimConfig(speed=2.0, capacity_tokens=200_000)
    async with await SimulatedFleet.start(2, config) as fleet:
        base = fleet.urls[0]
        text = english(4000, 1)  # 4,000 tokens
        body = {"text": text, "sampling_params": {"max_new_tokens": 8}}
        results = []
        for _ in range(2):
            async with http.post(base + "/generate", json=body) as resp:
                results.append(await resp.json())
        prompt = results[0]["meta_info"]["prompt_tokens"]
        assert 3500 <= prompt <= 5000
        assert results[0]["meta_info"]["cached_tokens"] <= 0.01 * prompt
        assert results[1]["meta_info"]["cached_tokens"] >= 0.9 * prompt

        async def first_chunk_s(text: str) -> float:
            start = time.perf_counter()
            body = {"text": text, "sampling_params": {"max_new_tokens": 2}, "stream": True}
            async with http.post(base + "/generate", json=body) as resp:
                first = await resp.content.readline()
                elapsed = time.perf_counter() - start
                assert first.startswith(b"data: {")
                await resp.read()
            return elapsed

        ratios = []
        for seed in (2, 3, 4):
            fresh = english(4000, seed)
            cold = await first_chunk_s(fresh)
            warm = await first_chunk_s(fresh)
            ratios.append(cold / warm)
        assert max(ratios) > 3.0, ratios


# ---------------------------------------------------------------------- CLI
def test_cli_serves_and_stops_on_sigterm() -> None:
    port = free_port_range(2)
    with subprocess.Popen(
        [sys.executable, "-m", "simulator", "--workers", "2", "--base-port", str(port),
         "--capacity-tokens", "200000", "--enable-metrics", "--enable-cache-report"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as proc:  # fmt: skip
        run_cli_checks(proc, port)


def run_cli_checks(proc: subprocess.Popen[bytes], port: int) -> None:
    try:
        assert proc.stdout is not None
        urls = [proc.stdout.readline().decode().strip() for _ in range(2)]
        assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]

        async def check() -> None:
            async with aiohttp.ClientSession() as http:
                for url in urls:
                    async with http.get(url + "/metrics") as resp:
                        assert resp.status == 200
                    async with http.post(url + "/v1/chat/completions", json=CHAT) as resp:
                        body = await resp.json()
                        assert body["usage"]["completion_tokens"] == 4

        asyncio.run(check())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "simulator", "--help"], capture_output=True, check=True, text=True
    ).stdout
    for flag in ("--workers", "--base-port", "--speed", "--profile", "--enable-cache-report"):
        assert flag in out
    assert "llama3-8b-h100" in out
