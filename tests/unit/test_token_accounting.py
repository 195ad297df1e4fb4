"""Token accounting (``gateway.routing.tokens``): characters per token learnt from the
workers' ``usage.prompt_tokens``, so that the prefix index holds what the engines hold on
any tokenizer.
"""

from __future__ import annotations

import random

import pytest

from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RequestSettings, parse_request
from gateway.routing.tokens import MAX_MODELS, TokenAccounting
from loadtests.replay.hashes import parse_body
from loadtests.replay.sim import Prepared, Simulation
from loadtests.replay.workers import make_workers
from loadtests.workloads import create_workload
from loadtests.workloads.base import WorkloadRequest
from policies.registry import create_policy
from simulator.model.radix_cache import encode_tokens

MODEL = "dense-model"
# ten agents' ~3,000-token prompts (at 1.2 bytes per token), eight requests each
DENSE_WORKLOAD = ["num_groups=10", "prompts_per_group=8", "system_prompt_len=900",
                  "question_len=20", "output_len=2", "request_rate=1", "seed=1"]  # fmt: skip


def _chat(text: str, model: str = MODEL) -> bytes:
    return b'{"model":"%s","messages":[{"role":"user","content":"%s"}]}' % (
        model.encode(),
        text.encode(),
    )


def test_a_dense_tokenizer_is_learnt_from_a_few_answers() -> None:
    acc = TokenAccounting(4.0, 64)
    req = parse_request(ApiKind.CHAT, _chat("x" * 3600), {}, RequestSettings())
    chars = req.prompt_chars
    assert req.prompt_tokens == -(-chars // 4)  # the prior until a worker tells better
    for _ in range(3):
        acc.observe("w0", req, round(chars / 1.2))  # ~1.2 bytes per token, as measured
    acc.estimate(req)
    assert req.prompt_tokens == pytest.approx(chars / 1.2, rel=0.05)
    assert acc.worker_chars_per_token("w0") == pytest.approx(1.2, rel=0.05)
    assert acc.chars_per_token("another-model") == 4.0  # models are learnt apart
    described = acc.describe()
    assert described["models"][MODEL]["samples"] == 3
    assert described["workers"]["w0"]["chars_per_token"] == pytest.approx(1.2, rel=0.05)


def test_token_ids_and_nonsense_teach_nothing() -> None:
    acc = TokenAccounting(4.0, 64)
    ids = parse_request(ApiKind.GENERATE, b'{"input_ids":[1,2,3,4]}', {}, RequestSettings())
    assert ids.tokens_exact and ids.prompt_tokens == 4
    acc.observe("w0", ids, 400)
    acc.estimate(ids)
    assert ids.prompt_tokens == 4 and acc.describe()["models"] == {}
    text = parse_request(ApiKind.CHAT, _chat("y" * 400), {}, RequestSettings())
    for reported in (None, 0, -5, 100_000):  # missing, empty, negative, absurd (0.004 c/t)
        acc.observe("w0", text, reported)
    assert acc.describe()["workers"] == {}


def test_the_workers_index_follows_its_ratio() -> None:
    calls: list[tuple[str, float]] = []
    acc = TokenAccounting(4.0, 64, on_worker_ratio=lambda w, bt: calls.append((w, bt)))
    req = parse_request(ApiKind.CHAT, _chat("z" * 6000), {}, RequestSettings())
    acc.observe("w0", req, req.prompt_chars // 4)  # agrees with the prior: nothing to do
    assert calls == []
    for _ in range(60):
        acc.observe("w0", req, round(req.prompt_chars / 1.2))
    assert calls and {w for w, _ in calls} == {"w0"}
    assert len(calls) < 10  # re-sized when it moved by over 10 %, not at every answer
    assert calls[-1][1] == pytest.approx(64 / 1.2, rel=0.1)
    assert calls[-1][1] == pytest.approx(64 / acc.worker_chars_per_token("w0"), rel=0.1)

    index = PrefixIndex(block_tokens=16.0)
    index.set_capacity("w0", 8192)
    assert index.capacity_blocks("w0") == 512  # 8,192 tokens believed 512 blocks at 4.0
    index.set_block_tokens("w0", 64 / 1.2)
    assert index.capacity_blocks("w0") == 154  # ... but hold 154 at 1.2 bytes per token


def _dense_prepare(req: WorkloadRequest) -> Prepared:
    """The gateway's parse of the body, and the prompt a worker with a dense tokenizer
    would compute: 53 token ids for each 64 bytes of the canonical prompt (1.2 bytes per
    token), the same ids for the same block (chained hashes: a shared prefix is shared)."""
    route = parse_body(req, RequestSettings(), MODEL)
    ids: list[int] = []
    for h in route.block_hashes:
        block = random.Random(h)
        ids.extend(block.randrange(1, 1 << 30) for _ in range(53))
    return Prepared(route, encode_tokens(ids))


def _phantom_hits(learn: bool) -> tuple[int, int]:
    """(decisions that counted on a prefix the engine no longer held, decisions)."""
    workload = create_workload("generated-shared-prefix", DENSE_WORKLOAD)
    sim = Simulation(create_policy("cache_aware"), make_workers(2, 8192, "tiny-cpu"), 8192,
                     _dense_prepare, seed=3)  # fmt: skip
    if not learn:
        sim.core.tokens = None  # the fixed 4.0 of before
    outcome = sim.run(workload.requests)
    phantom = sum(1 for r in outcome.records if r.predicted_tokens > 0 and r.true_match_tokens == 0)
    return phantom, len(outcome.records)


def test_with_a_dense_tokenizer_the_index_stops_counting_on_evicted_prompts() -> None:
    fixed, n = _phantom_hits(learn=False)
    learnt, _ = _phantom_hits(learn=True)
    # each worker's 8,192 tokens hold about two of these ~3,000-token prompts; at 4.0
    # bytes per token the index believes it holds seven and routes on prompts evicted
    # (measured: 28 of 80 decisions at 4.0, 3 with the learnt ratio)
    assert fixed >= n // 5, (fixed, n)
    assert learnt <= fixed // 4, (learnt, fixed)


def test_client_chosen_model_names_are_bounded() -> None:
    acc = TokenAccounting(4.0, 64)
    for i in range(200):
        req = parse_request(ApiKind.CHAT, _chat("w" * 640, model=f"m{i}"), {}, RequestSettings())
        acc.observe("w0", req, 400)
    models = acc.describe()["models"]
    assert len(models) <= MAX_MODELS + 1  # the named ones, and the shared "" estimate
    assert acc.chars_per_token("m199") == pytest.approx(models[""]["chars_per_token"])
