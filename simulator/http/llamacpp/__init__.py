"""The HTTP API of one simulated llama.cpp server (``SimConfig.engine = "llamacpp"``).

The shapes are those docs/REAL_ENGINE.md records of llama.cpp's server (xllamacpp
2026.10.11549), over a :class:`simulator.model.slots.SlotWorkerModel`:

* every response carries ``Server: llama.cpp``; unknown paths (``/server_info``,
  ``/v1/loads``, ``/abort_request``…) answer 404 ``File Not Found``;
* ``GET /health`` → ``{"status":"ok"}`` (also while every slot is busy; 503 with the
  ``fail_health`` fault); ``GET /props`` (``total_slots``,
  ``default_generation_settings.n_ctx`` per slot, ``model_alias``, ``model_path``…);
  ``GET /slots`` (``?fail_on_no_slot=1``: 503 when no slot is idle); ``GET /metrics``
  (``llamacpp:*``, with ``enable_metrics``); ``GET /v1/models`` (``owned_by: llamacpp``);
  ``POST /tokenize`` and ``/apply-template``;
* ``POST /v1/chat/completions`` and ``/v1/completions`` streamed or not, and the native
  ``POST /completion``: a prompt longer than a slot is a 400
  ``exceed_context_size_error``; the answer names the alias whatever ``model`` the
  request gave; ``usage.prompt_tokens_details.cached_tokens`` and ``timings``
  (``cache_n``, ``prompt_n``, ``prompt_ms``…, in modelled time; ``prompt_ms`` counts from
  arrival, so it includes a wait for a slot) on the plain answer, on the stream's finish
  chunk and on its ``include_usage`` chunk. A chat stream starts after prefill: the first
  event is ``delta: {"role": "assistant", "content": null}``, then the content deltas.
* No ``rid`` and no abort endpoint: closing the connection of a *streamed* request frees
  its slot; a plain request runs to its end even if its client left. After a streamed
  response the connection is closed (the real server does it without saying so; here it
  says ``Connection: close``).

Always reported, unlike SGLang's: cached tokens (no ``enable_cache_report`` needed). Not
modelled: sampling parameters, ``id_slot`` pinning, ``/slots`` save/restore, embeddings.

Layout: :mod:`.core` (the slot model, the ``Server`` header and 404s, request parsing,
``timings`` and ``usage``, running a request plain or streamed), :mod:`.completions` (the
three generation routes), :mod:`.info` (health, props, slots, models, metrics, tokenize,
apply-template, ``/_sim/stats``) and :mod:`.worker`, whose :class:`LlamaCppWorker` combines
them and holds the route table. The server, the faults and ``/_sim/faults`` are
:mod:`simulator.http.base`'s.
"""

from simulator.http.llamacpp.worker import LlamaCppWorker

__all__ = ["LlamaCppWorker"]
