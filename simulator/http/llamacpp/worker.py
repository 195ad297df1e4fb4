"""The simulated llama.cpp server: the route families combined, and the one route table."""

from __future__ import annotations

from simulator.http.base import Handler, Route, route_table
from simulator.http.llamacpp.completions import LlamaCompletionRoutes
from simulator.http.llamacpp.info import LlamaInfoRoutes


class LlamaCppWorker(LlamaCompletionRoutes, LlamaInfoRoutes):
    """One simulated llama.cpp server: ``engine`` is the :class:`SlotWorkerModel`."""

    def _build_routes(self) -> dict[str, dict[str, Handler]]:
        get, post = ("GET",), ("POST",)
        table: list[Route] = [
            ("/health", get, self._health),
            ("/v1/health", get, self._health),
            ("/props", get, self._props),
            ("/slots", get, self._slots),
            ("/v1/models", get, self._models),
            ("/models", get, self._models),
            ("/v1/chat/completions", post, self._inference(self._chat, openai=False)),
            ("/chat/completions", post, self._inference(self._chat, openai=False)),
            ("/completion", post, self._inference(self._completion, openai=False)),
            ("/v1/completions", post, self._inference(self._text_completion, openai=False)),
            ("/completions", post, self._inference(self._text_completion, openai=False)),
            ("/tokenize", post, self._tokenize),
            ("/apply-template", post, self._apply_template),
            *self._control_routes(),
        ]
        if self.config.enable_metrics:
            table.append(("/metrics", get, self._metrics))
        return route_table(table)
