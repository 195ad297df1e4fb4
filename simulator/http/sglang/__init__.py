"""The HTTP API of one simulated SGLang 0.5.23 worker, over a :class:`WorkerModel`.

Routes (SGLANG_API.md §1, §7): health and readiness, server/model info, ``/v1/models``,
``/v1/loads`` (and ``/get_load`` in the 0.5.5 list shape with ``legacy_get_load``),
``/metrics`` (with ``enable_metrics``), ``/flush_cache``, ``/abort_request``, the LoRA
adapter routes, ``/generate``,
``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/tokenize``,
``/v1/detokenize``; plus the simulator-only ``/_sim/faults`` and ``/_sim/stats``.

404 and 405 bodies are FastAPI's. A client disconnect aborts the request in the model
(SGLang does it on its own too); the server, the API key, the faults and ``/_sim/faults``
are :mod:`simulator.http.base`'s.

Request ids: ``rid`` from the body, else ``uuid4().hex``; the OpenAI ``id`` equals it; a
rid already in flight is a 400. Output text is the model's deterministic pseudo-text.
Reported latencies (metrics, ``e2e_latency``) are in modelled seconds.

Layout: :mod:`.core` (the model, the KV event publisher, request parsing and submission),
:mod:`.dp` (data-parallel ranks, ``dp_size``: dispatch, the requested rank, their KV
publishers' ports),
one module per route family (:mod:`.openai`: chat, completions, embeddings; :mod:`.native`:
``/generate``, tokenize, detokenize; :mod:`.info`: health, server and model info, loads,
metrics; :mod:`.admin`: ``/flush_cache``, ``/abort_request``, ``/_sim/stats``;
:mod:`.lora`: ``/load_lora_adapter``, ``/unload_lora_adapter``), and
:mod:`.worker`, whose :class:`SimulatedWorker` combines them and holds the route table.
"""

from simulator.http.sglang.worker import SimulatedWorker

__all__ = ["SimulatedWorker"]
