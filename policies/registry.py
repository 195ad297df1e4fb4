"""The only table from policy names to classes."""

from __future__ import annotations

from typing import Any

from policies.aibrix_prefix import AibrixPrefixPolicy
from policies.base import Policy
from policies.cache_aware import CacheAwarePolicy
from policies.consistent_hash import ConsistentHashPolicy
from policies.dynamo_kv import DynamoKvPolicy
from policies.least_load import LeastLoadPolicy
from policies.llmd_scorers import LlmdScorersPolicy
from policies.min_ttft import MinTtftPolicy
from policies.preble_e2 import PrebleE2Policy
from policies.random import RandomPolicy
from policies.round_robin import RoundRobinPolicy

DEFAULT_POLICY = "min_ttft"

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobinPolicy,
        RandomPolicy,
        LeastLoadPolicy,
        CacheAwarePolicy,
        ConsistentHashPolicy,
        MinTtftPolicy,
        # the peers' rules (docstrings cite each source), selectable for comparison
        DynamoKvPolicy,
        LlmdScorersPolicy,
        PrebleE2Policy,
        AibrixPrefixPolicy,
    )
}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def create_policy(name: str, **params: Any) -> Policy:
    """Build the named policy with its parameters; ``ValueError`` names what is wrong."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose one of {', '.join(policy_names())}"
        ) from None
    try:
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from None
