"""Arrival processes: Poisson at a fixed rate, and Poisson with a linear rate ramp."""

from __future__ import annotations

import math
import random


def poisson_arrivals(rng: random.Random, count: int, rate: float) -> list[float]:
    """``count`` arrival times of a Poisson process of ``rate`` per second.

    ``rate`` of ``inf`` (or ≤ 0) means everything at once, as SGLang ``bench_serving``
    does by default.
    """
    if math.isinf(rate) or rate <= 0:
        return [0.0] * count
    times: list[float] = []
    now = 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def ramp_arrivals(
    rng: random.Random, count: int, rate_start: float, rate_end: float, ramp_s: float
) -> list[float]:
    """Poisson arrivals whose rate goes linearly from ``rate_start`` to ``rate_end``
    over ``ramp_s`` seconds, then stays at ``rate_end``.

    Unit-rate exponential gaps in the cumulative intensity
    ``Λ(t) = r0·t + (r1 - r0)·t²/(2·T)`` are mapped back through ``Λ⁻¹``.
    """
    if rate_start <= 0 or rate_end <= 0 or ramp_s <= 0:
        raise ValueError("rates and ramp duration must be positive")
    slope = (rate_end - rate_start) / ramp_s
    ramp_mass = rate_start * ramp_s + slope * ramp_s * ramp_s / 2
    times: list[float] = []
    mass = 0.0
    for _ in range(count):
        mass += rng.expovariate(1.0)
        if mass >= ramp_mass:
            times.append(ramp_s + (mass - ramp_mass) / rate_end)
        elif abs(slope) < 1e-12:
            times.append(mass / rate_start)
        else:
            disc = rate_start * rate_start + 2 * slope * mass
            times.append((-rate_start + math.sqrt(disc)) / slope)
    return times


def parse_stages(text: str) -> list[tuple[float, float]]:
    """``"3:20,10:20"`` → ``[(3.0, 20.0), (10.0, 20.0)]``: (rate per second, seconds)."""
    stages: list[tuple[float, float]] = []
    for item in text.split(","):
        rate, sep, duration = item.strip().partition(":")
        if not sep:
            raise ValueError(f"a stage is RATE:SECONDS, not {item!r}")
        stages.append((float(rate), float(duration)))
    if not stages or any(r <= 0 or d <= 0 for r, d in stages):
        raise ValueError(f"stages need positive rates and durations: {text!r}")
    return stages


def staged_arrivals(rng: random.Random, stages: list[tuple[float, float]]) -> list[float]:
    """Poisson arrivals at a piecewise-constant rate: each ``(rate, seconds)`` stage after
    the previous one, as inference-perf's ``load.stages`` (``type: poisson``) sends them.

    The count follows from the stages (about Σ rate x seconds): a stage's exponential gap
    that crosses into the next stage is redrawn there (memoryless, so still Poisson).
    """
    times: list[float] = []
    start = 0.0
    for rate, duration in stages:
        end = start + duration
        now = start + rng.expovariate(rate)
        while now < end:
            times.append(now)
            now += rng.expovariate(rate)
        start = end
    return times
