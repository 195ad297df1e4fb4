"""Round robin: each candidate in turn.

Algorithm: a counter advanced on every call, taken modulo the number of candidates.
Cost: O(1). Trade-offs: perfectly even request counts, blind to load and to prefixes;
with a changing candidate set the rotation shifts but stays fair on average.
"""

from __future__ import annotations

from typing import ClassVar

from policies.base import REASON_ROUND_ROBIN, Decision, Policy, RouteContext


class RoundRobinPolicy(Policy):
    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, ctx: RouteContext) -> Decision:
        chosen = ctx.candidates[self._next % len(ctx.candidates)]
        self._next += 1
        return Decision(chosen.id, REASON_ROUND_ROBIN)
