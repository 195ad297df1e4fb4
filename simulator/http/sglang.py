"""The HTTP API of one simulated SGLang 0.5.23 worker, over a :class:`WorkerModel`.

Routes (SGLANG_API.md §1, §7): health and readiness, server/model info, ``/v1/models``,
``/v1/loads`` (and ``/get_load`` in the 0.5.5 list shape with ``legacy_get_load``),
``/metrics`` (with ``enable_metrics``), ``/flush_cache``, ``/abort_request``, ``/generate``,
``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/tokenize``,
``/v1/detokenize``; plus the simulator-only ``/_sim/faults`` and ``/_sim/stats``.

It uses aiohttp's low-level server with a dict router (cheap per request; 404 and 405
bodies as FastAPI's) and ``handler_cancellation`` so that a client disconnect cancels the
handler, which aborts the request in the model (SGLang does it on its own too).

Request ids: ``rid`` from the body, else ``uuid4().hex``; the OpenAI ``id`` equals it; a
rid already in flight is a 400. Output text is the model's deterministic pseudo-text.
Reported latencies (metrics, ``e2e_latency``) are in modelled seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import shlex
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import orjson
import xxhash
from aiohttp import web

from simulator.config import SGLANG_VERSION, SimConfig
from simulator.faults import Faults
from simulator.http import api, metrics
from simulator.http.api import ApiError
from simulator.model.driver import DrivenModel, ModelDriver, RequestHandle
from simulator.model.radix_worker import WorkerModel
from simulator.model.requests import Finish, RequestOutput, SimRequest
from simulator.model.tokenizer import SimTokenizer, default_tokenizer

if TYPE_CHECKING:
    from simulator.http.kv_publisher import KVEventPublisher

logger = logging.getLogger(__name__)
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
JSON_TYPE = "application/json"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_MAX_INT = 2**63


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type=JSON_TYPE)


def route_table(
    table: list[tuple[str, tuple[str, ...], Handler]],
) -> dict[str, dict[str, Handler]]:
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


@dataclass
class _Gen:
    """One generation request, parsed."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    explicit_max: bool
    ignore_eos: bool
    namespace: str
    stream: bool


class HttpWorker:
    """What every personality of a simulated worker shares: the lifecycle, the dict router,
    the inference wrapper (stats, body parsing, faults), aborting a request whose handler
    leaves early, and the ``/_sim/faults`` control route. A personality builds its model,
    its routes and its 404/405 answers (:class:`SimulatedWorker`: SGLang;
    :class:`simulator.http.llamacpp.LlamaCppWorker`: llama.cpp's server)."""

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
        self.tokenizer: SimTokenizer = default_tokenizer()
        self._rng = random.Random(config.seed * 1_000_003 + index)
        self._driver: ModelDriver | None = None
        self._runner: web.ServerRunner | None = None
        self._routes = self._build_routes()
        self._started = time.time()
        self._stopping = False

    # ------------------------------------------------------------------ personality hooks
    def _driven_model(self) -> DrivenModel:
        raise NotImplementedError

    def _build_routes(self) -> dict[str, dict[str, Handler]]:
        raise NotImplementedError

    def _not_found(self, request: web.BaseRequest) -> web.StreamResponse:
        raise NotImplementedError

    def _method_not_allowed(self) -> web.StreamResponse:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared plumbing
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
            )

    def _text(self, handle: RequestHandle, start: int, end: int) -> str:
        return self.tokenizer.decode(handle.output_ids[start:end])

    @staticmethod
    def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
        value = body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise api.wrong_type(name, "integer", value)
        if not 0 <= value < _MAX_INT:
            raise ApiError(400, api.error_object(f"{name} must be >= 0", "BadRequest", 400))
        return int(value)

    @staticmethod
    def _token_ids(name: str, value: Any) -> list[int]:
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value
        ):
            raise api.wrong_type(name, "list of token ids", value)
        return value

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

    async def _sim_faults(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "POST":
            body = await self._json_body(request)
            try:
                self.faults.update(body)
            except (TypeError, ValueError) as exc:
                return json_response({"error": str(exc)}, 400)
        return json_response(self.faults.as_dict())

    async def _json_body(self, request: web.BaseRequest) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError as exc:
            raise api.json_invalid(exc.msg, exc.pos) from None
        if not isinstance(body, dict):
            raise api.wrong_type("body", "dictionary", body)
        return body


class SimulatedWorker(HttpWorker):
    """One simulated SGLang worker: model, driver, HTTP server, faults and stats.

    ``model`` is the served model name (what ``/v1/models`` reports); ``engine`` is the
    :class:`WorkerModel` (radix cache, queues, counters); ``faults`` and ``stats`` are the
    live objects behind ``/_sim/faults`` and ``/_sim/stats``.
    """

    def __init__(
        self, config: SimConfig, host: str = "127.0.0.1", port: int = 0, index: int = 0
    ) -> None:
        super().__init__(config, host, port, index)
        self.context_length = config.context_length or self.profile.context_length
        self.kv_events = self._kv_publisher(config, index)
        listener = self.kv_events.recorder if self.kv_events is not None else None
        self.engine = WorkerModel.from_config(config, listener=listener)

    def _driven_model(self) -> DrivenModel:
        return self.engine

    async def start(self) -> None:
        """Listen on ``host:port`` (0: an ephemeral port, then ``self.port`` is set)."""
        if self.kv_events is not None:
            self.kv_events.start()
        await super().start()

    async def stop(self, kill: bool = True) -> None:
        """Stop serving. ``kill``: like a killed process, open connections are cut at once."""
        await super().stop(kill)
        if self.kv_events is not None:
            await self.kv_events.close()

    def _not_found(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path.startswith("/v1/models/") and request.method == "GET":
            return self._model_card(path[len("/v1/models/") :])
        return json_response({"detail": "Not Found"}, 404)

    def _method_not_allowed(self) -> web.StreamResponse:
        return json_response({"detail": "Method Not Allowed"}, 405)

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def _kv_publisher(config: SimConfig, index: int) -> KVEventPublisher | None:
        """The KV event publisher when ``kv_events_config`` enables one (ports + index)."""
        if config.kv_events_config is None:
            return None
        from simulator.http.kv_publisher import KVEventPublisher, KVEventsConfig  # optional extra

        kv_config = KVEventsConfig.from_json(config.kv_events_config)
        if not kv_config.enabled:
            return None
        return KVEventPublisher(
            kv_config, config.page_size, offset=index, legacy_array=config.kv_events_legacy_array
        )

    # ------------------------------------------------------------------ routing
    def _build_routes(self) -> dict[str, dict[str, Handler]]:
        get, post = ("GET",), ("POST",)
        table: list[tuple[str, tuple[str, ...], Handler]] = [
            ("/health", get, self._health),
            ("/health_generate", get, self._health),
            ("/ping", get, self._ping),
            ("/ready", get, self._ping),
            ("/server_info", get, self._server_info),
            ("/get_server_info", get, self._server_info),
            ("/model_info", get, self._model_info),
            ("/get_model_info", get, self._model_info),
            ("/v1/models", get, self._models),
            ("/v1/loads", get, self._loads),
            ("/flush_cache", ("GET", "POST"), self._flush_cache),
            ("/abort_request", post, self._abort_request),
            ("/generate", ("POST", "PUT"), self._inference(self._generate, openai=False)),
            ("/v1/chat/completions", post, self._inference(self._chat, openai=True)),
            ("/v1/completions", post, self._inference(self._completions, openai=True)),
            ("/v1/embeddings", post, self._inference(self._embeddings, openai=True)),
            ("/v1/tokenize", post, self._tokenize),
            ("/tokenize", post, self._tokenize),
            ("/v1/detokenize", post, self._detokenize),
            ("/detokenize", post, self._detokenize),
            ("/_sim/faults", ("GET", "POST"), self._sim_faults),
            ("/_sim/stats", get, self._sim_stats),
        ]
        if self.config.enable_metrics:
            table.append(("/metrics", get, self._metrics))
        if self.config.legacy_get_load:
            table.append(("/get_load", get, self._get_load))
        return route_table(table)

    # ------------------------------------------------------------------ inference plumbing
    def _submit(self, gen: _Gen, stream_outputs: bool) -> RequestHandle:
        """Validate against the context length and queue; ValueError carries SGLang's text."""
        prompt_len = len(gen.prompt_ids)
        if prompt_len >= self.context_length:
            raise ValueError(api.context_too_long(prompt_len, self.context_length))
        max_new = gen.max_new_tokens
        eos_at: int | None = None
        if gen.explicit_max:
            if max_new + prompt_len >= self.context_length:
                raise ValueError(api.total_too_long(prompt_len, max_new, self.context_length))
        else:
            max_new = max(self.context_length - prompt_len - 1, 0)
            eos_at = min(self.config.natural_output_tokens, max_new) or None
        req = SimRequest(
            rid=gen.rid,
            prompt_ids=gen.prompt_ids,
            max_new_tokens=max_new,
            ignore_eos=gen.ignore_eos,
            eos_at=eos_at,
            namespace=gen.namespace,
            stream=stream_outputs,
        )
        return self.driver.submit(req)

    def _rid(self, body: dict[str, Any]) -> str:
        rid = body.get("rid")
        if rid is None:
            return uuid.uuid4().hex
        if not isinstance(rid, str):
            raise api.wrong_type("rid", "string", rid)
        return rid

    def _namespace(self, body: dict[str, Any]) -> str:
        lora = body.get("lora_path")
        model = body.get("model")
        if not lora and isinstance(model, str) and ":" in model:
            lora = model.split(":", 1)[1]
        extra, salt = body.get("extra_key"), body.get("cache_salt")
        parts = [str(lora or ""), str(extra or ""), str(salt or "")]
        return "\x1f".join(parts) if any(parts) else ""

    # ------------------------------------------------------------------ /generate
    async def _generate(self, request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        text, input_ids = body.get("text"), body.get("input_ids")
        if text is None and input_ids is None:
            message = "Either text, input_ids or input_embeds should be provided."
            raise ApiError(400, {"error": message})
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise api.wrong_type("sampling_params", "dictionary", params)
        stream = bool(body.get("stream", False))
        if input_ids is not None:
            batched = isinstance(input_ids, list) and bool(input_ids)
            batched = batched and isinstance(input_ids[0], list)
            if batched:
                prompts = [self._token_ids("input_ids", p) for p in input_ids]
            else:
                prompts = [self._token_ids("input_ids", input_ids)]
        elif isinstance(text, str):
            prompts, batched = [self.tokenizer.encode(text)], False
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            prompts, batched = [self.tokenizer.encode(t) for t in text], True
        else:
            raise api.wrong_type("text", "string", text)
        max_new = self._int(params, "max_new_tokens", 128)
        assert max_new is not None
        rid_value = body.get("rid")
        if batched:
            if stream:
                message = "The simulated worker does not stream batches."
                raise ApiError(400, {"error": {"message": message}})
            if isinstance(rid_value, list):
                rids = rid_value
            else:
                rids = [
                    f"{rid_value}_{i}" if rid_value else uuid.uuid4().hex
                    for i in range(len(prompts))
                ]
        else:
            rids = [self._rid(body)]
        gens = [
            _Gen(
                rid=str(rid),
                prompt_ids=prompt,
                max_new_tokens=max_new,
                explicit_max="max_new_tokens" in params,
                ignore_eos=bool(params.get("ignore_eos", False)),
                namespace=self._namespace(body),
                stream=stream,
            )
            for rid, prompt in zip(rids, prompts, strict=False)
        ]
        if stream:
            return await self._generate_stream(request, gens[0])
        handles: list[RequestHandle] = []
        try:
            for gen in gens:
                handles.append(self._submit(gen, stream_outputs=False))
        except ValueError as exc:
            for handle in handles:
                self._abort(handle.rid)
            return json_response({"error": {"message": str(exc)}}, 400)
        with contextlib.ExitStack() as stack:
            for handle in handles:
                stack.enter_context(self._aborting_on_exit(handle))
            for handle in handles:
                await self._wait_done(handle)
        outputs = []
        for handle in handles:
            finish = handle.finish
            if finish is not None and finish.status_code is not None:
                raise api.openai_error(finish.status_code, finish.message or "aborted")
            outputs.append(self._generate_body(handle, handle.completion_tokens))
        return json_response(outputs if batched else outputs[0])

    def _generate_body(self, handle: RequestHandle, n: int, text: str | None = None) -> Any:
        ids = list(handle.output_ids[:n])
        done = handle.done
        e2e = None
        if done and handle.finish_time is not None:
            e2e = round(handle.finish_time - handle.arrival, 6)
        return api.generate_output(
            rid=handle.rid,
            text=self.tokenizer.decode(ids) if text is None else text,
            output_ids=ids,
            finish=handle.finish if done else None,
            prompt_tokens=handle.prompt_tokens,
            completion_tokens=n,
            cached_tokens=handle.cached_tokens,
            e2e_latency=e2e,
            sent_ts=time.time() if done else None,
        )

    async def _generate_stream(self, request: web.BaseRequest, gen: _Gen) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            handle = self._submit(gen, stream_outputs=True)
        except ValueError as exc:
            await resp.write(api.generate_stream_error(str(exc)))
            await resp.write(api.DONE)
            return resp
        with self._aborting_on_exit(handle):
            sent = 0
            text = ""
            chunks = 0
            while True:
                await handle.wait()
                n = handle.completion_tokens
                if n > sent or handle.done:
                    text += self._text(handle, sent, n)
                    sent = n
                    await resp.write(api.sse(self._generate_body(handle, n, text)))
                    chunks += 1
                    if self._maybe_drop(request, chunks):
                        return resp
                if handle.done:
                    break
            await resp.write(api.DONE)
        return resp

    # ------------------------------------------------------------------ chat
    async def _chat(self, request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
        messages = body.get("messages")
        if messages is None:
            raise api.missing_field("messages", body)
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise api.wrong_type("messages", "list", messages)
        input_ids = body.get("input_ids")
        if input_ids is not None:
            prompt = self._token_ids("input_ids", input_ids)
        else:
            tools = body.get("tools")
            tools = tools if isinstance(tools, list) else None
            prompt = self.tokenizer.encode_chat(messages, tools)
        gen, model, include_usage, continuous = self._openai_common(body, prompt, None)
        if not gen.stream:
            handle = self._submit_openai(gen)
            with self._aborting_on_exit(handle):
                await self._wait_done(handle)
            finish = self._raise_for_status(handle.finish)
            u = self._usage(handle)
            text = self._text(handle, 0, handle.completion_tokens)
            created = int(time.time())
            return json_response(api.chat_response(gen.rid, created, model, text, finish, u))
        return await self._chat_stream(request, gen, model, include_usage, continuous)

    async def _chat_stream(
        self, request: web.BaseRequest, gen: _Gen, model: str, include_usage: bool, continuous: bool
    ) -> web.StreamResponse:
        handle = self._submit_openai(gen)
        created = int(time.time())
        rid = gen.rid
        with self._aborting_on_exit(handle):
            await handle.wait()  # SGLang pre-fetches the first output before answering
            self._raise_for_status(handle.finish if handle.completion_tokens == 0 else None)
            resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await resp.prepare(request)
            role = {"reasoning_content": None, "role": "assistant", "content": ""}
            await resp.write(api.chat_chunk(rid, created, model, role))
            chunks = 1
            if self._maybe_drop(request, chunks):
                return resp
            sent = 0
            while True:
                n = handle.completion_tokens
                delta = self._text(handle, sent, n) if n > sent else ""
                if delta:
                    u = self._usage(handle, n) if continuous else None
                    content = {"reasoning_content": None, "content": delta}
                    await resp.write(api.chat_chunk(rid, created, model, content, None, u))
                    chunks += 1
                    if self._maybe_drop(request, chunks):
                        return resp
                sent = n
                if handle.done:
                    break
                await handle.wait()
            finish = handle.finish
            if finish is not None and finish.status_code is not None:
                status = finish.status_code
                message = finish.message or "aborted"
                error = api.error_object(message, _status_name(status), status)
                await resp.write(api.sse({"error": error}))
            else:
                await resp.write(
                    api.chat_chunk(rid, created, model, {"reasoning_content": None}, finish)
                )
                if include_usage:
                    await resp.write(api.chat_usage_chunk(rid, created, model, self._usage(handle)))
            await resp.write(api.DONE)
        return resp

    def _openai_common(
        self, body: dict[str, Any], prompt: list[int], default_max: int | None
    ) -> tuple[_Gen, str, bool, bool]:
        n = self._int(body, "n", 1)
        if n != 1:
            message = "The simulated worker supports n=1 only."
            raise ApiError(400, api.error_object(message, "BadRequest", 400))
        max_tokens = self._int(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = self._int(body, "max_tokens", default_max)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise api.wrong_type("stream_options", "dictionary", options)
        model = body.get("model")
        gen = _Gen(
            rid=self._rid(body),
            prompt_ids=prompt,
            max_new_tokens=max_tokens if max_tokens is not None else 0,
            explicit_max=max_tokens is not None,
            ignore_eos=bool(body.get("ignore_eos", False)),
            namespace=self._namespace(body),
            stream=bool(body.get("stream", False)),
        )
        return (
            gen,
            model if isinstance(model, str) else self.model,
            bool(options.get("include_usage")),
            bool(options.get("continuous_usage_stats")),
        )

    def _submit_openai(self, gen: _Gen) -> RequestHandle:
        try:
            return self._submit(gen, stream_outputs=gen.stream)
        except ValueError as exc:
            raise api.bad_request(str(exc)) from None

    @staticmethod
    def _raise_for_status(finish: Finish | None) -> Finish | None:
        """A scheduler abort with a status code is an HTTP error (non-streaming)."""
        if finish is not None and finish.kind == "abort" and finish.status_code is not None:
            raise api.openai_error(finish.status_code, finish.message or "aborted")
        return finish

    def _usage(self, handle: RequestHandle, completion: int | None = None) -> dict[str, Any]:
        return api.usage(
            handle.prompt_tokens,
            handle.completion_tokens if completion is None else completion,
            handle.cached_tokens,
            self.config.enable_cache_report,
        )

    # ------------------------------------------------------------------ completions
    async def _completions(
        self, request: web.BaseRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        if "prompt" not in body:
            raise api.missing_field("prompt", body)
        prompts, texts = self._completion_prompts(body.get("prompt"))
        echo = bool(body.get("echo", False))
        first, model, include_usage, continuous = self._openai_common(body, prompts[0], 16)
        if len(prompts) > 1 and first.stream:
            raise api.bad_request("The simulated worker does not stream batches.")
        if first.stream:
            return await self._completions_stream(
                request, first, model, include_usage, continuous, texts[0] if echo else ""
            )
        gens = [first] + [
            dataclasses.replace(first, rid=f"{first.rid}_{i}", prompt_ids=p)
            for i, p in enumerate(prompts[1:], start=1)
        ]
        handles: list[RequestHandle] = []
        try:
            for gen in gens:
                handles.append(self._submit_openai(gen))
        except ApiError:
            for handle in handles:
                self._abort(handle.rid)
            raise
        with contextlib.ExitStack() as stack:
            for handle in handles:
                stack.enter_context(self._aborting_on_exit(handle))
            for handle in handles:
                await self._wait_done(handle)
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for i, handle in enumerate(handles):
            finish = self._raise_for_status(handle.finish)
            text = (texts[i] if echo else "") + self._text(handle, 0, handle.completion_tokens)
            choices.append(api.completion_choice(i, text, finish))
            prompt_tokens += handle.prompt_tokens
            completion_tokens += handle.completion_tokens
            cached += handle.cached_tokens
        u = api.usage(prompt_tokens, completion_tokens, cached, self.config.enable_cache_report)
        created = int(time.time())
        return json_response(api.completion_response(first.rid, created, model, choices, u))

    def _completion_prompts(self, prompt: Any) -> tuple[list[list[int]], list[str]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)], [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.tokenizer.encode(p) for p in prompt], list(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            ids = [self._token_ids("prompt", p) for p in prompt]
            return ids, [self.tokenizer.decode(p) for p in ids]
        if isinstance(prompt, list) and prompt:
            ids0 = self._token_ids("prompt", prompt)
            return [ids0], [self.tokenizer.decode(ids0)]
        raise api.wrong_type("prompt", "string", prompt)

    async def _completions_stream(
        self,
        request: web.BaseRequest,
        gen: _Gen,
        model: str,
        include_usage: bool,
        continuous: bool,
        echo_text: str,
    ) -> web.StreamResponse:
        created = int(time.time())
        rid = gen.rid
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            handle = self._submit(gen, stream_outputs=True)
        except ValueError as exc:
            error = api.error_object(str(exc), "BadRequestError", 400)
            await resp.write(api.sse({"error": error}))
            await resp.write(api.DONE)
            return resp
        with self._aborting_on_exit(handle):
            sent = 0
            chunks = 0
            pending_echo = echo_text
            while True:
                await handle.wait()
                n = handle.completion_tokens
                if n > sent or handle.done:
                    text = pending_echo + self._text(handle, sent, n)
                    pending_echo = ""
                    sent = n
                    finish = handle.finish if handle.done else None
                    if finish is not None and finish.status_code is not None:
                        error = api.error_object(
                            finish.message or "aborted",
                            _status_name(finish.status_code),
                            finish.status_code,
                        )
                        await resp.write(api.sse({"error": error}))
                        break
                    u = self._usage(handle, n) if continuous else None
                    choice = api.completion_choice(0, text, finish)
                    await resp.write(api.completion_chunk(rid, created, model, choice, u))
                    chunks += 1
                    if self._maybe_drop(request, chunks):
                        return resp
                if handle.done:
                    if include_usage:
                        u = self._usage(handle)
                        await resp.write(api.completion_usage_chunk(rid, created, model, u))
                    break
            await resp.write(api.DONE)
        return resp

    # ------------------------------------------------------------------ embeddings, tokens
    async def _embeddings(
        self, request: web.BaseRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        if "input" not in body:
            raise api.missing_field("input", body)
        value = body["input"]
        if isinstance(value, str):
            inputs = [self.tokenizer.encode(value)]
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            inputs = [self.tokenizer.encode(v) for v in value]
        elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            inputs = [self._token_ids("input", v) for v in value]
        elif isinstance(value, list) and value:
            inputs = [self._token_ids("input", value)]
        else:
            raise api.wrong_type("input", "string", value)
        data = [
            {"embedding": _embedding(ids), "index": i, "object": "embedding"}
            for i, ids in enumerate(inputs)
        ]
        total = sum(len(ids) for ids in inputs)
        u = {
            "prompt_tokens": total,
            "total_tokens": total,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        }
        return json_response(
            {"data": data, "model": self.config.model_path, "object": "list", "usage": u}
        )

    async def _tokenize(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        messages = body.get("messages")
        if messages is not None:
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise api.wrong_type("messages", "list", messages)
            tools = body.get("tools")
            tokens: Any = self.tokenizer.encode_chat(
                messages,
                tools if isinstance(tools, list) else None,
                bool(body.get("add_generation_prompt", True)),
            )
            count: Any = len(tokens)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                tokens = self.tokenizer.encode(prompt)
                count = len(tokens)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [self.tokenizer.encode(p) for p in prompt]
                count = [len(t) for t in tokens]
            else:
                raise api.missing_field("prompt", body)
        return json_response(
            {"tokens": tokens, "count": count, "max_model_len": self.context_length}
        )

    async def _detokenize(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        tokens = self._token_ids("tokens", body.get("tokens"))
        return json_response({"text": self.tokenizer.decode(tokens)})

    # ------------------------------------------------------------------ health and info
    async def _health(self, request: web.BaseRequest) -> web.StreamResponse:
        """Like SGLang: a 1-token generation of ``input_ids=[0]``; healthy once any output
        arrives from the model after the check started (so it waits behind a busy batch)."""
        if self.faults.fail_health or self._stopping:
            return web.Response(status=503)
        loop = asyncio.get_running_loop()
        started = loop.time()
        driver = self.driver
        seen: asyncio.Future[None] = loop.create_future()
        driver.activity.append(seen)
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        handle = driver.submit(
            SimRequest(rid=rid, prompt_ids=[0], max_new_tokens=1, stream=False),
            log_metrics=False,
        )
        try:
            await asyncio.wait_for(seen, self.config.health_check_timeout_s)
        except TimeoutError:
            return web.Response(status=503)
        finally:
            if not handle.done:
                driver.abort(rid)
        rest = self.profile.health_check_min_s - (loop.time() - started)
        if rest > 0:
            await asyncio.sleep(rest)
        return web.Response(status=200)

    async def _ping(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(status=503 if self.faults.fail_health or self._stopping else 200)

    def server_args(self) -> dict[str, Any]:
        """Resolved server arguments, SGLang's names (the subset a gateway may read)."""
        cfg, profile, engine = self.config, self.profile, self.engine
        return {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path,
            "served_model_name": self.model,
            "host": self.host,
            "port": self.port,
            "dtype": "bfloat16",
            "kv_cache_dtype": "auto",
            "page_size": cfg.page_size,
            "chunked_prefill_size": profile.chunked_prefill_size,
            "max_prefill_tokens": profile.max_prefill_tokens,
            "max_running_requests": engine.max_running_requests,
            "max_total_tokens": None,
            "max_queued_requests": None,
            "context_length": self.context_length,
            "mem_fraction_static": 0.85,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "ep_size": 1,
            "schedule_policy": cfg.schedule_policy,
            "schedule_conservativeness": 1.0,
            "radix_eviction_policy": "lru",
            "disable_radix_cache": False,
            "enable_mixed_chunk": profile.mixed_chunk,
            "enable_cache_report": cfg.enable_cache_report,
            "enable_metrics": cfg.enable_metrics,
            "decode_log_interval": 40,
            "stream_interval": 1,
            "kv_events_config": cfg.kv_events_config,
            "api_key": None,
            "random_seed": cfg.seed,
            "disaggregation_mode": "null",
            "enable_lora": False,
            "weight_version": api.WEIGHT_VERSION,
            "sim_profile": profile.name,
            "sim_speed": cfg.speed,
        }

    async def _server_info(self, request: web.BaseRequest) -> web.StreamResponse:
        args = self.server_args()
        capacity = self.engine.cache.capacity
        snap = self.engine.load_snapshot
        kv_gb = round(capacity * self.profile.kv_bytes_per_token / 2**30, 2)
        internal = {
            **args,
            "last_gen_throughput": round(snap.gen_throughput, 2),
            "memory_usage": {
                "weight": self.profile.weight_gb,
                "kvcache": kv_gb,
                "startup_available": self.profile.gpu_memory_gb,
                "token_capacity": capacity,
                "token_capacity_swa": None,
                "graph": {"cuda_graph": self.profile.graph_gb},
            },
            "effective_max_running_requests_per_dp": self.engine.max_running_requests,
        }
        return json_response(
            {
                **args,
                "status": "ready",
                "max_total_num_tokens": capacity,
                "max_req_input_len": min(self.context_length - 1, capacity - 1),
                "startup_time": self._started,
                "hicache_object_layout": None,
                "internal_states": [internal],
                "version": SGLANG_VERSION,
                "frontend": "python",
                "launch_command": " ".join(shlex.quote(a) for a in sys.argv),
                "kv_events": self.kv_events.descriptor() if self.kv_events else None,
            }
        )

    async def _model_info(self, request: web.BaseRequest) -> web.StreamResponse:
        cfg = self.config
        return json_response(
            {
                "model_path": cfg.model_path,
                "served_model_name": self.model,
                "tokenizer_path": cfg.model_path,
                "is_generation": True,
                "weight_version": api.WEIGHT_VERSION,
                "preferred_sampling_params": None,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.model,
            "parent": None,
            "max_model_len": self.context_length,
        }

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse:
        return json_response({"object": "list", "data": [self._card()]})

    def _model_card(self, name: str) -> web.StreamResponse:
        if name == self.model:
            return json_response(self._card())
        error = {
            "message": f"The model '{name}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return json_response({"error": error}, 404)

    # ------------------------------------------------------------------ load and metrics
    async def _loads(self, request: web.BaseRequest) -> web.StreamResponse:
        query = request.query
        include: set[str] | None = None
        if query.get("include"):
            include = {s.strip() for s in query["include"].split(",")}
            valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
            if not include <= valid:
                message = (
                    f"Invalid include sections: {include - valid}. Valid options: {sorted(valid)}"
                )
                raise api.openai_error(400, message)
        entry = self._load_entry(include)
        loads = [entry]
        if "dp_rank" in query:
            try:
                rank = int(query["dp_rank"])
            except ValueError:
                raise api.validation_error(
                    [
                        {
                            "type": "int_parsing",
                            "loc": ("query", "dp_rank"),
                            "msg": "Input should be a valid integer",
                            "input": query["dp_rank"],
                        }
                    ]
                ) from None
            loads = [entry] if rank == 0 else []
        if query.get("format") == "prometheus":
            return web.Response(
                body=_loads_prometheus(loads).encode(), content_type="text/plain", charset="utf-8"
            )
        return json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": SGLANG_VERSION,
                "accelerator": self.profile.accelerator,
                "num_accelerators": 1,
                "loads": loads,
            }
        )

    def _load_entry(self, include: set[str] | None) -> dict[str, Any]:
        snap = self.engine.load_snapshot
        counters = self.engine.counters
        entry: dict[str, Any] = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": snap.num_running_reqs,
            "num_waiting_reqs": snap.num_waiting_reqs,
            "num_waiting_uncached_tokens": snap.num_waiting_uncached_tokens,
            "num_used_tokens": snap.num_used_tokens,
            "num_total_tokens": snap.num_used_tokens + snap.num_waiting_tokens,
            "num_active_tokens": snap.num_active_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": snap.max_total_num_tokens,
            "max_running_requests": self.engine.max_running_requests,
            "token_usage": round(snap.token_usage, 4),
            "gen_throughput": round(snap.gen_throughput, 2),
            "cache_hit_rate": round(snap.cache_hit_rate, 4),
            "utilization": round(snap.utilization, 4),
            "total_prefill_uncached_tokens": counters.prefill_uncached_tokens,
            "total_prefill_busy_us": int(counters.prefill_busy_s * 1e6),
            "decode_moments": None,
        }
        if include is not None and "all" not in include and include == {"core"}:
            return entry
        sections = {
            "memory": (
                "memory",
                {
                    "weight_gb": self.profile.weight_gb,
                    "kv_cache_gb": round(
                        snap.max_total_num_tokens * self.profile.kv_bytes_per_token / 2**30, 3
                    ),
                    "graph_gb": self.profile.graph_gb,
                    "token_capacity": snap.max_total_num_tokens,
                },
            ),
            "disaggregation": (
                "disagg",
                {
                    "mode": "null",
                    "prefill_bootstrap_queue_reqs": 0,
                    "prefill_inflight_queue_reqs": 0,
                    "decode_prealloc_queue_reqs": 0,
                    "decode_transfer_queue_reqs": 0,
                    "decode_retracted_queue_reqs": 0,
                    "kv_transfer_speed_gb_s": 0.0,
                    "kv_transfer_latency_ms": 0.0,
                },
            ),
            "queues": (
                "queues",
                {
                    "waiting": snap.num_waiting_reqs,
                    "grammar": 0,
                    "paused": 0,
                    "retracted": snap.num_retracted_reqs,
                    "prealloc_ready": 0,
                },
            ),
        }
        for key, (token, section) in sections.items():
            if include is None or "all" in include or token in include:
                entry[key] = section
        return entry

    async def _get_load(self, request: web.BaseRequest) -> web.StreamResponse:
        snap = self.engine.load_snapshot
        return json_response(
            [
                {
                    "rid": None,
                    "http_worker_ipc": None,
                    "dp_rank": 0,
                    "num_reqs": snap.num_running_reqs + snap.num_waiting_reqs,
                    "num_waiting_reqs": snap.num_waiting_reqs,
                    "num_tokens": snap.num_used_tokens + snap.num_waiting_tokens,
                }
            ]
        )

    async def _metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        body = metrics.render(
            self.model,
            self.engine.metrics_snapshot,
            self.request_metrics,
            self.config.page_size,
            self.context_length,
        )
        return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})

    # ------------------------------------------------------------------ cache and abort
    async def _flush_cache(self, request: web.BaseRequest) -> web.StreamResponse:
        timeout = 0.0
        if "timeout" in request.query:
            with contextlib.suppress(ValueError):
                timeout = float(request.query["timeout"])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.engine.flush_cache():
            if loop.time() >= deadline:
                message = (
                    "Cache not flushed because there are pending requests. "
                    f"#queue-req: {self.engine.num_waiting}, "
                    f"#running-req: {self.engine.num_running + self.engine.num_prefilling}\n"
                )
                return web.Response(status=400, text=message)
            await asyncio.sleep(0.01)
        return web.Response(status=200, text=FLUSH_OK)

    async def _abort_request(self, request: web.BaseRequest) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError as exc:
            raise api.json_invalid(exc.msg, exc.pos) from None
        if isinstance(body, dict):
            if body.get("abort_all"):
                for rid in list(self.driver._handles):
                    if not rid.startswith("HEALTH_CHECK"):
                        self._abort(rid)
            elif isinstance(body.get("rid"), str) and body["rid"]:
                self._abort(body["rid"])
        return web.Response(status=200)

    # ------------------------------------------------------------------ simulator control
    async def _sim_stats(self, request: web.BaseRequest) -> web.StreamResponse:
        return json_response(self.sim_stats())

    def sim_stats(self) -> dict[str, Any]:
        engine = self.engine
        cache = engine.cache
        counters = engine.counters
        stats = dataclasses.asdict(self.stats)
        stats.update(
            {
                "running": engine.num_running + engine.num_prefilling,
                "waiting": engine.num_waiting,
                "model_time": self.driver.now() if self._driver is not None else 0.0,
                "kv_used_tokens": cache.used,
                "kv_evictable_tokens": cache.evictable,
                "kv_available_tokens": cache.available,
                "kv_capacity_tokens": cache.capacity,
                "kv_evicted_tokens_total": cache.evicted_total,
                "prompt_tokens_total": counters.prompt_tokens,
                "cached_tokens_total": counters.cached_tokens,
                "generation_tokens_total": counters.generation_tokens,
                "finished_total": counters.finished,
                "retractions_total": counters.retractions,
                "faults": self.faults.as_dict(),
            }
        )
        return stats


def _status_name(status: int) -> str:
    try:
        return HTTPStatus(status).name
    except ValueError:
        return str(status)


def _embedding(ids: list[int], dim: int = 16) -> list[float]:
    """A deterministic unit vector per token sequence (the simulator has no real model)."""
    h = xxhash.xxh64_intdigest(orjson.dumps(ids))
    rng = random.Random(h)
    vec = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
    norm = sum(v * v for v in vec) ** 0.5 or 1.0
    return [round(v / norm, 6) for v in vec]


def _loads_prometheus(loads: list[dict[str, Any]]) -> str:
    """``/v1/loads?format=prometheus``: ``sglang_<key>{dp_rank="r"}`` gauges."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        load = dict(load)
        rank = load.pop("dp_rank")
        for key, value in load.items():
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub_key, sub_value in value.items():
                    if isinstance(sub_value, int | float) and not isinstance(sub_value, bool):
                        samples.setdefault(f"sglang_{prefix}_{sub_key}", []).append(
                            (rank, sub_value)
                        )
            elif isinstance(value, int | float) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return "\n".join(lines) + "\n"
