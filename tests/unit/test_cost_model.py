"""Online cost model: defaults, convergence, outlier robustness, clamps, forget."""

import math
import random

from gateway.routing.cost_model import DEFAULT_COST, CostModel
from policies.base import WorkerCost


def feed(cm: CostModel, worker: str, fixed: float, per_token: float, n: int, seed: int = 0,
         outliers: bool = False) -> None:  # fmt: skip
    rng = random.Random(seed)
    for i in range(n):
        u, q = rng.randint(50, 4000), rng.randint(0, 8000)
        ttft = (fixed + per_token * (u + q) + 1.3e-9 * u * u / 2) * rng.uniform(0.95, 1.05)
        if outliers and i % 10 == 5:
            ttft *= 50
        cm.observe(worker, u, q, ttft)


def test_defaults_until_enough_observations() -> None:
    cm = CostModel()
    assert cm.cost("w") == DEFAULT_COST
    feed(cm, "w", 0.01, 40e-6, 5)
    assert cm.cost("w") == DEFAULT_COST
    assert cm.observations("w") == 5
    assert not cm.calibrated("w") and not cm.calibrated("unknown")
    feed(cm, "w", 0.01, 40e-6, 3)
    assert cm.calibrated("w") and cm.cost("w") != DEFAULT_COST


def test_custom_default_fills_missing_fields() -> None:
    cm = CostModel(WorkerCost(prefill_per_token_s=1e-4))
    cost = cm.cost("w")
    assert cost.prefill_per_token_s == 1e-4
    assert cost.prefill_fixed_s == DEFAULT_COST.prefill_fixed_s


def test_converges_to_true_parameters() -> None:
    cm = CostModel()
    feed(cm, "slow", 0.010, 60e-6, 300)
    feed(cm, "fast", 0.004, 15e-6, 300, seed=1)
    slow, fast = cm.cost("slow"), cm.cost("fast")
    assert slow.prefill_per_token_s is not None and fast.prefill_per_token_s is not None
    assert math.isclose(slow.prefill_per_token_s, 60e-6, rel_tol=0.1)
    assert math.isclose(fast.prefill_per_token_s, 15e-6, rel_tol=0.1)
    assert slow.decode_step_s == DEFAULT_COST.decode_step_s


def test_outliers_are_clipped() -> None:
    cm = CostModel()
    feed(cm, "w", 0.010, 40e-6, 400, outliers=True)
    per_token = cm.cost("w").prefill_per_token_s
    assert per_token is not None
    # 10% of samples 50x too slow would triple a plain least-squares slope
    assert per_token < 60e-6


def test_tracks_a_worker_that_slows_down() -> None:
    cm = CostModel()
    feed(cm, "w", 0.005, 20e-6, 200)
    feed(cm, "w", 0.005, 80e-6, 300, seed=3)
    per_token = cm.cost("w").prefill_per_token_s
    assert per_token is not None and per_token > 60e-6


def test_invalid_observations_ignored() -> None:
    cm = CostModel()
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        cm.observe("w", 100, 0, bad)
    cm.observe("w", -1, 0, 0.1)
    cm.observe("w", 1, -5, 0.1)
    assert cm.observations("w") == 0


def test_clamped_to_plausible_range() -> None:
    cm = CostModel(clamp_ratio=10.0)
    for _ in range(100):
        cm.observe("w", 1000, 0, 1e-6)  # absurdly fast
    cost = cm.cost("w")
    assert cost.prefill_per_token_s is not None and cost.prefill_fixed_s is not None
    assert cost.prefill_per_token_s >= 22e-6 / 10 * 0.999
    assert cost.prefill_fixed_s >= 0.0


def test_forget_worker() -> None:
    cm = CostModel()
    feed(cm, "w", 0.01, 80e-6, 50)
    assert cm.cost("w") != DEFAULT_COST
    cm.forget_worker("w")
    assert cm.cost("w") == DEFAULT_COST
    cm.forget_worker("w")
