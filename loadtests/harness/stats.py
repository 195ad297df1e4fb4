"""Percentiles of measured samples (the one copy).

:func:`percentile` takes ``p`` in 0..100 and an explicit ``method``: the benchmarks were
written with different definitions and the figures already published (BENCHMARKS.md)
were computed with each, so every caller keeps its own, by name. With ``n`` sorted values
and ``q = p / 100`` (for an integer ``p``, exactly the float literal ``0.99`` etc. the
callers used before), the 0-based index read is:

============== ====================================== =====================================
method         value                                  used by
============== ====================================== =====================================
``linear``     interpolated at ``(n-1) * p / 100``    replay metrics, real-engine runner
               (numpy's default, ``statistics``'
               ``inclusive``)
``nearest``    ``ceil(q*n) - 1`` (nearest rank)       live benchmark (``bench.report``)
``upper``      ``floor(q*n)``                         multi-gateway, exact-mode and
                                                      gateway-overhead benchmarks, the
                                                      simulator benchmark's p50
``lower``      ``floor(q*n) - 1``                     the simulator benchmark's p99
============== ====================================== =====================================

Indices are clamped to ``0 .. n-1``. ``nearest``, ``upper`` and ``lower`` return a sample;
``upper`` equals ``nearest`` unless ``q*n`` is a whole number (then it is one rank
higher), ``lower`` equals ``nearest`` only then (else one rank lower). No values: NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Method = Literal["linear", "nearest", "upper", "lower"]


def percentile(values: Sequence[float], p: float, method: Method) -> float:
    """The ``p``-th percentile (``p`` in 0..100) of ``values`` by ``method``; NaN if none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    n = len(ordered)
    if method == "linear":
        pos = (n - 1) * p / 100.0
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    q = p / 100
    if method == "nearest":
        index = math.ceil(q * n) - 1
    elif method == "upper":
        index = int(q * n)
    elif method == "lower":
        index = int(q * n) - 1
    else:
        raise ValueError(f"unknown percentile method {method!r}")
    return ordered[min(n - 1, max(0, index))]
