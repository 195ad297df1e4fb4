"""LoRA adapters on the request path: which workers may take a request naming one, and
the load call when none of them has it loaded.

Contract:
- The adapter a request names is :meth:`gateway.routing.request.RouteRequest.target`'s;
  the workers' loaded adapters are the registry's (``Worker.adapters``, re-read by the
  health checker from ``/v1/models``); :meth:`WorkerRegistry.candidates` already keeps only
  the workers holding the adapter whenever one of them is healthy.
- SGLang 0.5.23 answers 400 ("Got LoRA adapter that has never been loaded") to a request
  naming an adapter it never loaded, and reloads by itself one it loaded before (then
  evicted or unloaded); the gateway cannot see the latter, so when no candidate holds the
  adapter, ``lora.unloaded``:
  - ``load``: the candidates are the LoRA-enabled ones (the policy picks among them by
    prefix and load as usual); a chosen worker that lacks the adapter is sent
    ``POST /load_lora_adapter {"lora_name", "lora_path"}`` first, with the path the adapter
    was last seen loaded from on any worker ("already loaded" counts as success). Its answer
    (``loaded_adapters``) becomes that worker's adapter set at once;
  - ``reject``, or an adapter never seen on any worker, or no LoRA-enabled worker: OpenAI's
    404 ``model_not_found`` naming the adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import aiohttp
import orjson

from gateway.config import LoraConfig
from gateway.errors import GatewayError
from gateway.workers.registry import Worker, WorkerRegistry

LOAD_PATH = "/load_lora_adapter"


def adapter_not_found(adapter: str) -> GatewayError:
    """OpenAI's answer to an adapter no worker can serve: 404, ``model_not_found``."""
    return GatewayError(
        404,
        f"The LoRA adapter `{adapter}` is not loaded on any worker.",
        param="model",
        err_type="invalid_request_error",
        code="model_not_found",
    )


def lora_candidates(
    workers: Sequence[Worker], adapter: str, config: LoraConfig, registry: WorkerRegistry
) -> tuple[list[Worker], str | None]:
    """(the candidates for a request naming ``adapter``, the path to load it from on a
    chosen worker that lacks it: None when every candidate holds it). Raises the 404."""
    if all(adapter in w.adapters for w in workers):
        return list(workers), None
    path = registry.adapter_path(adapter)
    able = [w for w in workers if w.metadata.lora_enabled]
    if config.unloaded == "reject" or path is None or not able:
        raise adapter_not_found(adapter)
    return able, path


async def load_adapter(
    session: aiohttp.ClientSession,
    worker: Worker,
    adapter_path: tuple[str, str],
    config: LoraConfig,
    registry: WorkerRegistry,
    headers: Mapping[str, str],
) -> str | None:
    """Load the adapter ``(name, path)`` on ``worker``; None when it is there now, else
    why not."""
    adapter, path = adapter_path
    body = {"lora_name": adapter, "lora_path": path}
    try:
        async with session.post(
            worker.url + LOAD_PATH,
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=config.load_timeout_s),
            allow_redirects=False,
        ) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"{LOAD_PATH} failed: {exc or type(exc).__name__}"
    answer: object = None
    with contextlib.suppress(orjson.JSONDecodeError):
        answer = orjson.loads(raw)
    message = answer.get("error_message") if isinstance(answer, dict) else None
    if status != 200 and not (isinstance(message, str) and "already loaded" in message):
        return f"{LOAD_PATH} answered {status}: {message or raw[:200]!r}"
    loaded = answer.get("loaded_adapters") if isinstance(answer, dict) else None
    if isinstance(loaded, dict) and all(isinstance(v, str) for v in loaded.values()):
        registry.set_adapters(worker, {str(k): v for k, v in loaded.items()})
    else:
        registry.set_adapters(worker, {**worker.adapters, adapter: path})
    return None
