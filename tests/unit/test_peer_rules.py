"""The peers' rules as policies: each one's defining behaviour, with its published
defaults (policies/dynamo_kv.py, llmd_scorers.py, aibrix_prefix.py, preble_e2.py)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from policies.aibrix_prefix import AibrixPrefixPolicy, load_bound
from policies.base import EngineLoad, RouteContext, WorkerCost, WorkerView
from policies.dynamo_kv import DynamoKvPolicy
from policies.llmd_scorers import LlmdScorersPolicy
from policies.preble_e2 import PrebleE2Policy
from policies.registry import create_policy

PEERS = ("dynamo_kv", "llmd_scorers", "preble_e2", "aibrix_prefix")


def _ctx(views: Sequence[WorkerView], prompt: int = 1000, seed: int = 0) -> RouteContext:
    return RouteContext(prompt_tokens=prompt, candidates=list(views), rng=random.Random(seed))


def test_peers_are_registered_with_their_published_defaults() -> None:
    assert create_policy("dynamo_kv").describe() == {
        "name": "dynamo_kv", "prefill_load_scale": 1.0, "overlap_score_credit": 1.0,
        "decode_active_request_weight": 0.0, "router_temperature": 0.0,
    }  # fmt: skip
    assert create_policy("llmd_scorers").describe() == {
        "name": "llmd_scorers", "queue_weight": 2.0, "kv_weight": 2.0, "prefix_weight": 3.0,
    }  # fmt: skip
    assert create_policy("aibrix_prefix").describe() == {
        "name": "aibrix_prefix", "imbalance_abs_count": 8, "std_factor": 1.0,
    }  # fmt: skip
    assert create_policy("preble_e2").describe() == {
        "name": "preble_e2", "decode_tokens": 45, "rebalance_factor": 1.5, "window": 512,
    }  # fmt: skip
    for name in PEERS:
        assert create_policy(name).uses_prefix_match


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("dynamo_kv", {"router_temperature": float("inf")}),
        ("dynamo_kv", {"prefill_load_scale": -1}),
        ("llmd_scorers", {"prefix_weight": float("nan")}),
        ("llmd_scorers", {"queue_weight": "2"}),
        ("aibrix_prefix", {"imbalance_abs_count": 1.5}),
        ("aibrix_prefix", {"std_factor": -0.5}),
        ("preble_e2", {"decode_tokens": True}),
        ("preble_e2", {"rebalance_factor": float("inf")}),
    ],
)
def test_bad_parameters_are_refused(name: str, params: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=name):
        create_policy(name, **params)


# --- Dynamo: the lowest weighted cost -------------------------------------------------------


def _dynamo_with_history(policy: DynamoKvPolicy) -> list[WorkerView]:
    # a: one live request that added 1000 prompt tokens, and 600 of this 1000-token
    # prompt cached; b: idle, holds nothing.
    policy.select(_ctx([WorkerView("a")]))  # the only candidate: 1000 tokens added on a
    return [WorkerView("a", in_flight=1, matched_tokens=600), WorkerView("b")]


def test_dynamo_picks_the_lowest_weighted_cost() -> None:
    policy = DynamoKvPolicy()
    views = _dynamo_with_history(policy)
    # a: prefill (0 + 1000 - 600) + decode (1000 active + 400 new) = 1800; b: 1000 + 1000
    assert policy.active_tokens(views[0]) == 1000
    assert policy.logit(views[0], 1000) == pytest.approx(1800)
    assert policy.logit(views[1], 1000) == pytest.approx(2000)
    decision = policy.select(_ctx(views))
    assert decision.worker_id == "a" and decision.reason == "prefix_hit"
    assert decision.scores == pytest.approx({"a": 1800, "b": 2000})
    # a smaller prefill scale makes the decode blocks count more: b wins
    light = DynamoKvPolicy(prefill_load_scale=0.1)
    decision = light.select(_ctx(_dynamo_with_history(light)))
    assert decision.worker_id == "b" and decision.reason == "load"


def test_dynamo_active_blocks_are_the_newest_in_flight_requests() -> None:
    policy = DynamoKvPolicy()
    for matched in (0, 700, 900):  # three requests to a, adding 1000, 300 and 100 tokens
        policy.select(_ctx([WorkerView("a", matched_tokens=matched)]))
    assert [policy.active_tokens(WorkerView("a", in_flight=k)) for k in (0, 1, 2, 3, 9)] == [
        0, 100, 400, 1400, 1400,
    ]  # fmt: skip
    assert policy.active_tokens(WorkerView("b", in_flight=5)) == 0


def test_dynamo_queued_prefill_and_overlap_credit() -> None:
    views = [
        WorkerView("a", matched_tokens=900, queued_prefill_tokens=2000),
        WorkerView("b"),
    ]
    # a: (2000 + 1000 - 900) + 100 = 2200 against b: 1000 + 1000: the queue outweighs the hit
    assert DynamoKvPolicy().select(_ctx(views)).worker_id == "b"
    hot = [WorkerView("a", matched_tokens=900, queued_prefill_tokens=500), WorkerView("b")]
    assert DynamoKvPolicy().select(_ctx(hot)).worker_id == "a"  # 700 against 2000
    # no overlap credit: the match no longer lowers the prefill term
    assert DynamoKvPolicy(overlap_score_credit=0.0).logit(hot[0], 1000) == pytest.approx(1600)


def test_dynamo_softmax_temperature_samples_by_cost() -> None:
    views = [WorkerView("a", queued_prefill_tokens=q) for q in (0,)] + [
        WorkerView("b", queued_prefill_tokens=1000),
        WorkerView("c", queued_prefill_tokens=2000),
    ]
    policy = DynamoKvPolicy(router_temperature=0.5)
    rng = random.Random(7)
    counts = Counter(policy.select(RouteContext(1000, views, rng)).worker_id for _ in range(3000))
    # logits 2000 / 3000 / 4000: weights exp(0), exp(-1), exp(-2) at temperature 0.5
    assert counts["a"] > counts["b"] > counts["c"] > 0
    assert counts["a"] / 3000 == pytest.approx(1 / (1 + 0.3679 + 0.1353), abs=0.04)
    cold = DynamoKvPolicy()  # temperature 0: always the argmin
    assert {cold.select(RouteContext(1000, views, rng)).worker_id for _ in range(50)} == {"a"}


def test_dynamo_ties_fall_at_random() -> None:
    views = [WorkerView("a"), WorkerView("b"), WorkerView("c")]
    rng = random.Random(1)
    chosen = {DynamoKvPolicy().select(RouteContext(100, views, rng)).worker_id for _ in range(60)}
    assert chosen == {"a", "b", "c"}


# --- llm-d: weighted scorers, the highest total wins ------------------------------------------


def test_llmd_weighted_scorers() -> None:
    # a: the whole prompt cached, the longest waiting queue, KV 90 % used;
    # b: nothing cached, no queue, KV free.
    views = [
        WorkerView("a", matched_tokens=1000, engine_load=EngineLoad(waiting_requests=4,
                                                                    token_usage=0.9)),
        WorkerView("b", engine_load=EngineLoad(waiting_requests=0, token_usage=0.0)),
    ]  # fmt: skip
    policy = LlmdScorersPolicy()
    scores = policy.scores(_ctx(views))
    # a: 2 x 0 + 2 x 0.1 + 3 x 1 = 3.2; b: 2 x 1 + 2 x 1 + 3 x 0 = 4
    assert scores == pytest.approx({"a": 3.2, "b": 4.0})
    assert policy.select(_ctx(views)).worker_id == "b"
    assert LlmdScorersPolicy(prefix_weight=5).select(_ctx(views)).worker_id == "a"


def test_llmd_equal_queues_score_one_and_own_waiting_requests_count() -> None:
    views = [WorkerView("a", matched_tokens=500), WorkerView("b")]
    assert LlmdScorersPolicy().scores(_ctx(views)) == pytest.approx({"a": 5.5, "b": 4.0})
    # three requests this gateway sent to a, none at its first token yet: a longer queue
    sent = [WorkerView("a", matched_tokens=500, in_flight=3), WorkerView("b")]
    assert LlmdScorersPolicy().scores(_ctx(sent)) == pytest.approx({"a": 3.5, "b": 4.0})


# --- AIBrix: best match unless above mean + k sigma, then least loaded -------------------------


def test_aibrix_load_bound_is_mean_plus_k_sample_stddev() -> None:
    assert load_bound([6, 1, 1, 0], 1.0) == pytest.approx(2 + (22 / 3) ** 0.5)
    assert load_bound([3], 2.0) == 3


def test_aibrix_best_match_within_the_bound_wins() -> None:
    views = [
        WorkerView("a", in_flight=2, matched_tokens=900),
        WorkerView("b", in_flight=0, matched_tokens=400),
        WorkerView("c", in_flight=1),
    ]
    decision = AibrixPrefixPolicy().select(_ctx(views))
    assert decision.worker_id == "a" and decision.reason == "prefix_hit"
    assert decision.scores == {"a": 90.0, "b": 40.0, "c": 0.0}


def test_aibrix_falls_back_to_least_loaded_above_mean_plus_k_sigma() -> None:
    # loads 6 / 1 / 1 / 0: bound 2 + 2.71 = 4.71, so a (the only holder) is skipped
    views = [
        WorkerView("a", in_flight=6, matched_tokens=900),
        WorkerView("b", in_flight=1),
        WorkerView("c", in_flight=1),
        WorkerView("d", in_flight=0),
    ]
    decision = AibrixPrefixPolicy().select(_ctx(views))
    assert decision.worker_id == "d" and decision.reason == "load"
    # a wider bound (k = 2: 7.4) keeps a
    assert AibrixPrefixPolicy(std_factor=2.0).select(_ctx(views)).worker_id == "a"


def test_aibrix_next_holder_when_the_best_is_above_the_bound() -> None:
    views = [
        WorkerView("a", in_flight=6, matched_tokens=900),
        WorkerView("b", in_flight=1, matched_tokens=500),
        WorkerView("c", in_flight=1),
        WorkerView("d", in_flight=0),
    ]
    decision = AibrixPrefixPolicy().select(_ctx(views))
    assert decision.worker_id == "b" and decision.reason == "load"


def test_aibrix_imbalance_restricts_matching_to_the_least_loaded() -> None:
    views = [
        WorkerView("a", in_flight=1, matched_tokens=900),
        WorkerView("b", in_flight=0, matched_tokens=500),
        WorkerView("c", in_flight=9),
    ]
    # max - min = 9 > 8: only b (load 0) may be matched
    assert AibrixPrefixPolicy().select(_ctx(views)).worker_id == "b"
    assert AibrixPrefixPolicy(imbalance_abs_count=20).select(_ctx(views)).worker_id == "a"
    lone = [WorkerView("a", in_flight=1, matched_tokens=900), WorkerView("c", in_flight=10)]
    decision = AibrixPrefixPolicy().select(_ctx(lone))
    assert decision.worker_id == "a" and decision.reason == "prefix_hit"
    cold = [WorkerView("a", in_flight=2, matched_tokens=900), WorkerView("b", in_flight=12),
            WorkerView("c", in_flight=3)]  # fmt: skip
    decision = AibrixPrefixPolicy().select(_ctx(cold))
    assert decision.worker_id == "a"  # imbalanced, and a is the least loaded holder
    far = [WorkerView("a", in_flight=5, matched_tokens=900), WorkerView("b", in_flight=14),
           WorkerView("c", in_flight=3)]  # fmt: skip
    decision = AibrixPrefixPolicy().select(_ctx(far))
    assert decision.worker_id == "c" and decision.reason == "imbalance"


def test_aibrix_match_percentages_truncate_and_ties_go_to_the_less_loaded() -> None:
    # 905 and 909 of 1000 are both 90 %: the less loaded of the two wins
    views = [
        WorkerView("a", in_flight=2, matched_tokens=909),
        WorkerView("b", in_flight=1, matched_tokens=905),
        WorkerView("c", in_flight=1),
    ]
    assert AibrixPrefixPolicy().select(_ctx(views)).worker_id == "b"


# --- Preble E2: exploit when the cached part is longer, else explore by cost -------------------

_UNIT = WorkerCost(
    prefill_per_token_s=1e-3, prefill_fixed_s=0.0, decode_step_s=0.0, prefill_pair_s=0.0
)


def _assign(policy: PrebleE2Policy, worker: str, tokens: int, times: int = 1) -> None:
    """Record ``times`` decisions of ``tokens`` uncached tokens (``tokens`` ms) to ``worker``."""
    for _ in range(times):
        policy.select(_ctx([WorkerView(worker, cost=_UNIT)], prompt=tokens))


def _preble(policy: PrebleE2Policy, a_load: int, a_match: int, b_match: int) -> list[WorkerView]:
    """a and b with ``a_load`` and 1000 ms of recent prefill, holding parts of a 1000-token
    prompt."""
    _assign(policy, "a", a_load)
    _assign(policy, "b", 1000)
    return [
        WorkerView("a", matched_tokens=a_match, cost=_UNIT),
        WorkerView("b", matched_tokens=b_match, cost=_UNIT),
    ]


def test_preble_exploits_a_prefix_longer_than_the_rest() -> None:
    # a holds 700 of 1000 (> 300 left): exploit, although explore would pick b
    # (a: L 1.45 + R 0.3 = 1.75 s, b: 1.0 + 0.4 = 1.4 s)
    policy = PrebleE2Policy()
    views = _preble(policy, 1450, 700, 600)
    assert policy.load_s(views[0]) == pytest.approx(1.45)
    assert policy.running_s(views[0], 1000) == pytest.approx(0.3)
    decision = policy.select(_ctx(views))
    assert decision.worker_id == "a" and decision.reason == "prefix_hit"
    assert decision.scores == pytest.approx({"a": 1.75, "b": 1.4})
    assert policy.load_s(views[0]) == pytest.approx(1.75)  # its prefill joins the window


def test_preble_explores_by_load_and_running_cost_otherwise() -> None:
    # a holds 400 of 1000 (< 600 left): explore, lowest L + R: b (1.0 + 0.7 < 1.45 + 0.6)
    policy = PrebleE2Policy()
    decision = policy.select(_ctx(_preble(policy, 1450, 400, 300)))
    assert decision.worker_id == "b" and decision.reason == "load"


def test_preble_rebalances_a_holder_above_one_and_a_half_the_lightest_load() -> None:
    # a's recent load 1.6 s > 1.5 x b's 1.0 s: after the warm-up (50 decisions per
    # worker), the holder is not exploited; explore picks b (1.0 + 0.4 < 1.6 + 0.3)
    warm = PrebleE2Policy()
    _assign(warm, "elsewhere", 1, times=100)
    assert warm.select(_ctx(_preble(warm, 1600, 700, 600))).worker_id == "b"
    cold = PrebleE2Policy()  # no rebalancing during the warm-up
    _assign(cold, "elsewhere", 1, times=97)
    assert cold.select(_ctx(_preble(cold, 1600, 700, 600))).worker_id == "a"
    for factor, expected in ((0.0, "a"), (2.0, "a")):
        policy = PrebleE2Policy(rebalance_factor=factor)
        _assign(policy, "elsewhere", 1, times=100)
        assert policy.select(_ctx(_preble(policy, 1600, 700, 600))).worker_id == expected


def test_preble_load_is_a_window_of_recent_prefill_and_the_decode_owed() -> None:
    policy = PrebleE2Policy(window=2)
    _assign(policy, "a", 300)
    _assign(policy, "a", 200)
    assert policy.load_s(WorkerView("a", cost=_UNIT)) == pytest.approx(0.5)
    _assign(policy, "b", 100)  # the window holds two decisions: a's first drops out
    assert policy.load_s(WorkerView("a", cost=_UNIT)) == pytest.approx(0.2)
    _assign(policy, "b", 100)
    assert policy.load_s(WorkerView("a", cost=_UNIT)) == 0.0
    stepped = WorkerCost(prefill_per_token_s=1e-3, prefill_fixed_s=0.0, decode_step_s=0.01)
    decoding = WorkerView("c", in_flight=2, decoding_requests=2, cost=stepped)
    assert PrebleE2Policy().load_s(decoding) == pytest.approx(2 * 45 * 0.01)
    assert PrebleE2Policy(decode_tokens=10).load_s(decoding) == pytest.approx(0.2)
