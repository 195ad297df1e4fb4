"""The only table from workload names to factories, and ``key=value`` argument parsing.

Every factory takes keyword parameters with defaults and returns a :class:`Workload`.
``create_workload(name, ["k=v", ...])`` converts each value to the parameter's annotated
type (int, float, bool, str), so CLIs (``--workload NAME --workload-arg k=v``) and Locust
custom arguments share one parser.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from loadtests.workloads.agentic import agentic
from loadtests.workloads.base import Workload
from loadtests.workloads.lora import lora_tenants
from loadtests.workloads.multi_tenant import llmd_tenants, multi_tenant
from loadtests.workloads.multi_turn import multi_turn
from loadtests.workloads.rollouts import rollouts
from loadtests.workloads.shared_prefix import generated_shared_prefix
from loadtests.workloads.traces import (
    MOONCAKE_SYNTHETIC,
    azure_trace,
    mooncake_trace,
)

WorkloadFactory = Callable[..., Workload]


def _mooncake_synthetic(
    path: str = str(MOONCAKE_SYNTHETIC),
    speed: float = 1.0,
    limit: int = 0,
    seed: int = 0,
    session_block: int = -1,
) -> Workload:
    return mooncake_trace(
        path=path, speed=speed, limit=limit, seed=seed, session_block=session_block
    )


WORKLOADS: Mapping[str, WorkloadFactory] = MappingProxyType(
    {
        "generated-shared-prefix": generated_shared_prefix,
        "multi-turn": multi_turn,
        "multi-tenant": multi_tenant,
        "tenants": llmd_tenants,
        "lora-tenants": lora_tenants,
        "agentic": agentic,
        "rollouts": rollouts,
        "mooncake": mooncake_trace,
        "mooncake-conversation": mooncake_trace,
        "mooncake-synthetic": _mooncake_synthetic,
        "azure": azure_trace,
    }
)


def workload_names() -> list[str]:
    return sorted(WORKLOADS)


def _convert(value: str, kind: Any) -> Any:
    if kind is bool:
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    if kind in (int, float):
        return kind(value)
    return value


def parse_args(factory: WorkloadFactory, args: Iterable[str]) -> dict[str, Any]:
    """``["k=v", ...]`` → typed keyword arguments of ``factory``; ``ValueError`` if bad."""
    hints = typing.get_type_hints(factory)
    known = set(inspect.signature(factory).parameters)
    params: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            raise ValueError(f"bad workload argument {arg!r}; known: {', '.join(sorted(known))}")
        params[key] = _convert(value, hints.get(key, str))
    return params


def create_workload(name: str, args: Iterable[str] = (), **params: Any) -> Workload:
    """Build the named workload from ``k=v`` strings and/or typed keyword parameters."""
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; choose one of {', '.join(workload_names())}"
        ) from None
    merged = {**parse_args(factory, args), **params}
    return factory(**merged)
