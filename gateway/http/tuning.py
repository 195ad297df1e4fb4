"""Tuning routing on live traffic: change the policy without a restart, read the A/B
arms, export recent traffic for the offline replay.

Contract:
- :class:`PolicyControl` applies a new ``policy`` section: validated as at start
  (``gateway.config.policy_config_from_dict``, then every policy of the set built by the
  composition root's factory), then every policy of a second build of the set rehearses
  a few decisions on made-up views (:func:`rehearse`): parameters the constructors accept
  but ``select`` chokes on (a float ring size, an infinite or NaN factor) would otherwise
  fail every request, a shadow's included. A bad change raises ConfigError with the
  reason and the running set stays; a good one is swapped into the routing core in one assignment
  between two decisions (``RoutingCore.configure``). Every attempt is logged and counted
  (``gateway_policy_changes_total{result}``) and listed for the dashboard.
- Only the top-level policy set changes: the sets of ``models:`` entries with a policy
  of their own are fixed at start (``GET /admin/policy`` lists them under ``models``),
  and their requests keep being routed by them whatever is changed here.
- ``GET /admin/policy``: the running set and its config, and the recent changes.
  ``PUT /admin/policy``: a JSON object of ``policy`` keys merged over the running
  section (``{"name": "cache_aware", "params": {...}}``, ``"shadows": [...]``,
  ``"ab_policy"``, ``"ab_fraction"``); 200 with the new set, 400 (OpenAI-style) with the
  reason. SIGHUP re-reads the YAML file and flags and applies their ``policy`` section
  (``gateway.cli``).
- ``GET /debug/ab``: the arms' figures with 95 % intervals and a verdict per figure
  (``gateway.telemetry.tuning.ABStats``).
- ``GET /debug/trace?since=UNIX_SECONDS``: recent successful requests as a Mooncake JSONL
  trace (``python -m loadtests.replay --trace FILE``): arrival times, 512-token block ids
  from the gateway's chained hashes, reported token counts; never prompt text.
Every route here is under ``/admin`` or ``/debug``: the admin key guards them.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from gateway.config import ConfigError, PolicyConfig, policy_config_from_dict
from gateway.errors import GatewayError
from gateway.routing.decide import RoutingCore, Shortlist
from gateway.routing.policy_set import PolicySet
from gateway.telemetry.tuning import TuningTelemetry
from policies.base import Policy, RouteContext, WorkerView

log = logging.getLogger(__name__)

TUNING = web.AppKey("tuning", TuningTelemetry)
_MAX_BODY = 64 * 1024


class PolicyControl:
    """The running policy section, and the one way to change it."""

    def __init__(
        self,
        config: PolicyConfig,
        core: RoutingCore,
        build: Callable[[PolicyConfig], PolicySet],
        tuning: TuningTelemetry,
        on_change: Callable[[PolicySet], None] | None = None,
    ) -> None:
        self.config = config
        self._core = core
        self._build = build
        self._tuning = tuning
        self._on_change = on_change
        tuning.running = core.policies.describe()

    def describe(self) -> dict[str, Any]:
        return {
            "running": self._core.policies.describe(),
            "config": _plain(dataclasses.asdict(self.config)),
            "changes": list(self._tuning.recent_changes),
            # models: entries' own sets; a change here leaves them (they need a restart)
            "models": {m: s.describe() for m, s in self._core.model_policies.items()},
        }

    def update(self, changes: Mapping[str, Any], source: str) -> PolicySet:
        """Merge ``changes`` (policy keys) over the running section and apply it."""
        merged = {**dataclasses.asdict(self.config), **changes}
        try:
            cfg = policy_config_from_dict(merged)
        except ConfigError as exc:
            self.refused(source, str(exc))
            raise
        return self.apply(cfg, source)

    def apply(self, cfg: PolicyConfig, source: str) -> PolicySet:
        """Build, rehearse and swap in ``cfg``'s policy set; ConfigError leaves the running
        one."""
        try:
            rehearse(self._build(cfg))  # a copy: the set swapped in starts with fresh state
            policies = self._build(cfg)
        except ConfigError as exc:
            self.refused(source, str(exc))
            raise
        self._core.configure(policies)
        self._core.shortlist = Shortlist(cfg.shortlist_above, cfg.shortlist_least_loaded)
        self.config = cfg
        if self._on_change is not None:
            self._on_change(policies)
        described = policies.describe()
        self._tuning.changed(source, described, None)
        log.warning("policy changed (%s): %s", source, orjson.dumps(described).decode())
        return policies

    def refused(self, source: str, reason: str) -> None:
        self._tuning.changed(source, None, reason)
        log.warning("policy change refused (%s): %s", source, reason)


def _rehearsal_contexts() -> list[RouteContext]:
    """Made-up decisions covering the paths policies take: one candidate; idle workers and
    no match nor key; loaded workers, partial matches and a routing key."""
    rng = random.Random(0)
    idle = [WorkerView("rehearsal-a"), WorkerView("rehearsal-b")]
    busy = [
        WorkerView("rehearsal-a", in_flight=0, matched_tokens=0),
        WorkerView("rehearsal-b", in_flight=2, queued_prefill_tokens=64, matched_tokens=64),
        WorkerView("rehearsal-c", in_flight=5, decoding_requests=3, matched_tokens=128),
    ]

    def ctx(views: list[WorkerView], key: str | None = None) -> RouteContext:
        return RouteContext(
            256, views, rng, key, prompt_chars=1024, block_hashes=(1, 2, 3, 4), block_chars=64
        )

    return [ctx(idle[:1]), ctx(idle), ctx(busy, "rehearsal")]


def rehearse(policies: PolicySet, where: str = "policy") -> None:
    """Run every policy of ``policies`` (the section at ``where``) on a few made-up
    decisions; ConfigError names the first that raises or picks a worker it was not
    offered. Mutates the policies' state: rehearse a copy of the set that will route."""
    named: list[tuple[str, Policy]] = [(f"{where}.name", policies.live)]
    named += [(f"{where}.shadows[{i}]", p) for i, p in enumerate(policies.shadows)]
    if policies.ab is not None:
        named.append((f"{where}.ab_policy", policies.ab))
    for where, policy in named:
        for ctx in _rehearsal_contexts():
            try:
                decision = policy.select(ctx)
            except Exception as exc:  # any policy bug: refused before it routes
                raise ConfigError(
                    f"{where}: {policy.name} fails on a test decision: {exc!r}"
                ) from None
            if decision.worker_id not in {v.id for v in ctx.candidates}:
                raise ConfigError(
                    f"{where}: {policy.name} picked {decision.worker_id!r} on a test decision, "
                    "not one of its candidates"
                )


POLICY_CONTROL = web.AppKey("policy_control", PolicyControl)


def _plain(value: Any) -> Any:
    return orjson.loads(orjson.dumps(value, default=list))


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


async def get_policy(request: web.Request) -> web.Response:
    return _json(request.app[POLICY_CONTROL].describe())


async def put_policy(request: web.Request) -> web.Response:
    if request.content_length is not None and request.content_length > _MAX_BODY:
        raise GatewayError(413, f"the policy change exceeds {_MAX_BODY} bytes")
    raw = await request.content.read(_MAX_BODY + 1)
    if len(raw) > _MAX_BODY:
        raise GatewayError(413, f"the policy change exceeds {_MAX_BODY} bytes")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"the policy change is not valid JSON: {exc}") from None
    if not isinstance(body, dict) or not body:
        raise GatewayError(400, "the policy change must be a non-empty JSON object of policy keys")
    control = request.app[POLICY_CONTROL]
    try:
        control.update(body, "PUT /admin/policy")
    except ConfigError as exc:
        raise GatewayError(400, str(exc), param="policy") from None
    return _json(control.describe())


async def get_ab(request: web.Request) -> web.Response:
    control = request.app[POLICY_CONTROL]
    running = control.describe()["running"]
    doc = {"ab_policy": running["ab_policy"], "ab_fraction": running["ab_fraction"]}
    return _json(doc | {"arms": request.app[TUNING].ab.summary()})


async def get_trace(request: web.Request) -> web.Response:
    raw = request.query.get("since", "0")
    try:
        since = float(raw)
    except ValueError:
        raise GatewayError(
            400, f"since: expected UNIX seconds, got {raw!r}", param="since"
        ) from None
    entries = request.app[TUNING].trace.since(since)
    start = entries[0].time if entries else 0.0
    body = b"".join(orjson.dumps(e.to_mooncake(start)) + b"\n" for e in entries)
    return web.Response(body=body, content_type="application/x-ndjson")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/policy", get_policy)
    app.router.add_put("/admin/policy", put_policy)
    app.router.add_get("/debug/ab", get_ab)
    app.router.add_get("/debug/trace", get_trace)
