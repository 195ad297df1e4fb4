"""Cache tiers in exact mode (issue 20): the KV events' ``medium`` read in both
encodings, one set per medium in the exact index, and a match split into the GPU part and
the host part that continues it, checked against what a simulated HiCache worker then
reports (``cached_tokens_details``)."""

from __future__ import annotations

import random

import msgpack
import pytest

from gateway.exact.index import ExactIndex
from gateway.exact.wire import GPU, HOST, OTHER, Removed, Stored, decode_batch, medium_of
from loadtests.replay.exact import ReplayExact
from loadtests.replay.workers import ModelWorker
from simulator.config import SimConfig
from simulator.model.radix_cache import encode_tokens

PAGE = 16


def test_medium_is_read_from_maps_and_arrays() -> None:
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": list(range(4)), "block_size": 4, "lora_id": None}  # fmt: skip
    events = [
        stored,
        {**stored, "block_hashes": [2], "parent_block_hash": 1, "medium": "CPU_PINNED"},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU_PINNED"},
        ["BlockStored", [3], None, list(range(4)), 4, None, "CPU_PINNED"],
        ["BlockStored", [4], None, list(range(4)), 4, None],  # <= 0.5.5: no medium
        ["BlockRemoved", [3], "CPU_PINNED"],
        ["BlockRemoved", [4]],
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "DISK"},
    ]
    _, got, _ = decode_batch(msgpack.packb([1.0, events, 0]))
    mediums = [e.medium for e in got if isinstance(e, Stored | Removed)]
    assert mediums == [GPU, HOST, GPU, HOST, HOST, GPU, HOST, GPU, OTHER]
    assert [medium_of(m) for m in (None, "gpu", "CPU", "cpu_pinned", "EXTERNAL", 3)] == [
        GPU, GPU, HOST, HOST, OTHER, OTHER,
    ]  # fmt: skip


def _store(hashes: list[int], parent: int | None, first: int, medium: str) -> Stored:
    tokens = list(range(first, first + 4 * len(hashes)))
    return Stored(hashes, parent, tokens, 4, medium=medium)


def test_one_set_per_medium() -> None:
    ix = ExactIndex()
    stored = ix.apply("w", 0, _store([1, 2], None, 0, GPU), 4)
    ours = list(stored)
    assert len(ours) == 2 and all(ix.holds("w", h) for h in ours)
    assert ix.apply("w", 0, _store([1, 2], None, 0, HOST), 4) == []  # a copy: not new
    assert all(ix.holds_host("w", h) for h in ours)
    ix.apply("w", 0, Removed([2], GPU), 4)  # demoted: host-only
    assert ix.holds("w", ours[0]) and not ix.holds("w", ours[1])
    assert ix.holds_host("w", ours[1]) and (ix.blocks("w"), ix.host_blocks("w")) == (1, 2)
    # a host copy hanging off a GPU block, and a GPU block loaded back under a host one
    more = ix.apply("w", 0, _store([3], 2, 8, GPU), 4)
    assert more and ix.holds("w", more[0])
    ix.apply("w", 0, Removed([1, 2], HOST), 4)
    assert ix.host_blocks("w") == 0 and ix.holds("w", ours[0])
    ix.apply("w", 0, _store([9], None, 100, "other"), 4)  # a storage tier: not followed
    assert ix.blocks("w") == 2
    ix.clear("w")
    assert (ix.blocks("w"), ix.host_blocks("w")) == (0, 0)


def test_host_tier_off_reads_the_gpu_only() -> None:
    ix = ExactIndex(host_tier=False)
    ours = ix.apply("w", 0, _store([1, 2], None, 0, GPU), 4)
    ix.apply("w", 0, _store([1, 2], None, 0, HOST), 4)
    ix.apply("w", 0, Removed([2], HOST), 4)  # under write-back: a GPU block's host copy
    assert all(ix.holds("w", h) for h in ours) and ix.host_blocks("w") == 0
    ix.apply("w", 0, Removed([2], GPU), 4)
    assert not ix.holds("w", ours[1])


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_exact_tiers_predict_what_a_hicache_worker_reports(policy: str) -> None:
    """Requests one at a time on a simulated HiCache worker whose GPU holds about two of
    the prompts: before each, the gateway's exact match (its events applied) split by
    tier equals the worker's ``cached_tokens`` and host part for that request."""
    config = SimConfig(capacity_tokens=3000, page_size=PAGE, context_length=4096,
                       enable_hierarchical_cache=True, hicache_write_policy=policy)  # fmt: skip
    worker = ModelWorker(config, kv_events=True)
    now = 0.0
    exact = ReplayExact(["w"], PAGE, lambda: now, hybrid=False, delay_s=0.0)
    rng = random.Random(3)
    prefixes = [[rng.randrange(1, 500) for _ in range(900)] for _ in range(6)]
    hosts = 0
    try:
        for i in range(60):
            prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(20)]
            key = encode_tokens(prompt)
            req = exact.request(key)
            predicted = req.match(["w"])["w"]
            host = req.host_tokens().get("w", 0)
            worker.submit(f"r{i}", key, 2, now)
            reported: tuple[int, int] | None = None
            while (stepped := worker.step(now)) is not None:
                now += stepped[0]
                batch = worker.kv_batch(now)
                if batch is not None:
                    exact.publish("w", batch, now)
                    exact.deliver(now)
                for out in stepped[1]:
                    if out.first_token:
                        reported = (out.cached_tokens, out.cached_host)
            assert reported == (predicted, host), i
            hosts += host > 0
    finally:
        exact.close()
    assert hosts >= 5  # host hits happened and were predicted
