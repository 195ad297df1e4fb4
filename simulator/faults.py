"""Faults a test can inject into a simulated worker, by CLI flag or ``POST /_sim/faults``.

Scope, so that a test knows what it breaks:

* ``error_rate`` / ``error_status``: that fraction of inference requests (``/generate``,
  ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``) is answered at once
  with ``error_status`` and an SGLang error body, before reaching the model;
* ``latency_s``: added before an inference request reaches the model (wall seconds);
* ``hang``: inference requests never get an answer (until the client goes away);
* ``drop_mid_stream_after``: a streaming response's connection is cut after that many
  ``data:`` chunks (``null``: never);
* ``fail_health``: ``/health``, ``/health_generate``, ``/ping`` and ``/ready`` answer 503;
* ``transfer_fail_rate`` (a prefill server of a PD pair, docs/PD.md): that fraction of KV
  transfers fails, as SGLang's do: the prefill answers 500 ``Prefill transfer failed…``,
  the decode side 500 ``Decode transfer failed…``;
* ``bootstrap_fail`` (a prefill server): its bootstrap server answers 503 to everything,
  as if it were down: decode servers' handshakes fail (``Decode handshake failed…``) and
  their waits lose the prefill (``Lost connection with prefill instance…``), while the
  prefill's requests wait for a decode side until the bootstrap timeout.

Killing one side of a PD pair is :meth:`simulator.fleet.SimulatedFleet.stop_worker` (or
``stop(kill=True)``): a prefill's bootstrap server goes down with it.

Control and observation endpoints (``/_sim/*``, ``/metrics``, ``/v1/loads``, info routes)
are never affected.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class Faults:
    error_rate: float = 0.0
    error_status: int = 500
    latency_s: float = 0.0
    hang: bool = False
    drop_mid_stream_after: int | None = None
    fail_health: bool = False
    transfer_fail_rate: float = 0.0
    bootstrap_fail: bool = False

    def validate(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")
        if not 0.0 <= self.transfer_fail_rate <= 1.0:
            raise ValueError("transfer_fail_rate must be within [0, 1]")
        if not 100 <= self.error_status <= 599:
            raise ValueError("error_status must be an HTTP status code")
        if self.latency_s < 0:
            raise ValueError("latency_s must be >= 0")
        if self.drop_mid_stream_after is not None and self.drop_mid_stream_after < 0:
            raise ValueError("drop_mid_stream_after must be >= 0 or null")

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update from JSON; raise ValueError (and change nothing) if invalid."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown fault fields: {sorted(unknown)}")
        candidate = Faults(**{**asdict(self), **changes})
        for name, kind in (
            ("error_rate", float),
            ("latency_s", float),
            ("transfer_fail_rate", float),
        ):
            value = getattr(candidate, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number")
            setattr(candidate, name, kind(value))
        if isinstance(candidate.error_status, bool) or not isinstance(candidate.error_status, int):
            raise ValueError("error_status must be an integer")
        for name in ("hang", "fail_health", "bootstrap_fail"):
            if not isinstance(getattr(candidate, name), bool):
                raise ValueError(f"{name} must be a boolean")
        drop = candidate.drop_mid_stream_after
        if drop is not None and (isinstance(drop, bool) or not isinstance(drop, int)):
            raise ValueError("drop_mid_stream_after must be an integer or null")
        candidate.validate()
        for f in fields(self):
            setattr(self, f.name, getattr(candidate, f.name))

    def should_fail(self, rng: random.Random) -> bool:
        return self.error_rate > 0 and rng.random() < self.error_rate

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
