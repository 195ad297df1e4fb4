"""Active-check thresholds, /server_info parsing and engine load parsers."""

from __future__ import annotations

import aiohttp

from gateway.config import HealthConfig
from gateway.forward.relay import cached_tokens
from gateway.workers.health import HealthChecker
from gateway.workers.registry import HealthFlag, WorkerRegistry
from gateway.workers.replies import parse_get_load, parse_metrics, parse_server_info, parse_v1_loads


async def test_flags_flip_after_consecutive_results() -> None:
    reg = WorkerRegistry(0.5)
    w, _ = reg.add("http://127.0.0.1:1")
    async with aiohttp.ClientSession() as session:
        checker = HealthChecker(
            HealthConfig(failure_threshold=3, success_threshold=2), reg, session
        )
        flips: list[bool] = []
        checker.on_flip.append(lambda _w, ok: flips.append(ok))
        checker.record(w, True)  # one pass clears "unchecked"
        assert w.healthy
        for ok in (False, False, True, False, False):
            checker.record(w, ok)
        assert w.healthy  # never three failures in a row
        checker.record(w, False)
        assert w.flags == {HealthFlag.CHECK_FAILED}
        checker.record(w, True)
        assert w.flags == {HealthFlag.CHECK_FAILED}  # one pass is not enough
        checker.record(w, True)
        assert w.healthy
        assert flips == [True, False, True]


def test_server_info_fields() -> None:
    meta = parse_server_info(
        {
            "model_path": "/m",
            "served_model_name": "m",
            "max_total_num_tokens": 4096,
            "page_size": 16,
        }
    )
    assert (meta.model, meta.capacity_tokens, meta.page_size) == ("m", 4096, 16)
    meta = parse_server_info(
        {"model_path": "/m", "internal_states": [{"max_total_num_tokens": 99}]}
    )
    assert (meta.model, meta.capacity_tokens, meta.page_size) == ("/m", 99, None)


def test_v1_loads_sums_ranks() -> None:
    body = {
        "loads": [
            {
                "num_running_reqs": 2,
                "num_waiting_reqs": 1,
                "num_waiting_uncached_tokens": 100,
                "token_usage": 0.5,
                "max_total_num_tokens": 1000,
            },
            {
                "num_running_reqs": 3,
                "num_waiting_reqs": 0,
                "num_waiting_uncached_tokens": 20,
                "token_usage": 0.7,
                "max_total_num_tokens": 1000,
            },
        ]
    }
    parsed = parse_v1_loads(body)
    assert parsed is not None
    load, capacity = parsed
    assert (load.running_requests, load.waiting_requests) == (5, 1)
    assert load.waiting_uncached_tokens == 120 and load.token_usage == 0.7
    assert capacity == 2000
    assert parse_v1_loads({"load": 3}) is None


def test_get_load_list_form() -> None:
    load = parse_get_load([{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 10}])
    assert load is not None and (load.running_requests, load.waiting_requests) == (3, 2)
    assert parse_get_load({"load": 7}) is None


def test_metrics_text() -> None:
    text = (
        "# HELP sglang:num_running_reqs x\n"
        'sglang:num_running_reqs{model_name="m",engine_type="unified"} 4.0\n'
        'sglang:num_queue_reqs{model_name="m"} 2.0\n'
        'sglang:token_usage{model_name="m"} 0.25\n'
    )
    load = parse_metrics(text)
    assert load is not None
    assert (load.running_requests, load.waiting_requests, load.token_usage) == (4, 2, 0.25)
    assert parse_metrics("other_metric 1\n") is None


def test_cached_tokens_takes_the_last_report() -> None:
    assert cached_tokens(b'{"usage":{"prompt_tokens_details":{"cached_tokens":12}}}') == 12
    chunk = (
        b'data: {"meta_info":{"cached_tokens":3,"cached_tokens_details":null}}\n\n'
        b'data: {"meta_info":{"cached_tokens": 8}}\n\n'
    )
    assert cached_tokens(chunk) == 8
    assert cached_tokens(b'{"usage":{"prompt_tokens_details":null}}') is None


async def test_poller_falls_back_to_metrics_and_remembers() -> None:
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from gateway.config import LoadConfig
    from gateway.workers.engine_load import LoadPoller

    hits: list[str] = []

    async def metrics(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text='sglang:num_running_reqs{m="x"} 3\nsglang:num_queue_reqs 1\n')

    async def missing(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/loads", missing)
    app.router.add_get("/get_load", missing)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        reg = WorkerRegistry(0.5)
        worker, _ = reg.add(str(server.make_url("")).rstrip("/"))
        async with aiohttp.ClientSession() as session:
            poller = LoadPoller(LoadConfig(), reg, session, timeout_s=2.0)
            await poller.poll(worker)
            assert worker.engine_load is not None
            assert (worker.engine_load.running_requests, worker.engine_load.waiting_requests) == (
                3,
                1,
            )
            await poller.poll(worker)
        assert hits == ["/v1/loads", "/get_load", "/metrics", "/metrics"]
    finally:
        await server.close()
