"""What the shortlist tests share: a fleet of SGLang workers in a registry, and a chat
request of given blocks (``test_candidate_shortlist``, ``test_min_ttft_shortlist``,
``test_shortlist_red_team``)."""

from __future__ import annotations

from gateway.routing.request import ApiKind, RouteRequest
from gateway.workers.registry import Worker, WorkerRegistry


def healthy_fleet(n: int, port: int) -> list[Worker]:
    """``n`` healthy workers on ports ``port``.., nothing in flight."""
    registry = WorkerRegistry(0.5, lambda: 10.0)
    for i in range(n):
        worker, _ = registry.add(f"http://127.0.0.1:{port + i}", "sglang")
        worker.flags.clear()
    return list(registry.candidates())


def chat_request(hashes: list[int], extra: int = 8) -> RouteRequest:
    """A chat request whose prompt is ``hashes``' blocks of 16 tokens + ``extra``."""
    tokens = 16 * len(hashes) + extra
    return RouteRequest(
        kind=ApiKind.CHAT, model=None, stream=False, include_usage=False,
        prompt_chars=4 * tokens, prompt_tokens=tokens, block_hashes=hashes, routing_key=None,
        rid=None, body=b"{}",
    )  # fmt: skip
