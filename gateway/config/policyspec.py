"""Policy specs on the command line and in YAML: ``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE``.

Contract: :func:`parse_policy_spec` splits a spec into the policy's name and its
constructor parameters, each value read as a YAML scalar (``0.5`` a number, ``true`` a
boolean, anything else a string), as ``--policy-arg`` reads them; ValueError names what
is malformed. Whether the name is a policy and the parameters fit it is checked where the
policy is built (``gateway.app.make_named_policy``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"cache_aware:cache_threshold=0.5"`` → (``"cache_aware"``, ``{"cache_threshold": 0.5}``)."""
    name, _, rest = spec.strip().partition(":")
    if not name:
        raise ValueError(f"policy spec {spec!r}: expected NAME or NAME:KEY=VALUE,...")
    try:
        params = parse_params(p for p in (p.strip() for p in rest.split(",")) if p)
    except ValueError as exc:
        raise ValueError(f"policy spec {spec!r}: {exc}") from None
    return name.strip(), params


def parse_params(pairs: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (``--policy-arg``, the replay's too), each value read as a YAML
    scalar; ValueError for a pair that is not ``KEY=VALUE``."""
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        try:
            params[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            params[key.strip()] = raw
    return params
