"""The request gates' counters (``gateway.routing.slot_gate``, ``gateway.routing.prefill_gate``).

Family (pull-style, read from each gate's :class:`~gateway.routing.slot_gate.GateStats`
at scrape; docs/TELEMETRY.md):

- ``gateway_gate_requests_total{gate, outcome}``: requests a gate (``slot``: slot-bound
  workers such as llama.cpp; ``prefill``: SGLang workers while a sibling's prefill runs)
  ``held``, ``released`` (handed the warm slot, or let go at a sibling's first byte or
  end) and ``timed_out`` (went ahead at the hold's bound). A held request still waiting,
  or whose client left, is in ``held`` only. The time held is the histogram
  ``gateway_slot_wait_seconds`` (both gates).

Labels are bounded (two gates, three outcomes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, Metric

from gateway.routing.slot_gate import GateStats


def _family() -> CounterMetricFamily:
    return CounterMetricFamily(
        "gateway_gate_requests",
        "Requests the slot and prefill gates held, released and let go at their bound.",
        labels=["gate", "outcome"],
    )


class GateCollector:
    """Yields ``gateway_gate_requests_total`` from the gates' live counters."""

    def __init__(self, gates: Mapping[str, GateStats]) -> None:
        self._gates = dict(gates)

    def describe(self) -> Iterator[Metric]:
        yield _family()

    def collect(self) -> Iterator[Metric]:
        fam = _family()
        for gate, stats in self._gates.items():
            fam.add_metric([gate, "held"], stats.held)
            fam.add_metric([gate, "released"], stats.handed)
            fam.add_metric([gate, "timed_out"], stats.timed_out)
        yield fam
