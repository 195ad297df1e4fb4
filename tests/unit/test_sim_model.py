"""Unit tests of the worker model, driven with a virtual clock."""

from __future__ import annotations

import random

import pytest

from simulator.model.profiles import get_profile
from simulator.model.radix_cache import encode_tokens
from simulator.model.radix_worker import WorkerModel
from simulator.model.requests import RequestOutput, SimRequest, StepResult
from simulator.model.tokenizer import IM_END_ID

H100 = get_profile("llama3-8b-h100")


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 100_000) for _ in range(n)]


def drive(
    model: WorkerModel, now: float = 0.0, until_idle: bool = True, max_steps: int = 100_000
) -> tuple[float, list[RequestOutput], list[StepResult]]:
    """Step until idle, checking the cache's invariants after every step."""
    outputs: list[RequestOutput] = []
    steps: list[StepResult] = []
    for _ in range(max_steps):
        result = model.step(now)
        if result is None:
            return now, outputs, steps
        steps.append(result)
        outputs.extend(result.outputs)
        now = result.end
        model.cache.check_invariants()
        assert model.cache.used + model.cache.evictable <= model.cache.capacity
        if not until_idle:
            break
    return now, outputs, steps


def first_token_time(outputs: list[RequestOutput], rid: str) -> float:
    return next(o.time for o in outputs if o.rid == rid and o.first_token)


def finish_of(outputs: list[RequestOutput], rid: str) -> RequestOutput:
    return next(o for o in outputs if o.rid == rid and o.finish is not None)


def test_cold_and_cached_8k_ttft_match_the_formula() -> None:
    model = WorkerModel(H100)
    prompt = tokens(8000, 1)
    model.submit(SimRequest("cold", prompt, max_new_tokens=8), 0.0)
    end, outputs, _ = drive(model)
    cold_ttft = first_token_time(outputs, "cold")
    assert cold_ttft == pytest.approx(H100.prefill_time(8000, 0))
    assert cold_ttft == pytest.approx(0.005 + 22e-6 * 8000 + 1.3e-9 * 8000 * 4000)
    assert finish_of(outputs, "cold").cached_tokens == 0

    start = end + 1.0
    model.submit(SimRequest("warm", prompt, max_new_tokens=8), start)
    _, outputs, _ = drive(model, start)
    warm_ttft = first_token_time(outputs, "warm") - start
    assert finish_of(outputs, "warm").cached_tokens == 7999  # capped at prompt_len - 1
    assert warm_ttft == pytest.approx(H100.prefill_time(1, 7999))
    assert cold_ttft / warm_ttft > 40


def test_cached_tokens_rounded_down_to_a_page() -> None:
    model = WorkerModel(H100, page_size=16)
    prompt = tokens(1000, 2)
    model.submit(SimRequest("a", prompt, max_new_tokens=2), 0.0)
    end, _, _ = drive(model)
    model.submit(SimRequest("b", prompt, max_new_tokens=2), end)
    _, outputs, _ = drive(model, end)
    assert finish_of(outputs, "b").cached_tokens == (999 // 16) * 16


def test_chunked_prefill_inserts_after_each_chunk() -> None:
    model = WorkerModel(H100)
    prompt = tokens(20_000, 3)
    key = encode_tokens(prompt)
    model.submit(SimRequest("long", prompt, max_new_tokens=2), 0.0)
    first = model.step(0.0)
    assert first is not None and first.kind == "prefill" and first.prefill_tokens == 8192
    assert model.cache.peek_prefix(key) == 8192  # hittable before the prompt finishes
    assert first.duration == pytest.approx(H100.prefill_time(8192, 0))
    second = model.step(first.end)
    assert second is not None and second.prefill_tokens == 8192
    assert second.duration == pytest.approx(H100.prefill_time(8192, 8192))
    assert model.cache.peek_prefix(key) == 16384
    third = model.step(second.end)
    assert third is not None and third.prefill_tokens == 20_000 - 16384
    assert any(o.first_token for o in third.outputs)


def test_decode_step_duration_and_batching() -> None:
    model = WorkerModel(H100)
    for i in range(3):
        model.submit(SimRequest(f"r{i}", tokens(1000, 10 + i), max_new_tokens=5), 0.0)
    prefill = model.step(0.0)
    assert prefill is not None and prefill.prefill_tokens == 3000  # one batch, three requests
    decode = model.step(prefill.end)
    assert decode is not None and decode.kind == "decode" and decode.decode_batch == 3
    sum_ctx = 3 * 1001
    assert decode.duration == pytest.approx(0.006 + 45e-9 * sum_ctx + 0.0005)
    _, outputs, _ = drive(model, decode.end)
    assert {o.rid for o in outputs if o.finish} == {"r0", "r1", "r2"}
    assert all(o.finish.length == 5 for o in outputs if o.finish)


def test_max_running_requests_bounds_admission() -> None:
    model = WorkerModel(H100, max_running_requests=2)
    for i in range(4):
        model.submit(SimRequest(f"r{i}", tokens(100, 20 + i), max_new_tokens=50), 0.0)
    model.step(0.0)
    assert model.num_running == 2 and model.num_waiting == 2


def test_filling_past_capacity_evicts_lru_unlocked_prefixes_only() -> None:
    """Capacity 10k tokens, 12 distinct 2k-token prompts one after another, plus one long
    request running throughout: the oldest finished prompts are evicted first, the running
    request's prefix never, and the pool is never over capacity (checked every step)."""
    model = WorkerModel(H100, capacity_tokens=10_000)
    runner = tokens(1500, 99)
    model.submit(SimRequest("runner", runner, max_new_tokens=3000), 0.0)
    now = model.step(0.0).end  # type: ignore[union-attr]
    prompts = [tokens(2000, 100 + i) for i in range(12)]
    for i, prompt in enumerate(prompts):
        model.submit(SimRequest(f"p{i}", prompt, max_new_tokens=1), now)
        while model.has_request(f"p{i}"):
            result = model.step(now)
            assert result is not None
            now = result.end
            model.cache.check_invariants()
            assert model.cache.used + model.cache.evictable <= 10_000
        assert model.has_request("runner")
        held = model.cache.peek_prefix(encode_tokens(runner))
        assert held == 1500, "a running request's prefix was evicted"
    cached = [model.cache.peek_prefix(encode_tokens(p)) for p in prompts]
    # 10k minus the runner's 1.5k prompt and growing output leave room for ~4 prompts
    assert cached[-1] == 2000 and cached[-2] == 2000
    assert cached[:8] == [0] * 8, cached
    assert model.cache.evicted_total > 0
    n_cached = sum(1 for c in cached if c)
    assert cached == [0] * (12 - n_cached) + [2000] * n_cached  # a suffix: LRU order


def test_namespaces_do_not_share_the_cache() -> None:
    model = WorkerModel(H100)
    prompt = tokens(500, 5)
    model.submit(SimRequest("a", prompt, max_new_tokens=1, namespace="tenant-a"), 0.0)
    end, _, _ = drive(model)
    model.submit(SimRequest("b", prompt, max_new_tokens=1, namespace="tenant-b"), end)
    model.submit(SimRequest("c", prompt, max_new_tokens=1, namespace="tenant-a"), end)
    _, outputs, _ = drive(model, end)
    assert finish_of(outputs, "b").cached_tokens == 0
    assert finish_of(outputs, "c").cached_tokens == 499


def test_output_length_eos_and_streaming_granularity() -> None:
    model = WorkerModel(H100)
    model.submit(SimRequest("len", tokens(50, 6), max_new_tokens=6), 0.0)
    model.submit(SimRequest("eos", tokens(50, 7), max_new_tokens=6, eos_at=3), 0.0)
    model.submit(SimRequest("quiet", tokens(50, 8), max_new_tokens=6, stream=False), 0.0)
    _, outputs, _ = drive(model)
    assert finish_of(outputs, "len").finish.kind == "length"  # type: ignore[union-attr]
    eos = finish_of(outputs, "eos")
    assert eos.finish is not None and eos.finish.kind == "stop" and eos.completion_tokens == 3
    assert eos.finish.matched == IM_END_ID and eos.output_ids[2] == IM_END_ID
    assert len([o for o in outputs if o.rid == "len"]) == 6  # one output per token
    assert len([o for o in outputs if o.rid == "quiet"]) == 2  # first token and finish


def test_abort_waiting_and_running() -> None:
    model = WorkerModel(H100, max_running_requests=1)
    model.submit(SimRequest("run", tokens(100, 9), max_new_tokens=1000), 0.0)
    model.submit(SimRequest("wait", tokens(100, 10), max_new_tokens=10), 0.0)
    first = model.step(0.0)
    assert first is not None
    model.abort("wait", first.end)
    model.abort("run", first.end)
    model.abort("unknown", first.end)
    _, outputs, _ = drive(model, first.end)
    kinds = {o.rid: o.finish.kind for o in outputs if o.finish}
    assert kinds == {"wait": "abort", "run": "abort"}
    assert model.idle and model.counters.aborted == 2
    assert model.cache.used == 0  # everything released
    assert model.cache.peek_prefix(encode_tokens(tokens(100, 9))) == 100  # prompt kept


def test_lpm_admits_cached_prefixes_first() -> None:
    shared = tokens(3000, 11)
    model = WorkerModel(H100, schedule_policy="lpm", max_running_requests=1)
    model.submit(SimRequest("warmup", shared, max_new_tokens=1), 0.0)
    end, _, _ = drive(model)
    model.submit(SimRequest("blocker", tokens(10, 12), max_new_tokens=3), end)
    model.submit(SimRequest("cold", tokens(3000, 13), max_new_tokens=1), end)
    model.submit(SimRequest("hot", shared + tokens(10, 14), max_new_tokens=1), end)
    _, outputs, _ = drive(model, end)
    order = [o.rid for o in outputs if o.finish]
    assert order.index("hot") < order.index("cold")


def test_retraction_under_memory_pressure_completes_everything() -> None:
    model = WorkerModel(H100, capacity_tokens=3000)
    for i in range(6):
        model.submit(SimRequest(f"r{i}", tokens(300, 30 + i), max_new_tokens=600), 0.0)
    _, outputs, _ = drive(model)
    finished = {o.rid: o for o in outputs if o.finish}
    assert set(finished) == {f"r{i}" for i in range(6)}
    assert all(o.finish is not None and o.finish.kind == "length" for o in finished.values())
    assert model.counters.retractions > 0
    assert model.cache.used == 0


def test_flush_refused_while_busy_and_duplicate_rid() -> None:
    model = WorkerModel(H100)
    model.submit(SimRequest("x", [0], max_new_tokens=1), 0.0)
    with pytest.raises(ValueError, match="Duplicate request ID"):
        model.submit(SimRequest("x", [0], max_new_tokens=1), 0.0)
    assert not model.flush_cache()
    drive(model)
    assert model.cache.tree_tokens == 1  # the 1-token key [0], like SGLang's health probe
    assert model.flush_cache()
    assert model.cache.tree_tokens == 0


def test_snapshots_lag_like_sglang() -> None:
    model = WorkerModel(H100)
    model.submit(SimRequest("a", tokens(100, 40), max_new_tokens=200), 0.0)
    prefill = model.step(0.0)
    assert prefill is not None
    assert model.metrics_snapshot.num_running_reqs == 1  # refreshed after the prefill
    now = prefill.end
    model.submit(SimRequest("b", tokens(10, 41), max_new_tokens=10), now)
    for _ in range(3):  # b's prefill refreshes; then decode steps do not (until 40)
        result = model.step(now)
        assert result is not None
        now = result.end
    assert model.load_snapshot.num_running_reqs == 2
    model.abort("b", now)
    for _ in range(5):
        result = model.step(now)
        assert result is not None
        now = result.end
    assert model.metrics_snapshot.num_running_reqs == 2  # stale: no prefill since
    assert model.stats(now).num_running_reqs == 1


def test_requests_are_clipped_to_fit_the_pool() -> None:
    """SGLang clips max_new_tokens so that prompt + output fits the pool (no deadlock)."""
    model = WorkerModel(H100, capacity_tokens=1000)
    model.submit(SimRequest("big", tokens(600, 50), max_new_tokens=4096), 0.0)
    _, outputs, _ = drive(model)
    assert finish_of(outputs, "big").completion_tokens == 999 - 600 - 1


def test_a_prompt_the_pool_cannot_take_is_aborted_by_the_scheduler() -> None:
    """As SGLang 0.5.23 (checked on the real server, tests/sglang): a prompt of at least
    ``min(context - 1, capacity - 1) - 5`` tokens is queued, then aborted with a 400 and
    ``validate_input_length``'s message; one token shorter runs."""
    model = WorkerModel(H100, capacity_tokens=1000)
    assert model.max_req_input_len == 994
    model.submit(SimRequest("huge", tokens(994, 51), max_new_tokens=1), 0.0)
    model.submit(SimRequest("fits", tokens(993, 52), max_new_tokens=1), 0.0)
    _, outputs, _ = drive(model)
    huge = finish_of(outputs, "huge").finish
    assert huge is not None and huge.kind == "abort" and huge.status_code == 400
    assert huge.err_type == "BadRequestError"
    assert huge.message == (
        "Input length (994 tokens) exceeds the maximum allowed length (994 tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )
    fits = finish_of(outputs, "fits").finish
    assert fits is not None and fits.kind == "length"


def test_mixed_chunk_steps() -> None:
    profile = H100.with_overrides(mixed_chunk=True)
    model = WorkerModel(profile)
    model.submit(SimRequest("a", tokens(100, 60), max_new_tokens=50), 0.0)
    first = model.step(0.0)
    assert first is not None and first.kind == "prefill"  # nothing to decode yet
    model.submit(SimRequest("b", tokens(300, 61), max_new_tokens=5), first.end)
    mixed = model.step(first.end)
    assert mixed is not None and mixed.kind == "mixed" and mixed.decode_batch == 1
    expected = max(0.006, 22e-6 * (300 + 1)) + 1.3e-9 * 300 * 150 + 45e-9 * (100 + 1) + 0.0005
    assert mixed.duration == pytest.approx(expected)
    _, outputs, _ = drive(model, mixed.end)
    assert {o.rid for o in outputs if o.finish} == {"a", "b"}
