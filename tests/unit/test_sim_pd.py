"""The simulated PD roles' models (issue 18): SGLang's prefill and decode servers as worker
models on a virtual clock (:mod:`simulator.model.disagg`), the KV link
(:mod:`simulator.model.transfer`), and the settings' checks. Behaviour only: no timing."""

from __future__ import annotations

import pytest

from simulator.__main__ import build_parser, config_from_args
from simulator.config import SimConfig
from simulator.faults import Faults
from simulator.model.disagg import ABORTED, DecodeWorkerModel, Handoff, PrefillWorkerModel
from simulator.model.requests import RequestOutput, SimRequest
from simulator.model.transfer import (
    TRANSFER_PROFILES,
    TransferLink,
    get_transfer_profile,
)

PROMPT = list(range(1, 1001))


def _run(model: PrefillWorkerModel | DecodeWorkerModel, now: float = 0.0) -> list[RequestOutput]:
    """Step until idle; every output."""
    outputs: list[RequestOutput] = []
    for _ in range(1000):
        result = model.step(now)
        if result is None:
            return outputs
        outputs += result.outputs
        now = result.end
    raise AssertionError("the model never went idle")


def _prefill(
    profile: str = "rdma-400g",
) -> tuple[PrefillWorkerModel, list[tuple[str, Handoff | None, str | None]]]:
    model = PrefillWorkerModel.build(SimConfig(), get_transfer_profile(profile))
    done: list[tuple[str, Handoff | None, str | None]] = []
    model.on_transfer_done = lambda rid, handoff, failure: done.append((rid, handoff, failure))
    return model, done


def _submit_pd(
    model: PrefillWorkerModel | DecodeWorkerModel, rid: str, prompt: list[int], n: int = 8
) -> None:
    model.expect(rid)
    model.submit(SimRequest(rid, prompt, max_new_tokens=n), 0.0)


# ---------------------------------------------------------------------- the link
def test_transfer_time_grows_with_tokens_and_bytes_and_instant_is_free() -> None:
    link = get_transfer_profile("rdma-400g")
    assert link.transfer_s(2000, 131_072) > link.transfer_s(1000, 131_072) > link.fixed_latency_s
    assert link.transfer_s(1000, 262_144) > link.transfer_s(1000, 131_072)
    assert get_transfer_profile("instant").transfer_s(10**6, 131_072) == 0.0
    assert get_transfer_profile("tcp-25g").transfer_s(1000, 131_072) > link.transfer_s(
        1000, 131_072
    )
    assert all(p.description for p in TRANSFER_PROFILES.values())
    with pytest.raises(ValueError, match="unknown transfer profile 'x'"):
        get_transfer_profile("x")


def test_one_prefill_link_sends_its_transfers_one_after_another() -> None:
    link = TransferLink(get_transfer_profile("rdma-400g"), 131_072)
    first = link.send(0.0, 4000)
    second = link.send(0.0, 4000)
    alone = TransferLink(get_transfer_profile("rdma-400g"), 131_072).send(0.0, 4000)
    assert first == alone
    assert second > first


# ---------------------------------------------------------------------- prefill
def test_prefill_holds_a_request_until_its_decode_side_connects() -> None:
    model, done = _prefill()
    _submit_pd(model, "a", PROMPT)
    assert _run(model) == []
    assert model.num_bootstrap == 1 and model.holds("a")
    assert model.bootstrapped("a")
    outputs = _run(model)
    (out,) = outputs
    assert out.finish is not None and (out.finish.kind, out.finish.length) == ("length", 0)
    assert out.completion_tokens == 1 and out.prompt_tokens == len(PROMPT)
    (rid, handoff, failure) = done[0]
    assert rid == "a" and failure is None and handoff is not None
    assert handoff.prompt_tokens == len(PROMPT) and handoff.cached_tokens == 0
    assert handoff.output_id == out.output_ids[0]
    assert handoff.nbytes == len(PROMPT) * model.profile.kv_bytes_per_token
    assert model.num_bootstrap == model.num_inflight == 0
    assert model.pd.transfers == 1 and model.pd.last_latency_ms > 0


def test_prefill_cached_tokens_are_its_radix_cache_hits() -> None:
    model, done = _prefill()
    _submit_pd(model, "a", PROMPT)
    model.bootstrapped("a")
    _run(model)
    _submit_pd(model, "b", [*PROMPT, 7, 8, 9])
    model.bootstrapped("b")
    (out,) = _run(model)
    assert out.cached_tokens == len(PROMPT)
    assert done[-1][1] is not None and done[-1][1].cached_tokens == len(PROMPT)


def test_prefill_keeps_the_kv_locked_while_it_moves() -> None:
    model, _ = _prefill("tcp-25g")
    _submit_pd(model, "a", PROMPT)
    model.bootstrapped("a")
    while model.num_inflight == 0:
        result = model.step(model.now)
        assert result is not None
    assert model.cache.used >= len(PROMPT) and model.cache.evictable == 0
    _run(model, model.now)
    assert model.cache.used == 0 and model.cache.evictable >= len(PROMPT) - 1


def test_prefill_transfer_failure_and_abort_fail_the_room() -> None:
    model, done = _prefill()
    _submit_pd(model, "a", PROMPT)
    model.bootstrapped("a", transfer_failure="Prefill transfer failed: boom")
    (out,) = _run(model)
    assert out.finish is not None and out.finish.status_code == 500
    assert out.finish.message == "Prefill transfer failed: boom"
    assert done[-1] == ("a", None, "Prefill transfer failed: boom")
    assert model.pd.transfer_failed == 1
    _submit_pd(model, "b", PROMPT)
    model.abort("b", 0.0)
    (out,) = _run(model)
    assert out.finish is not None and out.finish.kind == "abort"
    assert done[-1] == ("b", None, ABORTED)


def test_prefill_bootstrap_failure_is_a_500_counted_as_such() -> None:
    model, _ = _prefill()
    _submit_pd(model, "a", PROMPT)
    assert model.fail("a", "Prefill bootstrap failed: timeout", 1.0, bootstrap=True)
    (out,) = _run(model)
    assert out.finish is not None and out.finish.status_code == 500
    assert model.pd.bootstrap_failed == 1 and not model.holds("a")
    assert not model.fail("a", "again", 1.0, bootstrap=True)


def test_a_request_that_is_not_disaggregated_runs_as_usual_on_a_prefill() -> None:
    model, done = _prefill()
    model.submit(SimRequest("h", [0], max_new_tokens=3), 0.0)
    outputs = _run(model)
    assert outputs[-1].finish is not None and outputs[-1].completion_tokens == 3
    assert done == []


def test_a_request_without_a_room_is_rejected_with_a_400() -> None:
    model, _ = _prefill()
    model.reject("r", "Invalid request: no room")
    model.submit(SimRequest("r", PROMPT), 0.0)
    (out,) = _run(model)
    assert out.finish is not None and (out.finish.status_code, out.finish.message) == (
        400,
        "Invalid request: no room",
    )


# ---------------------------------------------------------------------- decode
def test_decode_waits_for_the_kv_then_decodes_with_the_prefills_token_and_hit() -> None:
    model = DecodeWorkerModel.build(SimConfig())
    _submit_pd(model, "a", PROMPT, n=6)
    assert _run(model) == [] and model.num_prealloc == 1
    assert model.bootstrapped("a") and model.num_transfer == 1 and model.num_prealloc == 0
    assert model.kv_arrived("a", Handoff(len(PROMPT), 640, 4242))
    outputs = _run(model)
    assert outputs[0].first_token and outputs[0].completion_tokens == 2
    final = outputs[-1]
    assert final.finish is not None and final.completion_tokens == 6
    assert final.cached_tokens == 640 and final.output_ids[0] == 4242
    assert model.counters.prefill_uncached_tokens == 0  # no prefill step
    assert model.cache.used == 0 and model.cache.evictable == 0  # no radix cache


def test_decode_failure_is_a_500() -> None:
    model = DecodeWorkerModel.build(SimConfig())
    _submit_pd(model, "a", PROMPT)
    model.bootstrapped("a")
    assert model.fail("a", "Decode transfer failed: lost", 0.0, bootstrap=False)
    (out,) = _run(model)
    assert out.finish is not None and (out.finish.status_code, out.finish.message) == (
        500,
        "Decode transfer failed: lost",
    )
    assert model.pd.transfer_failed == 1 and model.num_transfer == 0
    assert not model.kv_arrived("a", Handoff(1, 0, 1))


def test_decode_commits_only_while_kv_slots_can_be_had() -> None:
    model = DecodeWorkerModel.build(SimConfig(capacity_tokens=1500))
    for rid in ("a", "b"):
        _submit_pd(model, rid, PROMPT, n=4)
        model.bootstrapped(rid)
        model.kv_arrived(rid, Handoff(len(PROMPT), 0, 1))
    outputs = _run(model)
    finished = [o.rid for o in outputs if o.finish is not None]
    assert finished == ["a", "b"]  # b waited for a's slots


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"disaggregation_mode": "both"}, "disaggregation_mode must be one of"),
        (
            {"disaggregation_mode": "prefill", "disaggregation_transfer_backend": "fake"},
            "Prefill server does not support 'fake'",
        ),
        ({"disaggregation_transfer_backend": "tcp"}, "disaggregation_transfer_backend"),
        ({"disaggregation_bootstrap_port": 70000}, "disaggregation_bootstrap_port"),
        ({"transfer_profile": "pigeon"}, "unknown transfer profile"),
        ({"waiting_timeout_s": 0}, "must be positive"),
        ({"disaggregation_mode": "decode", "dp_size": 2}, "dp_size 1 only"),
        ({"disaggregation_mode": "decode", "engine": "llamacpp"}, "sglang engine"),
    ],
)
def test_settings_are_checked(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimConfig(**changes).validate()  # type: ignore[arg-type]


def test_faults_take_the_pd_fields() -> None:
    faults = Faults()
    faults.update({"transfer_fail_rate": 1, "bootstrap_fail": True})
    assert faults.transfer_fail_rate == 1.0 and faults.bootstrap_fail
    for bad in ({"transfer_fail_rate": 2}, {"transfer_fail_rate": "x"}, {"bootstrap_fail": 1}):
        with pytest.raises(ValueError):
            faults.update(bad)
    assert faults.transfer_fail_rate == 1.0


def test_the_command_line_sets_the_pd_role(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "42")
    args = build_parser().parse_args(
        [
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            "9100",
            "--transfer-profile",
            "tcp-25g",
            "--transfer-fail-rate",
            "0.5",
            "--bootstrap-fail",
        ]
    )
    config = config_from_args(args)
    config.validate()
    assert (config.disaggregation_mode, config.disaggregation_bootstrap_port) == ("prefill", 9100)
    assert config.transfer_profile == "tcp-25g" and config.waiting_timeout_s == 42.0
    assert (
        config.bootstrap_timeout_s == 300.0 and config.disaggregation_transfer_backend == "mooncake"
    )
    assert config.faults.transfer_fail_rate == 0.5 and config.faults.bootstrap_fail
    assert SimConfig().disaggregation_bootstrap_port == 8998
