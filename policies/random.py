"""Random: a uniformly random candidate.

Algorithm: ``ctx.rng.choice``. Cost: O(1). Trade-offs: stateless and even in
expectation; blind to load and prefixes; the baseline every other policy must beat.
"""

from __future__ import annotations

from typing import ClassVar

from policies.base import REASON_RANDOM, Decision, Policy, RouteContext


class RandomPolicy(Policy):
    name: ClassVar[str] = "random"

    def select(self, ctx: RouteContext) -> Decision:
        return Decision(ctx.rng.choice(ctx.candidates).id, REASON_RANDOM)
