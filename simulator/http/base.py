"""What every personality of a simulated worker shares: server, routing, faults, control API.

:class:`HttpWorker` is one simulated inference server over a worker model that
:class:`simulator.model.driver.ModelDriver` drives on the event loop. A personality
(:class:`simulator.http.sglang.SimulatedWorker`: SGLang;
:class:`simulator.http.llamacpp.LlamaCppWorker`: llama.cpp's server) supplies its model, its
route table, its 404/405 answers and its ``/_sim/stats`` figures; this class supplies:

* the server: aiohttp's low-level server with a dict router (``{path: {method: handler}}``,
  cheap per request) and ``handler_cancellation``, so that a client disconnect cancels the
  handler, which aborts the request in the model (:meth:`HttpWorker._aborting_on_exit`);
* the API key check (``config.api_key``; ``/health*``, ``/ready*``, ``/metrics*`` and
  ``/_sim/`` stay open);
* the inference wrapper (:meth:`HttpWorker._inference`): counts the request in
  :class:`SimStats`, parses the JSON body, applies the faults, then calls the handler;
* the simulator's control API: ``GET|POST /_sim/faults`` (the live :class:`Faults`) and
  ``GET /_sim/stats`` (:meth:`HttpWorker.sim_stats`);
* helpers the handlers share: output text, waiting for the end, the mid-stream drop fault,
  reading a JSON body.

A malformed JSON body, an injected fault and an unexpected exception (500) are answered with
SGLang's error bodies (:mod:`simulator.http.api`) whatever the personality: llama.cpp's own
shapes for these are not modelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from simulator.config import SimConfig
from simulator.faults import Faults
from simulator.http import api, metrics
from simulator.http.api import ApiError
from simulator.model.driver import DrivenModel, ModelDriver, RequestHandle
from simulator.model.requests import RequestOutput
from simulator.model.tokenizer import WorkerTokenizer, worker_tokenizer

logger = logging.getLogger(__name__)
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
Route = tuple[str, tuple[str, ...], Handler]  # (path, methods, handler)
JSON_TYPE = "application/json"


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type=JSON_TYPE)


def route_table(table: list[Route]) -> dict[str, dict[str, Handler]]:
    """``{path: {method: handler}}`` from ``(path, methods, handler)`` rows."""
    routes: dict[str, dict[str, Handler]] = {}
    for path, methods, handler in table:
        for method in methods:
            routes.setdefault(path, {})[method] = handler
    return routes


@dataclass
class SimStats:
    """What ``GET /_sim/stats`` reports besides the model's live figures."""

    requests: int = 0  # inference requests received (before faults)
    aborts: int = 0  # via /abort_request, client disconnects and dropped streams
    faults_injected: int = 0
    in_flight: int = 0
    last_request_body: Any = None
    last_request_headers: dict[str, str] = field(default_factory=dict)
    last_request_path: str | None = None


class HttpWorker:
    """What every personality of a simulated worker shares (see module docstring)."""

    def __init__(
        self, config: SimConfig, host: str = "127.0.0.1", port: int = 0, index: int = 0
    ) -> None:
        config.validate()
        self.config = config
        self.host = host
        self.port = port
        self.index = index
        self.model: str = config.model_name
        self.profile = config.resolved_profile()
        self.faults: Faults = dataclasses.replace(config.faults)
        self.stats = SimStats()
        self.request_metrics = metrics.RequestMetrics()
        self.tokenizer: WorkerTokenizer = worker_tokenizer(
            config.tokenizer_path, config.chat_template
        )
        self._rng = random.Random(config.seed * 1_000_003 + index)
        self._driver: ModelDriver | None = None
        self._runner: web.ServerRunner | None = None
        self._routes = self._build_routes()
        self._started = time.time()
        self._stopping = False

    # ------------------------------------------------------------------ personality hooks
    def _driven_model(self) -> DrivenModel:
        """The worker model the driver runs (the personality builds it in ``__init__``)."""
        raise NotImplementedError

    def _build_routes(self) -> dict[str, dict[str, Handler]]:
        """The route table (:func:`route_table`). Called by ``__init__`` before the
        personality's own attributes exist: bind handlers here, do not call them."""
        raise NotImplementedError

    def _not_found(self, request: web.BaseRequest) -> web.StreamResponse:
        """The answer to a path not in the route table."""
        raise NotImplementedError

    def _method_not_allowed(self) -> web.StreamResponse:
        """The answer to a known path with a method it does not take."""
        raise NotImplementedError

    def sim_stats(self) -> dict[str, Any]:
        """What ``GET /_sim/stats`` answers: :class:`SimStats` and the model's live figures."""
        raise NotImplementedError

    # ------------------------------------------------------------------ lifecycle and dispatch
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def driver(self) -> ModelDriver:
        assert self._driver is not None, "worker not started"
        return self._driver

    async def start(self) -> None:
        """Listen on ``host:port`` (0: an ephemeral port, then ``self.port`` is set)."""
        self._driver = ModelDriver(self._driven_model(), self.config.speed, self._observe)
        self._driver.start()
        server = web.Server(self._dispatch, handler_cancellation=True, access_log=None)
        self._runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
        try:
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
            await site.start()
        except BaseException:
            await self.stop()
            raise
        self.port = self._runner.addresses[0][1]
        self._started = time.time()

    async def stop(self, kill: bool = True) -> None:
        """Stop serving. ``kill``: like a killed process, open connections are cut at once."""
        self._stopping = True
        runner = self._runner
        if runner is not None:
            for site in list(runner.sites):
                await site.stop()
            if kill and runner.server is not None:
                for transport in list(runner.server._connections.values()):
                    transport.abort()
        if self._driver is not None:
            await self._driver.stop()
        if runner is not None:
            await runner.cleanup()
        self._runner = None

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        methods = self._routes.get(path)
        if methods is None:
            return self._not_found(request)
        handler = methods.get(request.method)
        if handler is None:
            return self._method_not_allowed()
        key = self.config.api_key
        if (
            key
            and not path.startswith(("/health", "/ready", "/metrics", "/_sim/"))
            and request.headers.get("Authorization") != f"Bearer {key}"
        ):
            return json_response({"error": "Unauthorized"}, 401)
        try:
            return await handler(request)
        except ApiError as err:
            return json_response(err.body, err.status)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a simulator bug: answer like SGLang's serving_base
            logger.exception("unexpected error on %s", path)
            error = api.error_object(f"Internal server error: {exc}", "InternalServerError", 500)
            return json_response(error, 500)

    # ------------------------------------------------------------------ inference plumbing
    def _inference(
        self,
        handler: Callable[[web.BaseRequest, Any], Awaitable[web.StreamResponse]],
        openai: bool,
    ) -> Handler:
        async def run(request: web.BaseRequest) -> web.StreamResponse:
            stats = self.stats
            stats.requests += 1
            stats.in_flight += 1
            try:
                raw = await request.read()
                stats.last_request_headers = {str(k): v for k, v in request.headers.items()}
                stats.last_request_path = request.path
                if openai and request.content_type != JSON_TYPE:
                    raise api.unsupported_media_type()
                try:
                    body = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    raise api.json_invalid(exc.msg, exc.pos) from None
                stats.last_request_body = body
                await self._apply_faults()
                if not isinstance(body, dict):
                    raise api.validation_error(
                        [
                            {
                                "type": "model_attributes_type",
                                "loc": ("body",),
                                "msg": "Input should be a valid dictionary or object",
                                "input": body,
                            }
                        ]
                    )
                return await handler(request, body)
            except ConnectionResetError:
                # the client went away while we wrote; the request was aborted on the way out
                return web.Response(status=499)
            finally:
                stats.in_flight -= 1

        return run

    async def _apply_faults(self) -> None:
        faults = self.faults
        if faults.latency_s > 0:
            await asyncio.sleep(faults.latency_s)
        if faults.hang:
            self.stats.faults_injected += 1
            await asyncio.get_running_loop().create_future()  # until the client leaves
        if faults.should_fail(self._rng):
            self.stats.faults_injected += 1
            status = faults.error_status
            raise api.openai_error(status, f"Simulated fault: HTTP {status}")

    @contextlib.contextmanager
    def _aborting_on_exit(self, handle: RequestHandle) -> Iterator[RequestHandle]:
        """Abort the request in the model if the handler leaves before it finished."""
        try:
            yield handle
        finally:
            if not handle.done and self._driver is not None and not self._stopping:
                self._abort(handle.rid)

    def _abort(self, rid: str) -> bool:
        if self._driver is not None and self._driver.abort(rid):
            self.stats.aborts += 1
            self.request_metrics.observe_aborted()
            return True
        return False

    async def _wait_done(self, handle: RequestHandle) -> None:
        while not handle.done:
            await handle.wait()

    def _observe(self, handle: RequestHandle, out: RequestOutput) -> None:
        if not handle.log_metrics:
            return
        m = self.request_metrics
        if out.first_token:
            m.observe_first_token(handle.stream, out.time - out.arrival)
        if out.finish is not None:
            first = handle.first_token_time if handle.first_token_time is not None else out.time
            m.observe_finished(
                handle.stream,
                out.prompt_tokens,
                out.completion_tokens,
                out.cached_tokens,
                out.time - out.arrival,
                out.time - first,
                out.cached_host,
            )

    def _text(self, handle: RequestHandle, start: int, end: int) -> str:
        return self.tokenizer.decode(handle.output_ids[start:end])

    def _maybe_drop(self, request: web.BaseRequest, chunks: int) -> bool:
        """The ``drop_mid_stream_after`` fault: cut the connection after that many chunks."""
        limit = self.faults.drop_mid_stream_after
        if limit is None or chunks < limit:
            return False
        self.stats.faults_injected += 1
        transport = request.transport
        if transport is not None:
            transport.abort()
        return True

    # ------------------------------------------------------------------ simulator control
    def _control_routes(self) -> list[Route]:
        """The simulator's own routes, the same in every personality."""
        return [
            ("/_sim/faults", ("GET", "POST"), self._sim_faults),
            ("/_sim/stats", ("GET",), self._sim_stats),
        ]

    async def _sim_faults(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "POST":
            body = await self._json_body(request)
            try:
                self.faults.update(body)
            except (TypeError, ValueError) as exc:
                return json_response({"error": str(exc)}, 400)
        return json_response(self.faults.as_dict())

    async def _sim_stats(self, request: web.BaseRequest) -> web.StreamResponse:
        return json_response(self.sim_stats())

    async def _json_body(self, request: web.BaseRequest) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError as exc:
            raise api.json_invalid(exc.msg, exc.pos) from None
        if not isinstance(body, dict):
            raise api.wrong_type("body", "dictionary", body)
        return body
