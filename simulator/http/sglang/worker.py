"""The simulated SGLang worker: the route families combined, and the one route table."""

from __future__ import annotations

from aiohttp import web

from simulator.http.base import Handler, Route, json_response, route_table
from simulator.http.sglang.admin import AdminRoutes
from simulator.http.sglang.info import InfoRoutes
from simulator.http.sglang.lora import LoraRoutes
from simulator.http.sglang.native import NativeRoutes
from simulator.http.sglang.openai import OpenAIRoutes
from simulator.http.sglang.pd import PDRoutes


class SimulatedWorker(PDRoutes, OpenAIRoutes, NativeRoutes, InfoRoutes, AdminRoutes, LoraRoutes):
    """One simulated SGLang worker: model, driver, HTTP server, faults and stats.

    ``model`` is the served model name (what ``/v1/models`` reports); ``engine`` is the
    :class:`WorkerModel` (radix cache, queues, counters); ``faults`` and ``stats`` are the
    live objects behind ``/_sim/faults`` and ``/_sim/stats``.
    """

    def _build_routes(self) -> dict[str, dict[str, Handler]]:
        get, post = ("GET",), ("POST",)
        table: list[Route] = [
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
            ("/load_lora_adapter", post, self._load_lora_adapter),
            ("/unload_lora_adapter", post, self._unload_lora_adapter),
            ("/generate", ("POST", "PUT"), self._inference(self._generate, openai=False)),
            ("/v1/chat/completions", post, self._inference(self._chat, openai=True)),
            ("/v1/completions", post, self._inference(self._completions, openai=True)),
            ("/v1/embeddings", post, self._inference(self._embeddings, openai=True)),
            ("/v1/tokenize", post, self._tokenize),
            ("/tokenize", post, self._tokenize),
            ("/v1/detokenize", post, self._detokenize),
            ("/detokenize", post, self._detokenize),
            *self._control_routes(),
        ]
        if self.config.enable_metrics:
            table.append(("/metrics", get, self._metrics))
        if self.config.legacy_get_load:
            table.append(("/get_load", get, self._get_load))
        return route_table(table)

    def _not_found(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path.startswith("/v1/models/") and request.method == "GET":
            return self._model_card(path[len("/v1/models/") :])
        return json_response({"detail": "Not Found"}, 404)

    def _method_not_allowed(self) -> web.StreamResponse:
        return json_response({"detail": "Method Not Allowed"}, 405)
