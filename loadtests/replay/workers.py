"""The replay's handle on one simulated worker: the simulator's model, driven by the
replay's virtual clock (``simulator/model/radix_worker.py`` takes time as an argument,
never sleeps).

:class:`SimWorker` is the small surface the event loop needs; :class:`ModelWorker`
adapts the simulator's model to it without changing the model in any way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from policies.base import EngineLoad
from simulator.model.profiles import DEFAULT_PROFILE, Profile, get_profile


@dataclass(frozen=True, slots=True)
class SimOutput:
    """What a worker step made visible for one request at the end of the step."""

    rid: str
    first_token: bool
    finished: bool
    cached_tokens: int


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


def resolve_profile(name: str | None) -> Profile:
    return get_profile(name or DEFAULT_PROFILE)


def prefill_time_fn(profile: str | None) -> Callable[[int, int], float]:
    """The profile's prefill latency ``(new, cached) -> seconds`` (for TTFT_LB and W)."""
    return resolve_profile(profile).prefill_time


def make_workers(count: int, capacity_tokens: int, profile: str | None) -> list[SimWorker]:
    """``count`` simulated workers of ``capacity_tokens`` KV each, configured as the HTTP
    simulator configures its workers (``simulator.config.SimConfig`` defaults)."""
    from loadtests.replay.model import ModelWorker
    from simulator.config import SimConfig

    config = SimConfig(capacity_tokens=capacity_tokens, profile=resolve_profile(profile).name)
    return [ModelWorker(config) for _ in range(count)]
