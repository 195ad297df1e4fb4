"""The policies a routing core runs: the live one, an optional A/B arm, shadows.

Contract:
- :class:`PolicySet` is immutable: a change of policy (``PUT /admin/policy``, SIGHUP)
  builds a new set and the core swaps it in one assignment between two decisions, so a
  request is decided, recorded and fed back under the set it started with.
- A/B: a request whose session hash (:func:`session_hash`: the routing key, else the
  prompt's first block; a request with neither stays in arm A) falls in ``ab_fraction``
  of the hash space is routed by ``ab`` (arm ``"B"``), the others by ``live`` (arm
  ``"A"``). The split is stable: the same session lands in the same arm on every gateway
  and after a restart. Without an A/B policy the arm is None.
- Shadows score the same views as the routing policy, each with an rng of its own (the
  live policy's random draws are unchanged by them), and never route.
- ``uses_prefix_match`` is true when any policy of the set matches prefixes: the index is
  then matched and maintained for every request, so a shadow or arm that reads it sees
  what it would see live.

Cost: one ``select`` per shadow per request (micro-seconds each, measured in
BENCHMARKS.md), and one hash per request with an A/B split.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import xxhash

from gateway.routing.request import RouteRequest
from policies.base import Policy

ARM_A = "A"
ARM_B = "B"
_HASH_SPACE = 1 << 32


@dataclass(frozen=True, slots=True)
class ShadowPick:
    """What a shadow policy would have done with a request."""

    policy: str
    worker: str
    reason: str
    matched_tokens: int  # the prefix believed cached on its pick
    estimated_ttft_s: float | None  # of its pick, by the gateway's TTFT estimate
    agrees: bool  # picked the worker the request was routed to

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "worker": self.worker,
            "reason": self.reason,
            "matched_tokens": self.matched_tokens,
            "estimated_ttft_s": self.estimated_ttft_s,
            "agrees": self.agrees,
        }


def session_hash(req: RouteRequest) -> int | None:
    """A stable 32-bit hash of the request's session: its routing key, else the first
    block of its prompt (the system prompt a conversation keeps); None with neither."""
    if req.routing_key:
        return xxhash.xxh64_intdigest(req.routing_key.encode()) & (_HASH_SPACE - 1)
    if req.block_hashes:
        return req.block_hashes[0] & (_HASH_SPACE - 1)
    return None


@dataclass(frozen=True)
class PolicySet:
    live: Policy
    shadows: tuple[Policy, ...] = ()
    ab: Policy | None = None
    ab_fraction: float = 0.0
    shadow_rngs: tuple[random.Random, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ab_fraction <= 1.0:
            raise ValueError("ab_fraction must be in 0..1")
        if len(self.shadow_rngs) != len(self.shadows):
            rngs = tuple(random.Random(i + 1) for i in range(len(self.shadows)))
            object.__setattr__(self, "shadow_rngs", rngs)

    @property
    def uses_prefix_match(self) -> bool:
        policies = (self.live, *self.shadows, *((self.ab,) if self.ab is not None else ()))
        return any(p.uses_prefix_match for p in policies)

    def arm(self, req: RouteRequest) -> tuple[str | None, Policy]:
        """The request's arm and the policy that routes it."""
        if self.ab is None:
            return None, self.live
        h = session_hash(req)
        if h is not None and h < self.ab_fraction * _HASH_SPACE:
            return ARM_B, self.ab
        return ARM_A, self.live

    def describe(self) -> dict[str, Any]:
        """For ``GET /admin/policy``, ``/debug`` and the dashboard."""
        return {
            "policy": self.live.describe(),
            "shadows": [p.describe() for p in self.shadows],
            "ab_policy": None if self.ab is None else self.ab.describe(),
            "ab_fraction": self.ab_fraction,
        }
