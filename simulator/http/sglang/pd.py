"""Prefill/decode disaggregation over HTTP: SGLang's ``--disaggregation-mode prefill|decode``
(docs/PD.md, "The simulated PD workers").

A server in a PD role takes SGLang's request fields ``bootstrap_host``, ``bootstrap_port``
and ``bootstrap_room`` (lists for a batch; single values are spread over a batch as
SGLang's ``io_struct`` does: the same host and port, rooms ``room + i``) and refuses a
request without a room with SGLang's 400 (``Invalid request: Disaggregated request
received without bootstrap room id. req.rid='…'``), unless its transfer backend is
``fake`` (decode only) or the host is SGLang's ``FAKE_BOOTSTRAP_HOST`` (2.2.2.2): then the
request is served alone, its KV "arriving" at once.

**The bootstrap server.** A prefill server listens on ``host:disaggregation_bootstrap_port``
(0: an ephemeral port, reported in ``/server_info``) as SGLang's does: ``GET /health``
answers ``OK``; ``GET /route`` answers SGLang's 400 without its four query parameters.
Where SGLang's ranks then talk ZMQ and RDMA, the simulated servers use one route of the
simulator's own, ``POST /_sim/pd/rooms/{room}`` with ``{"wait_s", "decode"}``: the decode
side's handshake (SGLang: its KV indices sent to the prefill's rank) and its long poll
for the room's KV; the answer is ``{"state": "waiting"|"done"|"failed"}`` with, when
done, ``prompt_tokens``, ``cached_tokens``, ``output_id``, or, when failed, ``reason``.

**Prefill**: the request waits (bootstrap queue) until its room's decode side has polled
once, at most ``bootstrap_timeout_s`` (SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``),
else it fails with SGLang's 500 ``Prefill bootstrap failed …``; then the model prefills it
with the radix cache and holds it while its KV moves (:mod:`simulator.model.disagg`,
:mod:`simulator.model.transfer`); the room is then done (or failed: the
``transfer_fail_rate`` fault, an abort), and the prefill answers with its one token and
``finish_reason`` length 0.

**Decode**: the handshake is retried once a (modelled) second, 15 times, as SGLang
fetches the prefill's layout, then fails with ``Decode handshake failed …``; then the
request long-polls its room for at most ``waiting_timeout_s``
(``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``; then ``Decode transfer failed … timed out …
in KVPoll.WaitingForInput``); a prefill whose bootstrap server stops answering twice,
5 modelled seconds apart (SGLang's heartbeat), fails it with ``Lost connection with
prefill instance``. When the room is done the model commits the KV (``cached_tokens`` =
the prefill's) and decodes. Every failure is a 500 scheduler abort, which each route
renders as SGLang does; ``sglang:num_bootstrap_failed_reqs_total`` and
``sglang:num_transfer_failed_reqs_total`` count them.

Limits: one DP rank; an abort on the decode side is not sent to the prefill (its
request completes); a decode that dies after its handshake leaves the prefill's transfer
succeeding (SGLang's would fail to send).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from simulator.config import SimConfig
from simulator.http import metrics
from simulator.http.base import Handler, json_response
from simulator.http.sglang.core import GenRequest
from simulator.http.sglang.dp import DPRank
from simulator.http.sglang.info import InfoRoutes
from simulator.model.disagg import (
    ABORTED,
    DecodeWorkerModel,
    Handoff,
    PrefillWorkerModel,
)
from simulator.model.driver import RequestHandle
from simulator.model.transfer import get_transfer_profile

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's disaggregation.utils.FAKE_BOOTSTRAP_HOST
HANDSHAKE_TRIES = 15  # SGLang's DecodePreallocQueue._max_ensure_retries
HANDSHAKE_INTERVAL_S = 1.0  # ..._ensure_retry_interval
HEARTBEAT_INTERVAL_S = 5.0  # SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL
HEARTBEAT_MAX_FAILURE = 2  # SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE
LONG_POLL_WALL_S = 5.0  # the longest single poll of a room (wall seconds)
ROOM_PATH = "/_sim/pd/rooms/"
InferenceHandler = Callable[[web.BaseRequest, Any], Awaitable[web.StreamResponse]]


# ---------------------------------------------------------------------- a request's fields
@dataclass
class BootstrapFields:
    """A request's bootstrap fields, handed out item by item to the ``_submit`` calls of
    one request (a batch's items in order)."""

    host: Any
    port: Any
    room: Any
    taken: int = 0

    def next(self) -> tuple[str | None, int | None, int | None]:
        i = self.taken
        self.taken += 1
        host = _item(self.host, i)
        port = _item(self.port, i)
        room: Any
        if isinstance(self.room, list):
            room = _item(self.room, i)
        else:
            room = None if self.room is None else self.room + i  # io_struct: room + i
        return (
            host if isinstance(host, str) else None,
            _int_or_none(port),
            _int_or_none(room),
        )


def _item(value: Any, i: int) -> Any:
    if isinstance(value, list):
        return value[i] if i < len(value) else None
    return value


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


_FIELDS: contextvars.ContextVar[BootstrapFields | None] = contextvars.ContextVar(
    "bootstrap_fields", default=None
)


# ---------------------------------------------------------------------- rooms and the server
@dataclass(eq=False)
class Room:
    """One bootstrap room on the prefill side."""

    room: int
    expires: float
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    handoff: Handoff | None = None
    reason: str | None = None  # the failure, as the decode side is told
    decode: str = ""  # the decode side's address (for SGLang's failure text)

    def conclude(self, handoff: Handoff | None, reason: str | None) -> None:
        if self.done.is_set():
            return
        self.handoff = handoff
        self.reason = reason
        self.done.set()

    def state(self) -> dict[str, Any]:
        if not self.done.is_set():
            return {"state": "waiting"}
        if self.handoff is None:
            return {"state": "failed", "reason": self.reason or ABORTED}
        h = self.handoff
        return {
            "state": "done",
            "prompt_tokens": h.prompt_tokens,
            "cached_tokens": h.cached_tokens,
            "output_id": h.output_id,
        }


class BootstrapServer:
    """A prefill server's bootstrap endpoint (see module docstring)."""

    def __init__(self, host: str, port: int, room_ttl_s: float, worker: PDRoutes) -> None:
        self.host = host
        self.port = port
        self.rooms: dict[int, Room] = {}
        self._ttl = room_ttl_s
        self._worker = worker
        self._runner: web.ServerRunner | None = None

    def room(self, room: int) -> Room:
        now = time.monotonic()
        found = self.rooms.get(room)
        if found is None:
            for key in [k for k, r in self.rooms.items() if r.expires < now]:
                del self.rooms[key]
            found = self.rooms[room] = Room(room, now + self._ttl)
        return found

    async def start(self) -> None:
        server = web.Server(self._dispatch, handler_cancellation=True, access_log=None)
        self._runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for site in list(runner.sites):
            await site.stop()
        if runner.server is not None:
            for transport in list(runner.server._connections.values()):
                transport.abort()
        await runner.cleanup()

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        if self._worker.faults.bootstrap_fail:
            return web.Response(status=503, text="Simulated fault: bootstrap server down")
        path = request.path
        if path == "/health" and request.method == "GET":
            return web.Response(text="OK")
        if path == "/route" and request.method == "GET":
            wanted = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
            if not all(request.query.get(k) for k in wanted):
                return web.Response(status=400, text="Missing inputs for bootstrap server.")
            return json_response({"rank_ip": self.host, "rank_port": self.port})
        if path.startswith(ROOM_PATH) and request.method == "POST":
            return await self._poll(request, path[len(ROOM_PATH) :])
        return web.Response(status=404, text="Not Found")

    async def _poll(self, request: web.BaseRequest, name: str) -> web.StreamResponse:
        try:
            room_id = int(name)
            body = orjson.loads(await request.read() or b"{}")
            wait = float(body.get("wait_s", 0.0))
        except (ValueError, TypeError, AttributeError, orjson.JSONDecodeError):
            return web.Response(status=400, text="bad room poll")
        room = self.room(room_id)
        room.decode = str(body.get("decode", ""))
        room.connected.set()
        if wait > 0 and not room.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room.done.wait(), wait)
        state = room.state()
        if state["state"] != "waiting":
            self.rooms.pop(room_id, None)
        return json_response(state)


# ---------------------------------------------------------------------- the routes' side
class PDRoutes(InfoRoutes):
    """The PD roles of a simulated SGLang server (see module docstring): the model of the
    role, the bootstrap fields, the prefill's bootstrap server, the decode's receiver,
    and what ``/server_info``, ``/model_info``, ``/v1/loads`` and ``/metrics`` say."""

    def __init__(
        self, config: SimConfig, host: str = "127.0.0.1", port: int = 0, index: int = 0
    ) -> None:
        super().__init__(config, host, port, index)
        self.pd_mode = config.disaggregation_mode
        self._pd_tasks: dict[str, asyncio.Task[None]] = {}
        self._room_of: dict[str, Room] = {}  # prefill: rid → its room
        self._failure_reason: dict[str, str] = {}  # prefill: rid → drawn transfer failure
        self._session: aiohttp.ClientSession | None = None
        self.bootstrap: BootstrapServer | None = None
        self.transfer_latency_ms = metrics.Histogram(_LATENCY_MS)
        self.transfer_speed_gb_s = metrics.Histogram(_SPEED_GB_S)
        self.transfer_total_mb = metrics.Histogram(_TOTAL_MB)
        self.prefill_model: PrefillWorkerModel | None = None
        self.decode_model: DecodeWorkerModel | None = None
        if self.pd_mode == "null":
            return
        listener = self.kv_events.recorder if self.kv_events is not None else None
        if self.pd_mode == "prefill":
            transfer = get_transfer_profile(config.transfer_profile)
            prefill = PrefillWorkerModel.build(config, transfer, listener, self.tokenizer)
            prefill.on_transfer_done = self._transfer_done
            self.prefill_model = prefill
            self.engine = prefill
            ttl = (config.bootstrap_timeout_s + config.waiting_timeout_s) / config.speed
            bootstrap_port = config.disaggregation_bootstrap_port
            if bootstrap_port:
                bootstrap_port += index
            self.bootstrap = BootstrapServer(host, bootstrap_port, ttl, self)
        else:
            decode = DecodeWorkerModel.build(config, listener, self.tokenizer)
            self.decode_model = decode
            self.engine = decode
        self.dp.ranks[0].engine = self.engine

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.bootstrap is not None:
            await self.bootstrap.start()
        if self.decode_model is not None:
            # one long poll per waiting request: no cap on connections to the prefills
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            await super().start()
        except BaseException:
            await self._stop_pd()
            raise

    async def stop(self, kill: bool = True) -> None:
        self._stopping = True
        await self._stop_pd()
        await super().stop(kill)

    async def _stop_pd(self) -> None:
        tasks = list(self._pd_tasks.values())
        self._pd_tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.bootstrap is not None:
            await self.bootstrap.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ requests
    def _inference(self, handler: InferenceHandler, openai: bool) -> Handler:
        if self.config.disaggregation_mode == "null":
            return super()._inference(handler, openai)

        async def with_fields(request: web.BaseRequest, body: Any) -> web.StreamResponse:
            fields = BootstrapFields(
                body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
            )
            token = _FIELDS.set(fields)
            try:
                result: web.StreamResponse = await handler(request, body)
                return result
            finally:
                _FIELDS.reset(token)

        return super()._inference(with_fields, openai)

    def _submit(self, gen: GenRequest, stream_outputs: bool) -> RequestHandle:
        model = self.prefill_model or self.decode_model
        if model is None:
            return super()._submit(gen, stream_outputs)
        fields = _FIELDS.get()
        host, port, room = fields.next() if fields is not None else (None, None, None)
        fake = host == FAKE_BOOTSTRAP_HOST or (
            self.decode_model is not None and self.config.disaggregation_transfer_backend == "fake"
        )
        rid = gen.rid
        if room is None and not fake:
            message = (
                "Invalid request: Disaggregated request received without bootstrap room id. "
                f"req.rid={rid!r}"
            )
            model.reject(rid, message)
        else:
            model.expect(rid)
        try:
            handle = super()._submit(gen, stream_outputs)
        finally:
            model.forget(rid)
        if not model.holds(rid):
            return handle
        if fake:
            self._serve_fake(rid)
        elif self.prefill_model is not None:
            assert room is not None
            self._spawn(rid, self._prefill_bootstrap(rid, room))
        else:
            assert host is not None and room is not None
            port = port if port is not None else self.config.disaggregation_bootstrap_port
            self._spawn(rid, self._decode_receive(rid, host, port, room))
        return handle

    def _spawn(self, rid: str, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._pd_tasks[rid] = task
        task.add_done_callback(lambda _: self._forget_task(rid, task))

    def _forget_task(self, rid: str, task: asyncio.Task[None]) -> None:
        if self._pd_tasks.get(rid) is task:
            del self._pd_tasks[rid]

    def _abort(self, rid: str) -> bool:
        aborted = super()._abort(rid)
        task = self._pd_tasks.pop(rid, None)
        if task is not None:
            task.cancel()
        return aborted

    def _wake(self) -> None:
        """The model's state changed outside a step: let the driver step again."""
        if self._driver is not None:
            self._driver._wake()

    def _serve_fake(self, rid: str) -> None:
        """SGLang's fake transfer: no partner; the KV "arrives" at once (cached 0)."""
        if self.prefill_model is not None:
            self.prefill_model.bootstrapped(rid)
        elif self.decode_model is not None:
            handle = self.driver.get(rid)
            prompt = handle.prompt_tokens if handle is not None else 0
            first = self.decode_model.planned_first(rid)
            self.decode_model.bootstrapped(rid)
            self.decode_model.kv_arrived(rid, Handoff(prompt, 0, first))
        self._wake()

    # ------------------------------------------------------------------ prefill side
    async def _prefill_bootstrap(self, rid: str, room_id: int) -> None:
        """Wait for the room's decode side, then let the model schedule the request."""
        model, bootstrap = self.prefill_model, self.bootstrap
        assert model is not None and bootstrap is not None
        room = bootstrap.room(room_id)
        self._room_of[rid] = room
        timeout = self.config.bootstrap_timeout_s
        try:
            await asyncio.wait_for(room.connected.wait(), timeout / self.config.speed)
        except TimeoutError:
            self._room_of.pop(rid, None)
            if bootstrap.rooms.get(room_id) is room:
                del bootstrap.rooms[room_id]
            reason = f"Request {room_id} timed out after {timeout:.1f}s in KVPoll.Bootstrapping"
            message = _failed("Prefill bootstrap", rid, room_id, reason, decode_side=False)
            if model.fail(rid, message, self.driver.now(), bootstrap=True):
                self._wake()
            return
        failure = None
        if (
            self.faults.transfer_fail_rate > 0
            and self._rng.random() < self.faults.transfer_fail_rate
        ):
            self.stats.faults_injected += 1
            reason = f"Failed to send kv chunk of {room_id} to {room.decode or 'decode'}"
            self._failure_reason[rid] = reason
            failure = _failed("Prefill transfer", rid, room_id, reason, decode_side=False)
        if model.bootstrapped(rid, failure):
            self._wake()

    def _transfer_done(self, rid: str, handoff: Handoff | None, failure: str | None) -> None:
        """The prefill model concluded ``rid``'s transfer (or aborted it)."""
        room = self._room_of.pop(rid, None)
        reason = self._failure_reason.pop(rid, None)
        if handoff is not None:
            seconds = handoff.transfer_s
            self.transfer_latency_ms.observe(seconds * 1e3)
            if seconds > 0:
                self.transfer_speed_gb_s.observe(handoff.nbytes / seconds / 1e9)
            self.transfer_total_mb.observe(handoff.nbytes / 1e6)
        if room is not None:
            room.conclude(handoff, None if handoff is not None else reason or failure)

    # ------------------------------------------------------------------ decode side
    async def _decode_receive(self, rid: str, host: str, port: int, room_id: int) -> None:
        """Handshake with the prefill's bootstrap server, wait for the room's KV, commit."""
        model = self.decode_model
        assert model is not None
        speed = self.config.speed
        addr = f"{host}:{port}"
        url = f"http://{addr}{ROOM_PATH}{room_id}"
        state: dict[str, Any] | None = None
        for attempt in range(HANDSHAKE_TRIES):
            state = await self._poll_room(url, 0.0)
            if state is not None:
                break
            if attempt + 1 < HANDSHAKE_TRIES:
                await asyncio.sleep(HANDSHAKE_INTERVAL_S / speed)
        if state is None:
            message = _failed("Decode handshake", rid, room_id, ABORTED, decode_side=True)
            self._decode_fail(rid, message, bootstrap=True)
            return
        model.bootstrapped(rid)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.config.waiting_timeout_s / speed
        misses = 0
        while state is None or state.get("state") == "waiting":
            remaining = deadline - loop.time()
            if remaining <= 0:
                elapsed = (loop.time() - started) * speed
                reason = (
                    f"Request {room_id} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput"
                )
                self._decode_fail(rid, _failed("Decode transfer", rid, room_id, reason))
                return
            state = await self._poll_room(url, min(remaining, LONG_POLL_WALL_S))
            if state is not None:
                misses = 0
                continue
            misses += 1
            if misses >= HEARTBEAT_MAX_FAILURE:
                reason = f"Lost connection with prefill instance (bootstrap_addr: {addr})"
                self._decode_fail(rid, _failed("Decode transfer", rid, room_id, reason))
                return
            await asyncio.sleep(min(HEARTBEAT_INTERVAL_S / speed, max(remaining, 0.0)))
        if state.get("state") == "done":
            handoff = Handoff(
                int(state["prompt_tokens"]), int(state["cached_tokens"]), int(state["output_id"])
            )
            if model.kv_arrived(rid, handoff):
                self._wake()
            return
        reason = str(state.get("reason") or ABORTED)
        self._decode_fail(rid, _failed("Decode transfer", rid, room_id, reason))

    def _decode_fail(self, rid: str, message: str, *, bootstrap: bool = False) -> None:
        model = self.decode_model
        assert model is not None
        if model.fail(rid, message, self.driver.now(), bootstrap=bootstrap):
            self._wake()

    async def _poll_room(self, url: str, wait_s: float) -> dict[str, Any] | None:
        """One handshake or long poll; None when the bootstrap server does not answer."""
        session = self._session
        assert session is not None
        timeout = aiohttp.ClientTimeout(total=wait_s + 5.0)
        try:
            async with session.post(
                url, json={"wait_s": wait_s, "decode": f"{self.host}:{self.port}"}, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    return None
                state: dict[str, Any] = await resp.json()
                return state
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    # ------------------------------------------------------------------ what the server says
    def server_args(self) -> dict[str, Any]:
        args = super().server_args()
        cfg = self.config
        port = cfg.disaggregation_bootstrap_port
        if self.bootstrap is not None:
            port = self.bootstrap.port
        args.update(
            {
                "disaggregation_mode": cfg.disaggregation_mode,
                "disaggregation_bootstrap_port": port,
                "disaggregation_transfer_backend": cfg.disaggregation_transfer_backend,
                "disaggregation_decode_enable_radix_cache": False,
                "disaggregation_decode_allocation_policy": "early",
                "disaggregation_ib_device": None,
            }
        )
        if self.pd_mode == "decode":
            args["disable_radix_cache"] = True
        if self.pd_mode != "null":
            args["sim_transfer_profile"] = cfg.transfer_profile
        return args

    async def _model_info(self, request: web.BaseRequest) -> web.StreamResponse:
        response = await super()._model_info(request)
        if self.pd_mode == "null" or not isinstance(response, web.Response):
            return response
        assert isinstance(response.body, bytes)
        info = orjson.loads(response.body)
        info["disaggregation_mode"] = self.pd_mode
        return json_response(info)

    def _load_entry(self, include: set[str] | None, rank: DPRank) -> dict[str, Any]:
        entry = super()._load_entry(include, rank)
        section = entry.get("disaggregation")
        if section is None or self.pd_mode == "null":
            return entry
        section["mode"] = self.pd_mode
        if self.prefill_model is not None:
            section["prefill_bootstrap_queue_reqs"] = self.prefill_model.num_bootstrap
            section["prefill_inflight_queue_reqs"] = self.prefill_model.num_inflight
            section["kv_transfer_speed_gb_s"] = round(self.prefill_model.pd.last_speed_gb_s, 4)
            section["kv_transfer_latency_ms"] = round(self.prefill_model.pd.last_latency_ms, 4)
        if self.decode_model is not None:
            section["decode_prealloc_queue_reqs"] = self.decode_model.num_prealloc
            section["decode_transfer_queue_reqs"] = self.decode_model.num_transfer
        return entry

    async def _metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        response = await super()._metrics(request)
        model = self.prefill_model or self.decode_model
        if model is None or not isinstance(response, web.Response):
            return response
        assert isinstance(response.body, bytes)
        # SGLang labels every series of a PD server with its role
        text = response.body.decode().replace(
            'engine_type="unified"', f'engine_type="{self.pd_mode}"'
        )
        labels = {
            "engine_type": self.pd_mode,
            "model_name": self.model,
            "moe_ep_rank": "0",
            "pp_rank": "0",
            "tp_rank": "0",
        }
        prefill, decode = self.prefill_model, self.decode_model
        gauges = (
            ("num_prefill_bootstrap_queue_reqs", prefill.num_bootstrap if prefill else 0),
            ("num_prefill_inflight_queue_reqs", prefill.num_inflight if prefill else 0),
            ("num_decode_prealloc_queue_reqs", decode.num_prealloc if decode else 0),
            ("num_decode_transfer_queue_reqs", decode.num_transfer if decode else 0),
        )
        lines: list[str] = []
        for key, value in gauges:
            name = f"sglang:{key}"
            metrics._family(lines, name, "gauge", _HELP[key])
            lines.append(f"{name}{metrics._labels(labels)} {metrics.floatToGoString(value)}")
        for key, value in (
            ("num_bootstrap_failed_reqs_total", model.pd.bootstrap_failed),
            ("num_transfer_failed_reqs_total", model.pd.transfer_failed),
        ):
            name = f"sglang:{key}"
            metrics._family(lines, name, "counter", _HELP[key])
            lines.append(f"{name}{metrics._labels(labels)} {metrics.floatToGoString(value)}")
        if prefill is not None:
            for key, hist in (
                ("kv_transfer_speed_gb_s", self.transfer_speed_gb_s),
                ("kv_transfer_latency_ms", self.transfer_latency_ms),
                ("kv_transfer_total_mb", self.transfer_total_mb),
            ):
                name = f"sglang:{key}"
                metrics._family(lines, name, "histogram", _HELP[key])
                metrics._histogram(lines, name, labels, hist)
        body = text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
        return web.Response(body=body.encode(), headers={"Content-Type": metrics.CONTENT_TYPE})


def _failed(what: str, rid: str, room: int, reason: str, *, decode_side: bool = True) -> str:
    """SGLang's abort message: ``{what} failed for request rank=0 {req}.rid='…'
    {req}.bootstrap_room=… with exception KVTransferError(bootstrap_room=…): reason``."""
    req = "decode_req.req" if decode_side else "req"
    return (
        f"{what} failed for request rank=0 {req}.rid={rid!r} {req}.bootstrap_room={room} "
        f"with exception KVTransferError(bootstrap_room={room}): {reason}"
    )


# observability/metrics_collector.py (0.5.23): buckets and help texts
_LATENCY_MS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
_SPEED_GB_S = (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)
_TOTAL_MB = (1, 5, 10, 50, 100, 500, 1000, 5000, 10000)
_HELP = {
    "num_prefill_bootstrap_queue_reqs": "The number of requests in the prefill bootstrap queue.",
    "num_prefill_inflight_queue_reqs": "The number of requests in the prefill inflight queue.",
    "num_decode_prealloc_queue_reqs": "The number of requests in the decode prealloc queue.",
    "num_decode_transfer_queue_reqs": "The number of requests in the decode transfer queue.",
    "num_bootstrap_failed_reqs_total": "The number of bootstrap failed requests.",
    "num_transfer_failed_reqs_total": "The number of transfer failed requests.",
    "kv_transfer_speed_gb_s": "Histogram of KV cache transfer speed in GB/s.",
    "kv_transfer_latency_ms": "Histogram of KV cache transfer latency in ms.",
    "kv_transfer_total_mb": "Histogram of KV cache transfer size in MB.",
}
