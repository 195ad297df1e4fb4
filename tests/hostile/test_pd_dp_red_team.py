"""Red team of PD mode (prefill/decode pairs) and data-parallel ranks: a hostile client
and misbehaving workers, scripted (``scripted_worker``) or simulated. Each test names
what it found and failed before its fix, but those whose docstring starts "Held": what
was tried and already stood."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
from scripted_worker import Exchange, ScriptedWorker, StartWorker, http_response, replies

from gateway.workers.registry import Worker
from loadtests.harness.inprocess import GatewayHandle, run_gateway

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
DECODED = b'{"text":"ok","meta_info":{"cached_tokens":0,"completion_tokens":1}}'


async def until(check: Any, what: str, within_s: float = 5.0) -> None:
    """Wait (bounded, wide margin: a shared machine) until ``check()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not check():
        assert loop.time() < deadline, f"never held within {within_s} s: {what}"
        await asyncio.sleep(0.02)


def info(**fields: Any) -> bytes:
    """A GET answer for every probe and metadata path: 200 with this JSON."""
    return http_response(orjson.dumps({"model_path": "m", **fields}))


def idle(gw: GatewayHandle) -> bool:
    """Every lease returned, on every worker and every DP rank."""
    return all(
        t.in_flight == 0 and t.queued_prefill_tokens == 0 and t.decoding_requests == 0
        for w in gw.registry
        for t in (w, *w.ranks)
    )


def penalised(worker: Worker) -> bool:
    """Outlier detection counted a failure against it (or ejected it already)."""
    w = worker
    return w.consecutive_connect_errors > 0 or w.consecutive_5xx > 0 or w.times_ejected > 0


@asynccontextmanager
async def pd_gateway(
    prefills: list[ScriptedWorker], decodes: list[ScriptedWorker], **overrides: Any
) -> AsyncIterator[GatewayHandle]:
    """A PD gateway in front of scripted workers, once every one passed its probe and its
    ``/server_info`` was read."""
    async with run_gateway(
        [],
        pd__enabled=True,
        pd__prefill=[f"{p.url} 8998" for p in prefills],
        pd__decode=[d.url for d in decodes],
        **overrides,
    ) as gw:
        total = len(prefills) + len(decodes)
        await until(
            lambda: (
                gw.registry.healthy_count() == total and all(w.metadata.model for w in gw.registry)
            ),
            "every worker probed",
        )
        yield gw


async def post(gw: GatewayHandle, path: str, body: Any) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            gw.url + path, data=body if isinstance(body, bytes) else orjson.dumps(body)
        ) as resp,
    ):
        return resp.status, await resp.read()


# --- the prefill's refusal, cut short, was blamed on the decode ------------------------


async def test_a_prefill_error_cut_short_is_the_prefills_failure(scripted: StartWorker) -> None:
    """A prefill answering a 500 head whose body it then cuts (or never finishes) raised
    an AttemptFailed naming no worker, which ``_attempt_pd`` then put on the decode: the
    healthy decode was penalised and excluded, so the retry found no decode and the
    client got a 502 although another prefill was there."""
    cut = b'HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100\r\n\r\n{"err'
    bad = await scripted(replies(cut, keep=False))
    bad.probe_answer = info(disaggregation_mode="prefill")
    good = await scripted(replies(http_response(DECODED)))
    good.probe_answer = info(disaggregation_mode="prefill")
    decode = await scripted(replies(http_response(DECODED)))
    decode.probe_answer = info(disaggregation_mode="decode")
    async with pd_gateway([bad, good], [decode]) as gw:
        for _ in range(4):
            status, body = await post(gw, "/generate", {"text": "hello"})
            assert status == 200, body
        assert bad.posts >= 1  # round robin: the bad prefill was tried
        by_url = {w.url: w for w in gw.registry}
        assert not penalised(by_url[decode.url]) and penalised(by_url[bad.url])
        await until(lambda: idle(gw), "leases returned")


# --- PD with a DP prefill: the pinned rank and the room disagreed -----------------------


def _prefill_ranks(exchange: Exchange) -> list[tuple[int, int]]:
    """Per batch item: (the rank SGLang's prefill puts it on, the rank its decode fetches
    the KV from). SGLang 0.5.23: a prefill routes by ``routed_dp_rank`` when set, else
    by its default ``follow_bootstrap_room`` (``room % dp_size``); a decode finds the
    prefill's rank as ``room % dp_size`` (``_resolve_prefill_dp_rank``), and a prefill
    whose rank differs fails the request ("follow_bootstrap_room conflict"). A scalar
    room is ``room + i`` for item ``i``."""
    body = orjson.loads(exchange.body)
    room, pinned = body["bootstrap_room"], body.get("routed_dp_rank")
    items = len(body["text"]) if isinstance(body["text"], list) else 1
    return [
        (pinned if pinned is not None else (room + i) % 4, (room + i) % 4) for i in range(items)
    ]


async def test_a_dp_prefill_gets_the_room_of_its_rank(scripted: StartWorker) -> None:
    """The gateway pinned the prefill rank it chose (``routed_dp_rank``) but drew the
    room at random: SGLang's decode looks for the KV at ``room % dp_size``, so 3 requests
    in 4 failed on a real 4-rank prefill, and a batch's items after the first always."""
    batch = http_response(orjson.dumps([orjson.loads(DECODED)] * 3))
    prefill = await scripted(replies(http_response(DECODED)))
    prefill.probe_answer = info(disaggregation_mode="prefill", dp_size=4, version="0.5.23")
    decode = await scripted(replies(http_response(DECODED)))
    decode.probe_answer = info(disaggregation_mode="decode")
    async with pd_gateway([prefill], [decode]) as gw:
        assert len(gw.registry.find(prefill.url).ranks) == 4  # type: ignore[union-attr]
        for i in range(8):
            status, body = await post(gw, "/generate", {"text": f"hello {i}"})
            assert status == 200, body
        decode.answer = replies(batch)
        prefill.answer = replies(batch)
        for i in range(4):
            status, body = await post(gw, "/generate", {"text": ["a", "b", f"c {i}"]})
            assert status == 200, body
        pinned = {orjson.loads(e.body).get("routed_dp_rank") for e in prefill.inference[:8]}
        assert pinned == {0, 1, 2, 3}  # each rank was chosen: the gateway routes per rank
        for exchange in prefill.inference:
            for put, fetched in _prefill_ranks(exchange):
                assert put == fetched, exchange.body
        await until(lambda: idle(gw), "leases returned")


# --- bodies the gateway could parse but not write back -----------------------------------

DEEP = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":' + b"[" * 300
DEEP += b"]" * 300 + b"}"  # valid JSON (orjson reads 1,024 levels; writes 254)


async def test_a_deeply_nested_body_is_the_clients_error_not_a_500(
    scripted: StartWorker,
) -> None:
    """A body nested 255-1,024 levels deep parses, but orjson cannot write it back: every
    PD request (the pair's body is re-serialised) and, outside PD mode, one carrying a
    ``rid`` (replaced by the gateway's) raised TypeError: a 500 "the gateway failed to
    handle the request", nothing sent. (A 400 raised mid-attempt was counted as a 503.)"""
    prefill = await scripted(replies(http_response(DECODED)))
    prefill.probe_answer = info(disaggregation_mode="prefill")
    decode = await scripted(replies(http_response(DECODED)))
    decode.probe_answer = info(disaggregation_mode="decode")
    async with pd_gateway([prefill], [decode]) as gw:
        status, body = await post(gw, "/v1/chat/completions", DEEP)
        assert status == 400, body
        assert b"nested" in body and not prefill.posts and not decode.posts
        await until(lambda: idle(gw), "leases returned")
    worker = await scripted(replies(http_response(DECODED)))
    async with run_gateway([worker.url], worker_kind="sglang") as gw:
        status, body = await post(gw, "/v1/chat/completions", DEEP[:-1] + b',"rid":"mine"}')
        assert status == 400, body
        async with aiohttp.ClientSession() as session, session.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
        assert 'status="400"' in metrics and 'status="503"' not in metrics  # counted as 503
        status, body = await post(gw, "/v1/chat/completions", DEEP)  # untouched: forwarded
        assert status == 200, body
        assert worker.inference[-1].body.startswith(DEEP[:-1])


def _sse(*docs: bytes) -> bytes:
    events = b"".join(b"data: " + d + b"\n\n" for d in docs) + b"data: [DONE]\n\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(events) + events


async def test_a_decode_answer_too_deep_to_merge_is_relayed_as_it_came(
    scripted: StartWorker,
) -> None:
    """With ``return_logprob`` the prefill's input logprobs are merged into the decode's
    answer, re-serialised: a decode answer nested over 254 levels made that raise, a 500
    for a plain answer and a stream cut without its error event or ``[DONE]``."""
    deep = b"[" * 300 + b"]" * 300
    plain = b'{"text":"ok","meta_info":{"input_token_logprobs":[[-0.1,2,null]],"x":%s}}' % deep
    prefill_lp = b'{"text":"","meta_info":{"input_token_logprobs":[[-0.5,1,null]]}}'
    prefill = await scripted(replies(http_response(prefill_lp)))
    prefill.probe_answer = info(disaggregation_mode="prefill")
    decode = await scripted(replies(http_response(plain)))
    decode.probe_answer = info(disaggregation_mode="decode")
    async with pd_gateway([prefill], [decode]) as gw:
        ask = {"text": "hello", "return_logprob": True}
        status, body = await post(gw, "/generate", ask)
        assert status == 200 and body == plain, body
        decode.answer = replies(_sse(plain))
        prefill.answer = replies(_sse(prefill_lp))
        status, body = await post(gw, "/generate", {**ask, "stream": True})
        assert status == 200 and body.endswith(b"data: [DONE]\n\n"), body[-200:]
        assert plain in body
        # a merge that can be written still happens
        merged = b'{"text":"ok","meta_info":{"input_token_logprobs":[[-0.1,2,null]]}}'
        decode.answer = replies(http_response(merged))
        prefill.answer = replies(http_response(prefill_lp))
        status, body = await post(gw, "/generate", ask)
        assert orjson.loads(body)["meta_info"]["input_token_logprobs"] == [
            [-0.5, 1, None],
            [-0.1, 2, None],
        ]
        await until(lambda: idle(gw), "leases returned")


# --- a worker's load figures -------------------------------------------------------------


async def test_hostile_load_figures_neither_stop_polling_nor_reach_policies(
    scripted: StartWorker,
) -> None:
    """``/v1/loads`` entries are summed over DP ranks: two of 1e308 running requests made
    ``int(inf)`` raise OverflowError in the load poller, whose loop then ended: no
    worker's load was read again (the others' figures aged for good); so did ``+Inf`` in
    ``/metrics``. Negative counts and usage reached the policies as they came."""
    huge = {"num_running_reqs": 1e308, "num_waiting_reqs": -5, "token_usage": -1e300}
    entries: list[Any] = [{"dp_rank": r, **huge, "max_total_num_tokens": 1e308} for r in (0, 1)]
    entries += [{"dp_rank": 7, "num_waiting_uncached_tokens": -9}, [], {"dp_rank": True}]
    hostile = await scripted(replies(http_response(DECODED)))
    hostile.probe_answer = info(dp_size=2, loads=entries)
    honest = await scripted(replies(http_response(DECODED)))
    honest.probe_answer = info(loads=[{"dp_rank": 0, "num_running_reqs": 3}])
    metrics = await scripted(replies(http_response(DECODED)))  # /metrics only parses
    metrics.probe_answer = http_response(
        b'sglang:num_running_reqs 2\nsglang:num_running_reqs{dp_rank="1"} +Inf\n'
        b"sglang:num_queue_reqs NaN\nsglang:token_usage -3\n",
        ctype="text/plain",
    )
    urls = [hostile.url, honest.url, metrics.url]
    async with run_gateway(urls, worker_kind="sglang") as gw:
        fine, bad, text = (gw.registry.find(u) for u in urls[1::-1] + urls[2:])
        assert fine is not None and bad is not None and text is not None
        await until(lambda: fine.load_read_at > 0 and bool(bad.ranks), "first polls")
        polled = sum(1 for e in hostile.exchanges if e.target == "/v1/loads")
        read_at = fine.load_read_at
        await until(lambda: fine.load_read_at > read_at, "the honest worker polled again")
        assert sum(1 for e in hostile.exchanges if e.target == "/v1/loads") > polled
        await until(lambda: text.engine_load is not None, "/metrics read")
        for target in (bad, *bad.ranks, text):
            load = target.engine_load
            assert load is not None
            assert 0 <= load.running_requests < 2**53 and load.waiting_requests >= 0
            assert load.token_usage >= 0.0 and (load.waiting_uncached_tokens or 0) >= 0
        assert text.engine_load is not None and text.engine_load.running_requests == 2
        status, body = await post(gw, "/v1/chat/completions", CHAT)
        assert status == 200, body


# --- a client that leaves while the pair's heads come in -------------------------------

STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
STREAM_HEAD += b"Transfer-Encoding: chunked\r\n\r\n"
KEEP = b"%x\r\n%s\r\n" % (len(b": keep\n\n"), b": keep\n\n")


def _held(closed: asyncio.Event, head: bool, until_set: asyncio.Event) -> Any:
    """A worker that reads the request, writes a stream's head (``head``) then a comment
    every 20 ms, or nothing, until the gateway closes the connection (``closed`` set) or
    the test ends (``until_set``)."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        try:
            if head:
                writer.write(STREAM_HEAD)
            while not until_set.is_set():
                if head:
                    writer.write(KEEP)
                    await writer.drain()
                await asyncio.sleep(0.02)
        except ConnectionError:
            closed.set()
        return False

    return answer


async def test_a_client_leaving_between_the_pairs_heads_closes_both(
    scripted: StartWorker,
) -> None:
    """The client leaves once the prefill's head came and while the decode's is awaited:
    ``_send_pair`` cancelled the decode's send but dropped the prefill's head unclosed
    (``p_up`` was not yet assigned), so its connection stayed open, read into a buffer,
    until the request's deadline or the stream's idle timeout (120 s)."""
    closed, end = asyncio.Event(), asyncio.Event()
    prefill = await scripted(_held(closed, True, end))
    prefill.probe_answer = info(disaggregation_mode="prefill")
    decode = await scripted(_held(asyncio.Event(), False, end))
    decode.probe_answer = info(disaggregation_mode="decode")
    try:
        async with pd_gateway([prefill], [decode]) as gw:
            port = int(gw.url.rsplit(":", 1)[1])
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            request = orjson.dumps({**CHAT, "stream": True})
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(request), request)
            )
            await until(lambda: bool(prefill.posts and decode.posts), "both sent")
            await asyncio.sleep(0.1)  # the prefill's head is in
            writer.close()
            await asyncio.wait_for(closed.wait(), 3)  # the prefill's connection was closed
            await until(lambda: idle(gw), "leases returned")
            await until(lambda: bool(prefill.aborts and decode.aborts), "both aborted")
    finally:
        end.set()


# --- exact mode keyed by targets the registry does not route to -------------------------

KV_CONFIG = (
    '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
)


async def test_exact_mode_on_a_rank_blind_dp_worker_predicts_its_hits() -> None:
    """Exact mode keyed a DP worker's KV events per rank whenever its descriptor had
    ranks, whatever the registry routed to: rank-blind (``dp_aware: false``, one target
    per worker) it matched nothing ever, in ``exact`` mode, while the worker reported
    its prefix cached. Keyed by the registry's targets, the ranks are unioned under the
    worker's id, as the approximate index does."""
    from simulator.fleet import SimConfig, SimulatedFleet  # the simulator: this test only

    conf = SimConfig(speed=50.0, page_size=16, dp_size=2, kv_events_config=KV_CONFIG)
    overrides: dict[str, Any] = {
        "policy__name": "cache_aware",
        "kv_events__enabled": True,
        "kv_events__discovery_interval_s": 0.1,
        "kv_events__hybrid": False,
        "dp_aware": False,
    }
    async with (
        await SimulatedFleet.start(1, conf) as fleet,
        run_gateway(fleet.urls, **overrides) as gw,
    ):
        manager: Any = gw.router._exact  # the KVEventsManager
        assert manager is not None
        wid = gw.registry.find(fleet.urls[0]).id  # type: ignore[union-attr]
        await until(lambda: manager.mode(wid) == "exact", "following its events", 10)
        context = " ".join(f"shared{i}" for i in range(300))
        matched, reported = [], []
        for q in range(4):  # SGLang's round robin over the ranks
            ask = {**CHAT, "messages": [{"role": "user", "content": f"{context} q{q}"}]}
            status, body = await post(gw, "/v1/chat/completions", {**ask, "max_tokens": 2})
            assert status == 200, body
            reported.append(orjson.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"])
            record = gw.router.decisions.latest(1)[0]
            assert record.worker == wid and record.index_mode == "exact"
            matched.append(record.matched_tokens)
            await until(lambda: manager.index.blocks(wid) > 0, "its first blocks stored")
        # the context is held by some rank from the first request on: predicted since
        assert max(reported) > 0 and matched[1:] == [max(reported)] * 3, (matched, reported)


async def test_a_decode_refusal_closes_the_waiting_prefill(scripted: StartWorker) -> None:
    """The decode refuses the request at once (a whole 4xx, relayed) while the prefill,
    its head sent, waits for a decode that will never connect (SGLang: up to its
    bootstrap timeout, 300 s). The task draining the prefill was cancelled before it
    ever ran (the decode's answer was read without a wait), so its ``finally`` never
    closed the prefill's connection: it stayed open, unaborted, until the deadline."""
    closed, end = asyncio.Event(), asyncio.Event()
    prefill = await scripted(_held(closed, True, end))
    prefill.probe_answer = info(disaggregation_mode="prefill")
    refusal = b'{"error":{"message":"bad","code":400}}'
    decode = await scripted(replies(http_response(refusal, "400 Bad Request")))
    decode.probe_answer = info(disaggregation_mode="decode")
    try:
        async with pd_gateway([prefill], [decode]) as gw:
            status, body = await post(gw, "/v1/chat/completions", {**CHAT, "stream": True})
            assert status == 400 and body == refusal
            await asyncio.wait_for(closed.wait(), 3)  # SGLang aborts on the disconnect
            await until(lambda: idle(gw), "leases returned")
    finally:
        end.set()


# --- what a client may not set: SGLang's routing members and override headers ----------

# SGLang 0.5.23 (``entrypoints/request_headers.py``, ``serving_base``): these request
# headers override the body's members, for "upstream callers" (the router: us)
OVERRIDES = {
    "x-override-rid": "mine",
    "X-Override-Bootstrap-Host": "169.254.169.254",
    "x-override-bootstrap-port": "80",
    "x-override-bootstrap-room": "5",
    "x-override-routed-dp-rank": "3",
    "x-override-disagg-prefill-dp-rank": "2",
    "x-override-priority": "100",
    "x-override-conversation-id": "c",
    "X-Data-Parallel-Rank": "3",
}


def _no_overrides(exchange: Exchange) -> bool:
    return not any(k.startswith("x-override-") or k == "x-data-parallel-rank"
                   for k, _ in exchange.headers)  # fmt: skip


async def test_sglang_override_headers_never_reach_a_worker(scripted: StartWorker) -> None:
    """The client's headers are forwarded, and SGLang lets ``x-override-*`` headers and
    ``X-Data-Parallel-Rank`` win over the body: a client set the worker's rid (the
    gateway's aborts then named a rid the worker did not know), its DP rank, its
    priority, and in PD mode the bootstrap room, host and port, sending the decode
    server to fetch its KV from any host it named (169.254.169.254: the metadata
    service)."""
    prefill = await scripted(replies(http_response(DECODED)))
    prefill.probe_answer = info(disaggregation_mode="prefill")
    decode = await scripted(replies(http_response(DECODED)))
    decode.probe_answer = info(disaggregation_mode="decode")
    async with aiohttp.ClientSession() as session:
        async with pd_gateway([prefill], [decode]) as gw:
            for path, body in (("/generate", {"text": "hi"}), ("/v1/chat/completions", CHAT)):
                async with session.post(gw.url + path, json=body, headers=OVERRIDES) as resp:
                    assert resp.status == 200, await resp.text()
        worker = await scripted(replies(http_response(DECODED)))
        worker.probe_answer = info(dp_size=2, version="0.5.23")
        async with run_gateway([worker.url], worker_kind="sglang") as gw:
            await until(lambda: bool(gw.registry.find(worker.url).ranks), "its ranks")  # type: ignore[union-attr]
            async with session.post(
                gw.url + "/v1/chat/completions", json=CHAT, headers=OVERRIDES
            ) as resp:
                assert resp.status == 200, await resp.text()
    sent = [*prefill.inference, *decode.inference, *worker.inference]
    assert len(sent) == 5 and all(_no_overrides(e) for e in sent), sent[0].headers


async def test_a_pair_body_carries_none_of_the_clients_routing_members(
    scripted: StartWorker,
) -> None:
    """The pair's body replaced the client's bootstrap fields, rid and DP ranks (escaped
    and duplicated keys included: held), but kept its ``disagg_prefill_dp_rank``, which
    tells SGLang's decode which prefill rank holds the KV (and spares the prefill its
    rank check): a wrong one left both servers waiting for each other, the prefill
    holding the prompt's KV, up to their 300 s timeouts."""
    prefill = await scripted(replies(http_response(DECODED)))
    prefill.probe_answer = info(disaggregation_mode="prefill", dp_size=2, version="0.5.23")
    decode = await scripted(replies(http_response(DECODED)))
    decode.probe_answer = info(disaggregation_mode="decode")
    body = (
        b'{"text":"hi","bootstrap_room":1,"bootstrap_room":2,"\\u0062ootstrap_host":"evil",'
        b'"bootstrap_port":1,"rid":"mine","\\u0072id":"mine2","routed_dp_rank":1,'
        b'"data_parallel_rank":1,"disagg\\u005fprefill_dp_rank":1,"disagg_prefill_dp_rank":1}'
    )
    async with pd_gateway([prefill], [decode]) as gw:
        for _ in range(2):
            status, answer = await post(gw, "/generate", body)
            assert status == 200, answer
    for exchange in [*prefill.inference, *decode.inference]:
        sent = orjson.loads(exchange.body)
        assert b"disagg_prefill_dp_rank" not in exchange.body and "data_parallel_rank" not in sent
        assert sent["bootstrap_host"] == "127.0.0.1" and sent["bootstrap_port"] == 8998
        assert sent["bootstrap_room"] > 2 and sent["rid"] not in ("mine", "mine2")
        assert exchange.body.count(b'"rid"') == 1 and exchange.body.count(b"bootstrap_room") == 1
    rooms = [orjson.loads(e.body)["bootstrap_room"] for e in prefill.inference]
    assert rooms == [orjson.loads(e.body)["bootstrap_room"] for e in decode.inference]
    assert [orjson.loads(e.body).get("routed_dp_rank") for e in decode.inference] == [None] * 2


# --- retries of a pair -------------------------------------------------------------------


async def test_a_failing_decode_is_retried_on_another_with_a_single_prefill(
    scripted: StartWorker,
) -> None:
    """With one prefill worker every attempt counted as the last (``final``: one
    candidate, the prefill pool's), so a decode answering 503 was relayed to the client
    although another decode was there; the retry takes a new room and rid."""
    prefill = await scripted(replies(http_response(DECODED)))
    prefill.probe_answer = info(disaggregation_mode="prefill")
    busy = await scripted(replies(http_response(b'{"error":"busy"}', "503 Unavailable")))
    busy.probe_answer = info(disaggregation_mode="decode")
    fine = await scripted(replies(http_response(DECODED)))
    fine.probe_answer = info(disaggregation_mode="decode")
    async with pd_gateway([prefill], [busy, fine], pd__decode_policy="round_robin") as gw:
        for i in range(4):
            status, body = await post(gw, "/generate", {"text": f"hi {i}"})
            assert status == 200, body
        assert busy.posts >= 1
        await until(lambda: idle(gw), "leases returned")
    sent = [orjson.loads(e.body) for e in prefill.inference]
    assert len({s["bootstrap_room"] for s in sent}) == len(sent) == 4 + busy.posts
    assert len({s["rid"] for s in sent}) == len(sent)


async def test_a_prefill_refusal_carries_the_gateways_headers(scripted: StartWorker) -> None:
    """A prefill's 4xx is relayed as the answer (the decode aborted), but without the
    headers every routed answer carries (``x-request-id``, ``x-gateway-worker``,
    ``x-gateway-prefill-worker``, ``x-gateway-matched-tokens``)."""
    refusal = b'{"error":{"message":"bad"}}'
    prefill = await scripted(
        replies(http_response(refusal, "400 Bad Request", extra="X-Evil: 1\r\n"))
    )
    prefill.probe_answer = info(disaggregation_mode="prefill")
    decode = await scripted(replies(http_response(DECODED)))
    decode.probe_answer = info(disaggregation_mode="decode")
    async with (
        pd_gateway([prefill], [decode]) as gw,
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/generate", json={"text": "hi"}, headers={"x-request-id": "r-1"}) as resp,
    ):
        assert resp.status == 400 and await resp.read() == refusal
        assert resp.headers["x-request-id"] == "r-1" and "x-evil" not in resp.headers
        assert resp.headers["x-gateway-prefill-worker"] == prefill.url
        assert resp.headers["x-gateway-worker"] == decode.url
        assert resp.headers["x-gateway-matched-tokens"] == "0"
        rid = orjson.loads(decode.inference[0].body)["rid"]
        await until(lambda: bool(decode.aborts), "the decode aborted")
        assert orjson.loads(decode.aborts[0]) == {"rid": rid}


# --- DP ranks that change -------------------------------------------------------------


def _streams_until(release: asyncio.Event) -> Any:
    """A worker streaming one event, then ``[DONE]`` once ``release`` is set."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(STREAM_HEAD + b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
        await writer.drain()
        await release.wait()
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(DONE), DONE))
        await writer.drain()
        return True

    return answer


EVENT = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


async def test_ranks_that_go_while_their_requests_run(scripted: StartWorker) -> None:
    """Held: a worker whose ``/server_info`` is read at every probe (it names no model)
    goes from 4 ranks to 2 while a request runs on each: the requests finish whole, every
    lease (the dropped ranks' too) is returned, and the ranks come back fresh."""
    release = asyncio.Event()
    worker = await scripted(_streams_until(release))
    worker.probe_answer = http_response(orjson.dumps({"dp_size": 4}))
    async with run_gateway([worker.url], worker_kind="sglang") as gw:
        w = gw.registry.find(worker.url)
        assert w is not None
        await until(lambda: len(w.ranks) == 4, "4 ranks")
        ranks = w.ranks
        streams = [
            asyncio.ensure_future(post(gw, "/v1/chat/completions", {**CHAT, "stream": True}))
            for _ in range(4)
        ]
        await until(lambda: all(r.in_flight == 1 for r in ranks), "a request on each rank")
        worker.probe_answer = http_response(orjson.dumps({"dp_size": 2}))
        await until(lambda: len(w.ranks) == 2, "2 ranks")
        release.set()
        for status, body in await asyncio.gather(*streams):
            assert status == 200 and body.endswith(DONE), body
        assert all(r.in_flight == 0 and r.decoding_requests == 0 for r in ranks)
        await until(lambda: idle(gw), "leases returned")
        worker.probe_answer = http_response(orjson.dumps({"dp_size": 4}))
        await until(lambda: len(w.ranks) == 4, "4 ranks again")
        status, body = await post(gw, "/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 200, body
        await until(lambda: idle(gw), "leases returned")


async def test_a_worker_back_with_fewer_ranks_is_routed_to_its_ranks() -> None:
    """A worker's ``/server_info`` was read once: one restarted with fewer DP ranks kept
    its old rank targets, and every request pinned to a rank it no longer had got its
    400 ("routed_dp_rank=3 out of range [0, 2)"), for good. A worker that failed its
    health checks has its metadata read again as it comes back."""
    from dataclasses import replace

    from simulator.fleet import SimConfig, SimulatedFleet  # the simulator: this test only

    async with (
        await SimulatedFleet.start(1, SimConfig(speed=50.0, dp_size=4)) as fleet,
        run_gateway(fleet.urls) as gw,
    ):
        w = gw.registry.find(fleet.urls[0])
        assert w is not None
        await until(lambda: len(w.ranks) == 4, "4 ranks")
        await fleet.stop_worker(0)
        await until(lambda: not w.healthy, "its health checks failed")
        fleet.config = replace(fleet.config, dp_size=2)
        await fleet.restart_worker(0)
        await until(lambda: w.healthy, "back")
        for i in range(6):
            ask = {**CHAT, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2}
            status, body = await post(gw, "/v1/chat/completions", ask)
            assert status == 200, body
        assert len(w.ranks) == 2


# --- what held ---------------------------------------------------------------------------


async def test_a_client_leaving_mid_stream_frees_both_dp_sides(scripted: StartWorker) -> None:
    """Held: a client that leaves mid-stream, on a pair of DP workers (a rank each side),
    has both servers aborted by rid, the decode's connection closed and every rank's
    lease returned; so does one leaving while a logprob merge waits for the prefill."""
    closed, end = asyncio.Event(), asyncio.Event()
    prefill = await scripted(replies(http_response(DECODED)))
    prefill.probe_answer = info(disaggregation_mode="prefill", dp_size=2)
    decode = await scripted(_held(closed, True, end))
    decode.probe_answer = info(disaggregation_mode="decode", dp_size=2)
    try:
        async with pd_gateway([prefill], [decode]) as gw:
            await until(lambda: all(w.ranks for w in gw.registry), "ranks")
            port = int(gw.url.rsplit(":", 1)[1])
            for body in ({**CHAT, "stream": True}, {"text": "hi", "return_logprob": True}):
                if "text" in body:  # the prefill's answer (awaited for the merge) never comes
                    prefill.answer = _held(asyncio.Event(), True, end)  # head, no end
                path = "/generate" if "text" in body else "/v1/chat/completions"
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                request = orjson.dumps(body)
                writer.write(
                    b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                    % (path.encode(), len(request), request)
                )
                sent = len(prefill.inference)
                await until(lambda s=sent: len(prefill.inference) == s + 1, "sent")
                if "text" not in body:
                    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
                else:
                    await until(lambda: len(decode.inference) == 2, "the decode's too")
                writer.close()
                rid = orjson.loads(prefill.inference[-1].body)["rid"]
                await until(
                    lambda r=rid: (
                        {"rid": r} in [orjson.loads(a) for a in prefill.aborts]
                        and {"rid": r} in [orjson.loads(a) for a in decode.aborts]
                    ),
                    "both aborted",
                )
                await until(lambda: idle(gw), "every rank's lease returned")
            await asyncio.wait_for(closed.wait(), 3)
    finally:
        end.set()


async def test_admin_api_takes_workers_not_rank_targets_nor_odd_roles(
    scripted: StartWorker,
) -> None:
    """Held: a rank's target id is no worker for ``GET``/``DELETE``/drain (404, the worker
    untouched); ``worker_type`` and ``bootstrap_port`` of every odd JSON type are 400s."""
    worker = await scripted(replies(http_response(DECODED)))
    worker.probe_answer = info(dp_size=2)
    async with run_gateway([worker.url], worker_kind="sglang") as gw, aiohttp.ClientSession() as s:
        w = gw.registry.find(worker.url)
        assert w is not None
        await until(lambda: bool(w.ranks), "its ranks")
        rank = w.ranks[1].id
        for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/drain")):
            async with s.request(method, f"{gw.url}/workers/{rank}{path}") as resp:
                assert resp.status == 404, await resp.text()
        assert gw.registry.find(worker.url) is w and w.healthy
        for odd in ({"worker_type": "prefill"}, {"worker_type": ["regular"]}, {"kind": 3}):
            async with s.post(gw.url + "/workers", json={"url": worker.url, **odd}) as resp:
                assert resp.status == 400, (odd, await resp.text())
    prefill = await scripted(replies(http_response(DECODED)))
    prefill.probe_answer = info(disaggregation_mode="prefill")
    decode = await scripted(replies(http_response(DECODED)))
    decode.probe_answer = info(disaggregation_mode="decode")
    other = await scripted(replies(http_response(DECODED)))
    async with pd_gateway([prefill], [decode]) as gw, aiohttp.ClientSession() as s:
        odds: list[dict[str, Any]] = [
            {},
            {"worker_type": "regular"},
            {"worker_type": {"a": 1}},
            {"worker_type": "decode", "bootstrap_port": 8998},
            {"worker_type": "prefill", "bootstrap_port": True},
            {"worker_type": "prefill", "bootstrap_port": "8998"},
            {"worker_type": "prefill", "bootstrap_port": 0},
            {"worker_type": "prefill", "bootstrap_port": 2**70},
            {"worker_type": "prefill", "bootstrap_port": 8998.0},
        ]
        for odd in odds:
            async with s.post(gw.url + "/workers", json={"url": other.url, **odd}) as resp:
                assert resp.status == 400, (odd, await resp.text())
        async with s.post(gw.url + "/add_worker", params={"url": other.url}) as resp:
            assert resp.status == 400  # a role-less worker in PD mode
        assert gw.registry.find(other.url) is None


async def test_lying_server_info_is_bounded(scripted: StartWorker) -> None:
    """Held: ``dp_size`` huge, negative, a bool or a string, a bootstrap port out of
    range and odd version strings give a worker routed as one target (or its ranks up to
    64), the bootstrap port from the flag, and requests served."""
    lies: list[dict[str, Any]] = [
        {"dp_size": 10**9},
        {"dp_size": -4},
        {"dp_size": True},
        {"dp_size": "4"},
        {"dp_size": 65},
        {"dp_size": 64, "version": "\u0660.\u0665.\u0661\u0660"},
        {"dp_size": 2, "version": "v" + "9" * 63},
        {"dp_size": 2, "version": "0.5.9\r\nX: y"},
    ]
    for lie in lies:
        worker = await scripted(replies(http_response(DECODED)))
        worker.probe_answer = info(**lie)
        async with run_gateway([worker.url], worker_kind="sglang") as gw:
            w = gw.registry.find(worker.url)
            assert w is not None
            await until(lambda w=w: w.metadata.model is not None, "metadata read")
            dp = lie["dp_size"]
            expected = dp if type(dp) is int and 1 < dp <= 64 else 0
            assert len(w.ranks) == expected, lie
            status, body = await post(gw, "/v1/chat/completions", CHAT)
            assert status == 200, (lie, body)
            sent = orjson.loads(worker.inference[-1].body)
            pinned = sent.get("routed_dp_rank", sent.get("data_parallel_rank"))
            assert (pinned is not None) == bool(expected), (lie, sent)
            await until(lambda gw=gw: idle(gw), "leases returned")
    for port in (0, 70000, True, "8998", -1):
        prefill = await scripted(replies(http_response(DECODED)))
        prefill.probe_answer = info(
            disaggregation_mode="prefill", disaggregation_bootstrap_port=port
        )
        decode = await scripted(replies(http_response(DECODED)))
        decode.probe_answer = info(disaggregation_mode="decode")
        async with run_gateway(
            [], pd__enabled=True, pd__prefill=[prefill.url], pd__decode=[decode.url]
        ) as gw:
            await until(lambda gw=gw: all(w.metadata.model for w in gw.registry), "probed")
            status, body = await post(gw, "/generate", {"text": "hi"})
            assert status == 200, body
            assert orjson.loads(prefill.inference[-1].body)["bootstrap_port"] is None, port
