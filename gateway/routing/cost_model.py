"""Per-worker prefill latency model, calibrated online from the TTFTs the gateway observes.

Model (PERFORMANCE.md section 3): a request's time to first token on a worker is the
prefill of the work ahead of it plus its own uncached part,

    ttft ~ fixed_s + per_token_s * (uncached + queued_ahead) + pair_s * u * (u / 2)

where ``u`` = ``uncached``. The attention term (``pair_s``) is kept at its default and
subtracted before fitting, so only ``fixed_s`` and ``per_token_s`` are learned.

Fit: recursive least squares with exponential forgetting (factor 0.98: an effective
memory of about 50 observations, so a worker that slows down is noticed within a minute
of traffic), on ``x`` in thousands of tokens for conditioning. Robustness:
- observations with a non-finite or non-positive TTFT, or negative counts, are ignored;
- a residual larger than ``outlier_k`` times the running mean absolute residual is
  clipped to that bound before the update (one stalled request cannot wreck the fit);
- the covariance is bounded (no wind-up when all observations look alike);
- the fitted parameters are clamped to ``[default / clamp_ratio, default * clamp_ratio]``
  (``fixed_s`` to ``[0, max_fixed_s]``).
Until ``min_observations`` have been seen, ``cost`` returns the defaults.
``decode_step_s`` is not observable from TTFTs and stays at its default.

Pure: no I/O, no asyncio, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from policies.base import WorkerCost

# Llama-3-8B BF16 on one H100 (PERFORMANCE.md section 3): prefill 5 ms + 22 us/token
# + 1.3 ns per token pair; decode step about 6.5 ms at batch 1.
DEFAULT_COST = WorkerCost(
    prefill_per_token_s=22e-6,
    prefill_fixed_s=5e-3,
    decode_step_s=6.5e-3,
    prefill_pair_s=1.3e-9,
)
_KTOK = 1000.0


@dataclass(slots=True)
class _Fit:
    """RLS state for ``y = a + b * x``: parameters, covariance, residual scale, count."""

    a: float
    b: float
    p: list[float] = field(default_factory=lambda: [1.0, 0.0, 0.0, 1.0])  # row-major 2x2
    scale: float = 0.05  # running mean absolute residual, seconds
    n: int = 0


class CostModel:
    def __init__(
        self,
        default: WorkerCost | None = None,
        *,
        forgetting: float = 0.98,
        min_observations: int = 8,
        outlier_k: float = 4.0,
        clamp_ratio: float = 20.0,
        max_fixed_s: float = 1.0,
    ) -> None:
        base = default or DEFAULT_COST
        self._default = WorkerCost(
            prefill_per_token_s=_or(base.prefill_per_token_s, DEFAULT_COST.prefill_per_token_s),
            prefill_fixed_s=_or(base.prefill_fixed_s, DEFAULT_COST.prefill_fixed_s),
            decode_step_s=_or(base.decode_step_s, DEFAULT_COST.decode_step_s),
            prefill_pair_s=_or(base.prefill_pair_s, DEFAULT_COST.prefill_pair_s),
        )
        self._forgetting = forgetting
        self._min_observations = min_observations
        self._outlier_k = outlier_k
        self._clamp_ratio = clamp_ratio
        self._max_fixed_s = max_fixed_s
        self._fits: dict[str, _Fit] = {}
        # each calibrated worker's cost as last fitted: ``cost`` is read for every
        # candidate of every decision, ``observe`` once per response
        self._costs: dict[str, WorkerCost] = {}

    @property
    def default(self) -> WorkerCost:
        return self._default

    def observe(
        self, worker_id: str, uncached_tokens: int, queued_tokens_ahead: int, ttft_s: float
    ) -> None:
        """Feed one observed TTFT with the prefill work the request had to wait for."""
        if not math.isfinite(ttft_s) or ttft_s <= 0 or uncached_tokens < 0:
            return
        if queued_tokens_ahead < 0:
            return
        fit = self._fits.get(worker_id)
        if fit is None:
            fit = _Fit(a=self._fixed_default(), b=self._per_token_default() * _KTOK)
            self._fits[worker_id] = fit
        pair = self._default.prefill_pair_s or 0.0
        y = ttft_s - pair * uncached_tokens * uncached_tokens / 2.0
        x = (uncached_tokens + queued_tokens_ahead) / _KTOK
        residual = y - (fit.a + fit.b * x)
        bound = self._outlier_k * fit.scale
        if fit.n >= self._min_observations and abs(residual) > bound:
            residual = math.copysign(bound, residual)
        fit.scale += 0.05 * (min(abs(residual), 4.0 * fit.scale + 1e-3) - fit.scale)
        self._rls_update(fit, x, residual)
        fit.n += 1
        if fit.n >= self._min_observations:
            self._costs[worker_id] = WorkerCost(
                prefill_per_token_s=fit.b / _KTOK,
                prefill_fixed_s=fit.a,
                decode_step_s=self._default.decode_step_s,
                prefill_pair_s=self._default.prefill_pair_s,
            )

    def _rls_update(self, fit: _Fit, x: float, residual: float) -> None:
        lam = self._forgetting
        p00, p01, p10, p11 = fit.p
        # gain k = P h / (lam + h' P h), with h = (1, x)
        ph0, ph1 = p00 + p01 * x, p10 + p11 * x
        denom = lam + ph0 + x * ph1
        k0, k1 = ph0 / denom, ph1 / denom
        fit.a += k0 * residual
        fit.b += k1 * residual
        # P = (P - k h' P) / lam, kept symmetric and bounded against wind-up
        hp0, hp1 = p00 + x * p10, p01 + x * p11
        new = [
            (p00 - k0 * hp0) / lam,
            (p01 - k0 * hp1) / lam,
            (p10 - k1 * hp0) / lam,
            (p11 - k1 * hp1) / lam,
        ]
        off = (new[1] + new[2]) / 2.0
        trace = new[0] + new[3]
        shrink = 100.0 / trace if trace > 100.0 else 1.0
        fit.p = [new[0] * shrink, off * shrink, off * shrink, new[3] * shrink]
        fit.a = min(max(fit.a, 0.0), self._max_fixed_s)
        per_token = self._per_token_default() * _KTOK
        fit.b = min(max(fit.b, per_token / self._clamp_ratio), per_token * self._clamp_ratio)

    def cost(self, worker_id: str) -> WorkerCost:
        """The worker's fitted cost; the defaults until it is calibrated."""
        return self._costs.get(worker_id, self._default)

    def calibrated(self, worker_id: str) -> bool:
        """Whether ``cost(worker_id)`` is fitted to the worker (else it is the default)."""
        fit = self._fits.get(worker_id)
        return fit is not None and fit.n >= self._min_observations

    def observations(self, worker_id: str) -> int:
        fit = self._fits.get(worker_id)
        return 0 if fit is None else fit.n

    def forget_worker(self, worker_id: str) -> None:
        self._fits.pop(worker_id, None)
        self._costs.pop(worker_id, None)

    def _fixed_default(self) -> float:
        return _or(self._default.prefill_fixed_s, 0.0)

    def _per_token_default(self) -> float:
        return _or(self._default.prefill_per_token_s, 0.0)


def _or(value: float | None, fallback: float | None) -> float:
    if value is not None:
        return value
    return fallback if fallback is not None else 0.0
