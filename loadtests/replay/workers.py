"""The replay's handle on one simulated worker: the simulator's model, driven by the
replay's virtual clock (``simulator/model/radix_worker.py`` takes time as an argument,
never sleeps).

:class:`SimWorker` is the small surface the event loop needs; :class:`ModelWorker`
adapts the simulator's model to it without changing the model in any way. With
``kv_events`` the model's radix cache gets the simulated worker's own KV-event recorder
(``simulator.http.kv_publisher.EventRecorder``, the listener the HTTP worker publishes
from) and :meth:`ModelWorker.kv_batch` hands out what it recorded as the payload of one
``EventBatch``, encoded as the HTTP worker sends it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from policies.base import EngineLoad
from simulator.config import SimConfig
from simulator.http.kv_publisher import EventRecorder, encode_batch
from simulator.model.profiles import DEFAULT_PROFILE, Profile, get_profile
from simulator.model.radix_cache import TOKEN_BYTES
from simulator.model.radix_worker import WorkerModel
from simulator.model.requests import SimRequest


@dataclass(frozen=True, slots=True)
class SimOutput:
    """What a worker step made visible for one request at the end of the step."""

    rid: str
    first_token: bool
    finished: bool
    cached_tokens: int
    cached_host: int = 0  # of cached_tokens, loaded back from the host tier (HiCache)


class SimWorker(Protocol):
    def submit(self, rid: str, prompt_key: bytes, max_tokens: int, now: float) -> None:
        """Queue a request (the worker's scheduler decides when it runs)."""

    def step(self, now: float) -> tuple[float, list[SimOutput]] | None:
        """Run one scheduler step starting at ``now``: its duration and outputs visible at
        ``now + duration``; ``None`` when there is nothing to do."""

    def true_match(self, prompt_key: bytes) -> int:
        """Tokens of this prompt the worker's cache holds now, capped at prompt - 1 as
        its ``cached_tokens`` would be (no side effects)."""

    def queue_length(self) -> int:
        """Requests waiting or running."""

    def occupancy(self) -> float:
        """KV held by running requests, as a fraction of capacity (``token_usage``)."""

    def engine_load(self) -> EngineLoad:
        """What the worker's ``/v1/loads`` would report now."""

    def kv_batch(self, ts: float) -> bytes | None:
        """The KV events recorded since the last call, as one ``EventBatch`` payload
        stamped ``ts``; ``None`` when there are none or events are not recorded."""


class ModelWorker:
    """One simulated worker on the replay's virtual clock: the simulator's
    ``WorkerModel``, unchanged, behind :class:`SimWorker`.

    Requests are submitted with ``ignore_eos`` (the workload's output length, as the live
    client asks) and ``stream=False``: the model then reports only the first token and the
    finish, which is all the replay reads, and saves one output object per decode step;
    scheduling and timing do not depend on it.
    """

    def __init__(self, config: SimConfig, kv_events: bool = False) -> None:
        # exactly as the HTTP worker builds its engine from a SimConfig (and its recorder)
        self.recorder = EventRecorder(config.page_size) if kv_events else None
        self.model = WorkerModel.from_config(config, listener=self.recorder)

    def submit(self, rid: str, prompt_key: bytes, max_tokens: int, now: float) -> None:
        req = SimRequest(rid, prompt_key, max_new_tokens=max_tokens,
                         ignore_eos=True, stream=False)  # fmt: skip
        self.model.submit(req, now)

    def step(self, now: float) -> tuple[float, list[SimOutput]] | None:
        result = self.model.step(now)
        if result is None:
            return None
        outputs = [
            SimOutput(o.rid, o.first_token, o.finish is not None, o.cached_tokens, o.cached_host)
            for o in result.outputs
            if o.first_token or o.finish is not None
        ]
        return result.duration, outputs

    def true_match(self, prompt_key: bytes) -> int:
        # what the worker would report as cached_tokens now: at most prompt - 1 tokens
        return self.model.cache.peek_prefix(prompt_key[:-TOKEN_BYTES])

    def queue_length(self) -> int:
        return self.model.num_in_system

    def occupancy(self) -> float:
        # KV held by live requests (SGLang's token_usage); the pool itself, cached
        # prefixes included, is full soon after the start and says little
        cache = self.model.cache
        return cache.used / cache.capacity

    def engine_load(self) -> EngineLoad:
        """What ``/v1/loads`` would report now (the model's lagged snapshot)."""
        snap = self.model.load_snapshot
        return EngineLoad(
            running_requests=snap.num_running_reqs,
            waiting_requests=snap.num_waiting_reqs,
            waiting_uncached_tokens=snap.num_waiting_uncached_tokens,
            token_usage=snap.token_usage,
        )

    def kv_batch(self, ts: float) -> bytes | None:
        events = self.recorder.take() if self.recorder is not None else []
        return encode_batch(ts, events) if events else None


def resolve_profile(name: str | None) -> Profile:
    return get_profile(name or DEFAULT_PROFILE)


def prefill_time_fn(profile: str | None) -> Callable[[int, int], float]:
    """The profile's prefill latency ``(new, cached) -> seconds`` (for TTFT_LB and W)."""
    return resolve_profile(profile).prefill_time


def make_workers(
    count: int,
    capacity_tokens: int,
    profile: str | None,
    page_size: int = 1,
    kv_events: bool = False,
    hicache: Mapping[str, Any] | None = None,
) -> list[SimWorker]:
    """``count`` simulated workers of ``capacity_tokens`` KV each, configured as the HTTP
    simulator configures its workers (``simulator.config.SimConfig`` defaults), recording
    KV events if ``kv_events``; ``hicache``: the HiCache fields of ``SimConfig``
    (``enable_hierarchical_cache``, ``hicache_ratio``, ...)."""
    config = SimConfig(capacity_tokens=capacity_tokens, profile=resolve_profile(profile).name,
                       page_size=page_size, **dict(hicache or {}))  # fmt: skip
    return [ModelWorker(config, kv_events) for _ in range(count)]
