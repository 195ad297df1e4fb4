"""Unit tests of the llama.cpp slot model, driven with a virtual clock."""

from __future__ import annotations

import random

import pytest

from simulator.config import SimConfig
from simulator.model.profiles import get_profile
from simulator.model.requests import RequestOutput, SimRequest, StepResult
from simulator.model.slots import ContextTooLong, SlotWorkerModel

TINY = get_profile("tiny-cpu")


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 2000) for _ in range(n)]


def drive(
    model: SlotWorkerModel, now: float = 0.0, max_steps: int = 100_000
) -> tuple[float, list[RequestOutput], list[StepResult]]:
    """Step until idle."""
    outputs: list[RequestOutput] = []
    steps: list[StepResult] = []
    for _ in range(max_steps):
        result = model.step(now)
        if result is None:
            return now, outputs, steps
        steps.append(result)
        outputs.extend(result.outputs)
        now = result.end
    raise AssertionError("never idle")


def finish_of(outputs: list[RequestOutput], rid: str) -> RequestOutput:
    return next(o for o in outputs if o.rid == rid and o.finish is not None)


def first_token_time(outputs: list[RequestOutput], rid: str) -> float:
    return next(o.time for o in outputs if o.rid == rid and o.first_token)


def run(
    model: SlotWorkerModel, rid: str, prompt: list[int], now: float
) -> tuple[RequestOutput, float]:
    """Submit one request alone, run it to the end; its finish output and the end time."""
    model.submit(SimRequest(rid, prompt, max_new_tokens=4, ignore_eos=True), now)
    end, outputs, _ = drive(model, now)
    return finish_of(outputs, rid), end


def cached(model: SlotWorkerModel, rid: str, prompt: list[int], now: float) -> tuple[int, float]:
    done, end = run(model, rid, prompt, now)
    return done.cached_tokens, end


def test_repeat_is_cached_but_one_token_and_costs_the_formula() -> None:
    model = SlotWorkerModel(TINY, slots=2, n_ctx=4096)
    prompt = tokens(2000, 1)
    model.submit(SimRequest("a", prompt, max_new_tokens=3, ignore_eos=True), 0.0)
    end, outputs, _ = drive(model)
    assert first_token_time(outputs, "a") == pytest.approx(TINY.prefill_time(2000, 0))
    assert finish_of(outputs, "a").cached_tokens == 0
    start = end + 1.0
    model.submit(SimRequest("b", prompt, max_new_tokens=3, ignore_eos=True), start)
    _, outputs, _ = drive(model, start)
    assert finish_of(outputs, "b").cached_tokens == 1999
    assert first_token_time(outputs, "b") - start == pytest.approx(TINY.prefill_time(1, 1999))
    c = model.counters
    assert (c.prompt_tokens, c.prompt_tokens_cached, c.tokens_predicted) == (2001, 1999, 6)


def test_slot_content_is_prompt_plus_generated_tokens() -> None:
    model = SlotWorkerModel(TINY, slots=1, n_ctx=4096)
    prompt = tokens(50, 2)
    model.submit(SimRequest("a", prompt, max_new_tokens=5, ignore_eos=True), 0.0)
    _, outputs, _ = drive(model)
    out = list(finish_of(outputs, "a").output_ids)
    assert len(out) == 5
    # the last sampled token never got KV
    assert model.slot_contents() == [prompt + out[:4]]
    # a follow-up that extends prompt + answer (a chat's next turn) reuses all of it
    follow = prompt + out[:4] + tokens(30, 3)
    hit, _ = cached(model, "b", follow, 10.0)
    assert hit == 54


def test_a_prompt_takes_the_most_similar_idle_slot() -> None:
    model = SlotWorkerModel(TINY, slots=3, n_ctx=4096)
    a, b, c = tokens(400, 10), tokens(400, 11), tokens(400, 12)
    now = 0.0
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        _, now = run(model, rid, prompt, now)
    # b was neither the first nor the last used: chosen by similarity, not LRU
    sibling = b[:300] + tokens(100, 13)
    hit, now = cached(model, "b2", sibling, now)
    assert hit == 300
    contents = model.slot_contents()
    assert sum(1 for s in contents if s[:400] == a) == 1  # a and c kept
    assert sum(1 for s in contents if s[:400] == c) == 1
    assert sum(1 for s in contents if s[:300] == b[:300]) == 1


def test_below_the_similarity_threshold_the_lru_idle_slot_is_overwritten() -> None:
    model = SlotWorkerModel(TINY, slots=2, n_ctx=4096)
    a, b = tokens(500, 20), tokens(500, 21)
    _, now = run(model, "a", a, 0.0)
    _, now = run(model, "b", b, now)
    # shares 40 tokens (8 %) with b only: not similar enough, so the LRU slot (a's) is taken
    weak = b[:40] + tokens(460, 22)
    hit, now = cached(model, "weak", weak, now)
    assert hit == 0
    assert b in [s[:500] for s in model.slot_contents()]
    hit_a, now = cached(model, "a2", a, now)
    assert hit_a == 0  # a was evicted
    # A, B, C on 2 slots: the repeat of C is cached, the repeat of A is not (REAL_ENGINE.md)
    model = SlotWorkerModel(TINY, slots=2, n_ctx=4096)
    c = tokens(500, 23)
    now = 0.0
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        _, now = run(model, rid, prompt, now)
    assert cached(model, "c2", c, now)[0] == 499
    assert cached(model, "a2", a, now + 10)[0] == 0


def test_never_used_slots_come_first_in_lru_order() -> None:
    model = SlotWorkerModel(TINY, slots=3, n_ctx=4096)
    a, b, c = tokens(300, 30), tokens(300, 31), tokens(300, 32)
    _, now = run(model, "a", a, 0.0)
    _, now = run(model, "b", b, now)
    _, now = run(model, "c", c, now)
    assert [s[:300] for s in model.slot_contents()] == [a, b, c]


def test_concurrent_siblings_share_no_kv_and_the_third_waits() -> None:
    model = SlotWorkerModel(TINY, slots=2, n_ctx=4096)
    prefix = tokens(1000, 40)
    p1, p2, p3 = (prefix + tokens(50, 41 + i) for i in range(3))
    for rid, prompt in (("x", p1), ("y", p2), ("z", p3)):
        model.submit(SimRequest(rid, prompt, max_new_tokens=8, ignore_eos=True), 0.0)
    first = model.step(0.0)
    assert first is not None
    assert (model.requests_processing, model.requests_deferred) == (2, 1)
    assert first.prefill_tokens == 2048  # both prompts (1,050 + 998) fill one n_batch
    _, outputs, _ = drive(model, first.end)
    outputs = first.outputs + outputs
    # x and y ran at once in different slots: y recomputed the prefix (no sharing)
    assert finish_of(outputs, "x").cached_tokens == 0
    assert finish_of(outputs, "y").cached_tokens == 0
    # z waited for a slot, then found the prefix in one
    assert finish_of(outputs, "z").cached_tokens == 1000
    assert first_token_time(outputs, "z") > finish_of(outputs, "x").time
    assert model.requests_deferred == 0 and model.idle


def test_one_batch_mixes_decode_tokens_and_prompt_chunks() -> None:
    model = SlotWorkerModel(TINY, slots=2, n_ctx=8192, n_batch=512)
    model.submit(SimRequest("short", tokens(100, 50), max_new_tokens=50, ignore_eos=True), 0.0)
    step = model.step(0.0)
    assert step is not None and step.kind == "prefill"
    model.submit(SimRequest("long", tokens(3000, 51), max_new_tokens=2, ignore_eos=True), step.end)
    mixed = model.step(step.end)
    assert mixed is not None and mixed.kind == "mixed"
    assert (mixed.decode_batch, mixed.prefill_tokens) == (1, 511)
    decode = TINY.decode_floor_s + TINY.decode_per_context_token_s * 101 + TINY.decode_overhead_s
    assert mixed.duration == pytest.approx(TINY.prefill_time(511, 0) + decode)


def test_prompt_longer_than_a_slot_is_refused() -> None:
    model = SlotWorkerModel(TINY, slots=2, n_ctx=1000)
    with pytest.raises(ContextTooLong, match=r"request \(1000 tokens\) exceeds .* \(1000 tokens\)"):
        model.submit(SimRequest("big", tokens(1000, 60)), 0.0)
    model.submit(SimRequest("fits", tokens(990, 61), max_new_tokens=100, ignore_eos=True), 0.0)
    _, outputs, _ = drive(model)
    done = finish_of(outputs, "fits")
    assert done.completion_tokens == 10 and done.finish is not None
    assert done.finish.kind == "length"


def test_abort_frees_the_slot_for_the_waiting_request() -> None:
    model = SlotWorkerModel(TINY, slots=1, n_ctx=4096)
    model.submit(SimRequest("long", tokens(100, 70), max_new_tokens=1000, ignore_eos=True), 0.0)
    model.submit(SimRequest("next", tokens(100, 71), max_new_tokens=2, ignore_eos=True), 0.0)
    step = model.step(0.0)
    assert step is not None and model.requests_deferred == 1
    model.abort("long", step.end)
    _, outputs, _ = drive(model, step.end)
    long = finish_of(outputs, "long")
    assert long.finish is not None and long.finish.kind == "abort"
    assert finish_of(outputs, "next").completion_tokens == 2
    assert model.counters.aborted == 1 and model.idle


def test_eos_and_from_config() -> None:
    config = SimConfig(engine="llamacpp", slots=4, profile="tiny-cpu", context_length=16384)
    model = SlotWorkerModel.from_config(config)
    assert (model.slots, model.n_ctx, len(model.slot_list)) == (4, 4096, 4)
    model.submit(SimRequest("e", tokens(10, 80), max_new_tokens=50, eos_at=3), 0.0)
    _, outputs, _ = drive(model)
    done = finish_of(outputs, "e")
    assert done.finish is not None and done.finish.kind == "stop"
    assert done.completion_tokens == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"engine": "vllm"}, "engine must be one of"),
        ({"engine": "llamacpp", "slots": 0}, "slots must be at least 1"),
        ({"engine": "llamacpp", "slots": 4, "context_length": 7}, "less than 2 tokens per slot"),
        ({"engine": "llamacpp", "kv_events_config": "{}"}, "no KV events"),
    ],
)
def test_config_validation(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimConfig(**overrides).validate()  # type: ignore[arg-type]


def test_tiny_llamacpp_profile_reproduces_the_measured_engine() -> None:
    """The profile the real-engine benchmark simulates, against REAL_ENGINE.md's
    quiet-machine measurements of the tiny model on llama.cpp (1 thread): a cold
    2,000-token prompt 1.66 s, 200 new tokens over a cached 1,800-token prefix 0.244 s, an
    exact repeat 12 ms (within 15 %, or a few ms for the last)."""
    profile = get_profile("tiny-llamacpp")
    model = SlotWorkerModel(profile, slots=2, n_ctx=4096)
    prefix = tokens(1800, 7)
    cold = [*prefix, *tokens(200, 8)]
    model.submit(SimRequest("cold", cold, max_new_tokens=1, ignore_eos=True), 0.0)
    end, outputs, _ = drive(model)
    assert first_token_time(outputs, "cold") == pytest.approx(1.66, rel=0.15)
    start = end + 1.0
    warm = [*prefix, *tokens(200, 9)]
    model.submit(SimRequest("warm", warm, max_new_tokens=1, ignore_eos=True), start)
    end, outputs, _ = drive(model, start)
    assert finish_of(outputs, "warm").cached_tokens == 1800
    assert first_token_time(outputs, "warm") - start == pytest.approx(0.24, rel=0.15)
    long = tokens(2310, 10)
    _, end = run(model, "long", long, end + 1.0)
    start = end + 1.0
    model.submit(SimRequest("repeat", long, max_new_tokens=1, ignore_eos=True), start)
    _, outputs, _ = drive(model, start)
    assert first_token_time(outputs, "repeat") - start < 0.012 + 0.005
