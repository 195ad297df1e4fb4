"""Metrics of drains and pre-warms (``gateway.routing.prewarm``'s hooks).

Families (registered on the gateway's own registry beside the others; docs/TELEMETRY.md):

- ``gateway_drain_chains_total{outcome}``: chains a drain considered, by what became of
  them: ``rehomed``, ``cold`` (not used lately), ``held_elsewhere``, ``no_home``.
- ``gateway_prewarm_requests_total{reason, outcome}``: pre-warms of a ``drain`` or a
  ``join`` that ``completed``, ``failed``, were ``skipped`` (the conversation came back
  first, or its prompt was dropped) or ``dropped`` (still queued when the worker left or
  the deadline passed, or larger than the budget's burst).
- ``gateway_prewarm_tokens_total{reason}``: prompt tokens sent to pre-warm (the budget's
  units: tokens the worker was believed not to hold).

Labels are bounded (two reasons, four outcomes). Updated off the request path.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.routing.prewarm import MembershipHooks
from gateway.routing.rehome import RehomeReport
from gateway.telemetry.metrics import CounterVec, PushCollector


class MembershipTelemetry(MembershipHooks):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.chains = CounterVec(
            "gateway_drain_chains", "Chains drains considered, by outcome.", ("outcome",)
        )
        self.requests = CounterVec(
            "gateway_prewarm_requests",
            "Pre-warm requests by reason (drain, join) and outcome.",
            ("reason", "outcome"),
        )
        self.tokens = CounterVec(
            "gateway_prewarm_tokens", "Prompt tokens sent to pre-warm, by reason.", ("reason",)
        )
        registry.register(PushCollector([self.chains, self.requests, self.tokens]))

    def drained(self, report: RehomeReport) -> None:
        for outcome, n in (
            ("rehomed", report.rehomed),
            ("cold", report.cold),
            ("held_elsewhere", report.held_elsewhere),
            ("no_home", report.no_home),
        ):
            if n:
                self.chains.labels(outcome).inc(n)

    def prewarmed(self, reason: str, outcome: str, tokens: int) -> None:
        self.requests.labels(reason, outcome).inc()
        if outcome in ("completed", "failed"):
            self.tokens.labels(reason).inc(tokens)
