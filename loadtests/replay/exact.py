"""Exact mode in the replay: the gateway's own KV-event consumer, fed by the simulated
workers' own KV events, a modelled delay after the step that produced them.

The live path is: the worker's radix cache → its event recorder
(``simulator.http.kv_publisher.EventRecorder``) → an ``EventBatch`` on ZMQ → the
gateway's decoder (``gateway.exact.wire.decode_batch``) → ``KVEventsManager`` (the exact
index, predicted blocks, modes) → ``RoutingCore`` through an ``ExactRequest``. The replay
keeps every piece but the socket: each worker's recorder is drained after each model step
(:meth:`~loadtests.replay.workers.ModelWorker.kv_batch`, encoded as the worker sends it),
and the batch is decoded and applied ``delay_s`` after the step ends (SGLang publishes a
batch's events once the batch ran; the delay stands for the publisher, the network and
the gateway's feed). Nothing peeks at a worker's cache.

Two public seams of the manager stand in for discovery and the feeds: a worker is
followed by giving it a ``kv_events`` descriptor directly (``follow``: no
``/server_info``, no ZMQ), and a decoded batch goes to ``apply_batch`` as a feed would
hand it.
What a request brings is its token ids (the replay tokenized it for the worker already):
:class:`KnownTokens` is ``gateway.exact.request.ExactRequest`` with its tokenization
done.

Cost: one msgpack encode and decode per step with events, one chained XXH3 of each new
block (the manager's index) and one per request (its match).
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from math import nan
from typing import Any, cast

from gateway.config import KVEventsConfig
from gateway.exact.index import Namespace
from gateway.exact.manager import KVEventsManager
from gateway.exact.wire import Descriptor, decode_batch
from simulator.model.radix_cache import decode_tokens
from simulator.model.tokenizer import default_tokenizer

DEFAULT_EVENT_DELAY_S = 0.02
_NO_NAMESPACE: Namespace = (None, None, None)


class KnownTokens:
    """``gateway.exact.request.ExactRequest`` for a request whose token ids are known:
    the same calls on the manager, without tokenizing a body (the routing core's
    ``ExactRequest`` protocol)."""

    __slots__ = ("_host", "_ids", "_mgr")

    def __init__(self, mgr: KVEventsManager, ids: list[int]) -> None:
        self._mgr, self._ids = mgr, ids
        self._host: dict[str, int] = {}

    def match(self, worker_ids: Sequence[str]) -> Mapping[str, int]:
        self._host = {}
        if not self._mgr.wants_tokens(worker_ids):
            return {}
        tiers = self._mgr.match_tiers(self._ids, _NO_NAMESPACE, worker_ids)
        self._host = {w: host for w, (_, host) in tiers.items() if host}
        return {w: tokens for w, (tokens, _) in tiers.items()}

    def host_tokens(self) -> Mapping[str, int]:
        return self._host

    def dispatched(self, worker_id: str) -> None:
        if self._mgr.wants_tokens([worker_id]):
            self._mgr.dispatched(worker_id, self._ids, _NO_NAMESPACE)

    def mode(self, worker_id: str) -> str:
        return self._mgr.mode(worker_id)

    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None:
        self._mgr.observe(worker_id, mode, predicted, reported)


class ReplayExact:
    """The gateway's :class:`KVEventsManager` following every replay worker, fed with
    their event batches ``delay_s`` after each step (module docstring)."""

    def __init__(
        self,
        worker_ids: Sequence[str],
        block_size: int,
        clock: Callable[[], float],
        hybrid: bool = True,
        delay_s: float = DEFAULT_EVENT_DELAY_S,
        host_tier: bool = True,
    ) -> None:
        """``host_tier``: read HiCache's host copies (``CPU_PINNED``) as a tier (False:
        the GPU's events only, as the gateway before issue 20)."""
        if delay_s < 0:
            raise ValueError("the event delay must not be negative")
        settings = replace(KVEventsConfig(), hybrid=hybrid)
        # no session: the replay never runs discovery (workers are followed below)
        session = cast(Any, None)
        self.manager = KVEventsManager(
            settings, default_tokenizer(), list, session, clock, host_tier=host_tier
        )
        for wid in worker_ids:
            desc = Descriptor("replay", 0, "", block_size, 1, None)
            self.manager.follow(wid, desc)
        self.delay_s = delay_s
        self._due: list[tuple[float, int, str, bytes]] = []  # (time, seq, worker, payload)
        self._seq = 0
        self.batches = 0

    def publish(self, worker_id: str, payload: bytes, step_end: float) -> None:
        """A worker's batch from the step ending at ``step_end``; applied after the delay."""
        self._seq += 1
        heapq.heappush(self._due, (step_end + self.delay_s, self._seq, worker_id, payload))

    def next_due(self) -> float | None:
        return self._due[0][0] if self._due else None

    def deliver(self, until: float) -> None:
        """Apply every batch due at or before ``until``, in order, as a feed would."""
        while self._due and self._due[0][0] <= until:
            _, _, wid, payload = heapq.heappop(self._due)
            ts, events, rank = decode_batch(payload)
            self.manager.apply_batch(wid, rank, ts, events)
            self.batches += 1

    def request(self, prompt_key: bytes) -> KnownTokens:
        """The exact-mode view of a request whose radix key (token ids) is ``prompt_key``."""
        return KnownTokens(self.manager, decode_tokens(prompt_key))

    def fidelity(self) -> dict[str, dict[str, float]]:
        """Predicted vs reported cached tokens per mode, summed over workers."""
        out: dict[str, dict[str, float]] = {}
        for (_, mode), f in self.manager.fidelity.items():
            agg = out.setdefault(
                mode,
                {
                    "requests": 0.0,
                    "predicted_tokens": 0.0,
                    "true_predicted_tokens": 0.0,
                    "reported_tokens": 0.0,
                },
            )
            agg["requests"] += f.requests
            agg["predicted_tokens"] += f.predicted_tokens
            agg["true_predicted_tokens"] += f.true_predicted_tokens
            agg["reported_tokens"] += f.reported_tokens
        for agg in out.values():
            predicted = agg["predicted_tokens"]
            agg["precision"] = agg["true_predicted_tokens"] / predicted if predicted else nan
        return out

    def close(self) -> None:
        """Release the manager's ZMQ context (no feed ever ran)."""
        asyncio.run(self.manager.close())
