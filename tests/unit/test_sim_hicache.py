"""Unit tests of the simulated HiCache host tier (issue 20), on the model's virtual clock:
what the GPU evicts moves to the host, a host hit is loaded (a transfer, not a prefill) and
reported as such, the host pool is a bounded LRU, the write policies differ where routing
can see it, and the KV events carry their medium."""

from __future__ import annotations

import random
from typing import Any

import pytest

from loadtests.replay.workers import ModelWorker
from simulator.__main__ import build_parser, config_from_args
from simulator.config import SimConfig
from simulator.http.kv_publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventRecorder,
    digest_to_hash,
)
from simulator.model.hicache import host_pool_tokens
from simulator.model.hiradix_cache import HiRadixCache
from simulator.model.radix_cache import RadixCache, encode_tokens
from simulator.model.radix_worker import WorkerModel
from simulator.model.requests import RequestOutput, SimRequest, StepResult
from simulator.model.transfer import HOST_LINK_PROFILES

CAPACITY = 4000
A = list(range(1, 3001))  # two 3,000-token prompts: the pool holds one of them
B = list(range(10_001, 13_001))


def hicache_model(
    policy: str = "write_through", listener: Any = None, **changes: Any
) -> WorkerModel:
    config = SimConfig(
        capacity_tokens=CAPACITY,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
        **changes,
    )
    config.validate()
    return WorkerModel.from_config(config, listener=listener)


def tiered(model: WorkerModel) -> HiRadixCache:
    assert model.tiered is not None
    return model.tiered


def run(
    model: WorkerModel, prompt: list[int], rid: str, now: float = 0.0, max_new: int = 4
) -> tuple[float, RequestOutput, list[StepResult]]:
    """Submit one request and step until idle (checking the invariants); its finish."""
    model.submit(SimRequest(rid, prompt, max_new_tokens=max_new), now)
    steps: list[StepResult] = []
    finish: RequestOutput | None = None
    while (result := model.step(now)) is not None:
        steps.append(result)
        now = result.end
        model.cache.check_invariants()
        for out in result.outputs:
            if out.rid == rid and out.finish is not None:
                finish = out
    assert finish is not None
    return now, finish, steps


# ---------------------------------------------------------------------- settings
def test_off_by_default_the_cache_is_the_plain_radix_cache() -> None:
    config = SimConfig()
    assert config.resolved_hicache() is None
    model = WorkerModel.from_config(config)
    assert model.tiered is None and type(model.cache) is RadixCache


def test_the_host_pool_is_sized_as_sglang_sizes_it() -> None:
    # ratio x device tokens (default 2.0), then size // page + 1 pages
    assert host_pool_tokens(4000, 1, None, 0, 131_072) == 8001
    assert host_pool_tokens(4000, 16, 1.5, 0, 131_072) == (6000 // 16 + 1) * 16
    # --hicache-size GB overrides the ratio: 10 GB of 128 KiB tokens
    assert host_pool_tokens(4000, 1, 2.0, 10, 131_072) == 10 * 10**9 // 131_072 + 1
    settings = SimConfig(capacity_tokens=4000, enable_hierarchical_cache=True).resolved_hicache()
    assert settings is not None and settings.host_tokens == 8001 and settings.ratio == 2.0
    assert settings.write_policy == "write_through" and settings.io_backend == "kernel"
    assert settings.link is HOST_LINK_PROFILES["pcie-gen5-x16"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hicache_write_policy": "write_around"}, "hicache_write_policy must be one of"),
        ({"hicache_io_backend": "dma"}, "hicache_io_backend must be one of"),
        ({"hicache_ratio": 0.0}, "hicache_ratio must be positive"),
        ({"hicache_size": -1}, "hicache_size must be >= 0"),
        ({"hicache_link": "pcie-gen9"}, "unknown host link profile 'pcie-gen9'"),
        ({"engine": "llamacpp"}, "llama.cpp has no host tier"),
        ({"disaggregation_mode": "decode"}, "not simulated on a decode server"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimConfig(enable_hierarchical_cache=True, **changes).validate()


def test_the_command_line_sets_the_host_tier() -> None:
    args = build_parser().parse_args(
        ["--enable-hicache", "--hicache-ratio", "3", "--hicache-write-policy", "write_back",
         "--hicache-io-backend", "direct", "--hicache-link", "pcie-gen4-x16",
         "--hicache-size", "40"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.enable_hierarchical_cache and config.hicache_ratio == 3.0
    assert config.hicache_write_policy == "write_back" and config.hicache_io_backend == "direct"
    assert config.hicache_link == "pcie-gen4-x16" and config.hicache_size == 40
    assert not config_from_args(build_parser().parse_args([])).enable_hierarchical_cache


# ---------------------------------------------------------------------- the tier
def test_device_eviction_moves_the_evicted_blocks_to_the_host() -> None:
    model = hicache_model()
    cache = tiered(model)
    now, _, _ = run(model, A, "a")
    assert cache.host_used == 3003  # write-through: copied when inserted (prompt + output)
    run(model, B, "b", now)
    # A's path (whole nodes) was evicted from the GPU for B and stays in the tree host-only
    host_only = list(cache.iter_host_nodes())
    assert sum(n.num_tokens for n in host_only) == 3003
    assert all(n.evicted and n.backuped for n in host_only)
    assert cache.host_used == 3003 + 3003  # B's copy too
    assert cache.peek_prefix(encode_tokens(A)) == 3000  # device part + host part
    assert cache.counters.backup_tokens == 3003 + 3003 and cache.counters.load_tokens == 0


def test_a_host_hit_is_reported_as_host_and_costs_a_load_not_a_prefill() -> None:
    model = hicache_model()
    cache = tiered(model)
    now, _, _ = run(model, A, "a")
    now, _, _ = run(model, B, "b", now)
    _, again, steps = run(model, A, "a2", now)
    assert again.cached_tokens == 2999 and again.cached_host > 2900
    assert cache.counters.load_tokens == again.cached_host
    # the prefill step: one new token, the host part loaded over PCIe Gen5 (overlapping
    # the tiny compute): the load's modelled time, not a 3,000-token prefill's
    load_s = model.hicache.copy_s(again.cached_host) if model.hicache else 0.0
    profile = model.profile
    compute_s = profile.prefill_time(1, 2999)
    assert steps[0].kind == "prefill" and steps[0].prefill_tokens == 1
    assert load_s > compute_s
    assert steps[0].duration == pytest.approx(load_s)
    plain = WorkerModel.from_config(SimConfig(capacity_tokens=CAPACITY))
    now, _, _ = run(plain, A, "a")
    now, _, _ = run(plain, B, "b", now)
    _, miss, plain_steps = run(plain, A, "a2", now)
    assert miss.cached_tokens == 0 and miss.cached_host == 0
    assert plain_steps[0].duration == pytest.approx(profile.prefill_time(3000, 0))
    assert plain_steps[0].duration > 8 * steps[0].duration


def test_an_instant_link_leaves_only_the_compute_and_direct_io_is_three_times_slower() -> None:
    durations = {}
    for link, backend in (("instant", "kernel"), ("pcie-gen5-x16", "kernel"),
                          ("pcie-gen5-x16", "direct")):  # fmt: skip
        model = hicache_model(hicache_link=link, hicache_io_backend=backend)
        now, _, _ = run(model, A, "a")
        now, _, _ = run(model, B, "b", now)
        _, again, steps = run(model, A, "a2", now)
        durations[link, backend] = steps[0].duration
    assert durations["instant", "kernel"] == pytest.approx(model.profile.prefill_time(1, 2999))
    gen5 = HOST_LINK_PROFILES["pcie-gen5-x16"]
    nbytes = again.cached_host * model.profile.kv_bytes_per_token
    assert durations["pcie-gen5-x16", "kernel"] == pytest.approx(
        gen5.fixed_latency_s + nbytes / gen5.bytes_per_s
    )
    assert durations["pcie-gen5-x16", "direct"] == pytest.approx(
        gen5.fixed_latency_s + 3 * nbytes / gen5.bytes_per_s
    )


def test_a_host_hit_under_ten_tokens_is_recomputed() -> None:
    model = hicache_model()
    short = list(range(50_001, 50_010))  # 9 tokens: a repeat would match 8
    now, _, _ = run(model, short, "s", max_new=1)
    long_ = list(range(60_001, 60_001 + CAPACITY - 7))  # the longest prompt the pool takes
    now, _, _ = run(model, long_, "fill", now, max_new=1)  # evicts the short one to the host
    assert tiered(model).peek_prefix(encode_tokens(short[:-1])) == 0
    _, again, _ = run(model, short, "s2", now, max_new=1)
    assert again.cached_tokens == 0 and again.cached_host == 0
    assert tiered(model).counters.load_tokens == 0


def test_the_host_pool_is_a_bounded_lru() -> None:
    # a host pool of ~1.5 prompts: the newest evicted prompt survives there, older ones go
    model = hicache_model(hicache_ratio=1.2)
    cache = tiered(model)
    assert cache.host_capacity == 4801
    prompts = [list(range(k * 10_000 + 1, k * 10_000 + 2001)) for k in range(1, 7)]
    now = 0.0
    for i, prompt in enumerate(prompts):
        now, _, _ = run(model, prompt, f"p{i}", now)
        assert cache.host_used <= cache.host_capacity
    assert cache.counters.host_evicted_tokens > 0
    assert cache.peek_prefix(encode_tokens(prompts[0])) == 0  # long gone from both tiers
    _, newest, _ = run(model, prompts[-2], "again", now)  # evicted from the GPU, on the host
    assert newest.cached_host > 0


# ---------------------------------------------------------------------- write policies
def test_write_through_copies_on_insert_selective_on_reuse_write_back_on_eviction() -> None:
    through, selective, back = (
        hicache_model(p) for p in ("write_through", "write_through_selective", "write_back")
    )
    for model in (through, selective, back):
        run(model, A, "a")
    assert tiered(through).host_used == 3003
    assert tiered(selective).host_used == 0 and tiered(back).host_used == 0
    # a second request through A's prefix is the selective policy's second hit
    shared = A[:2000] + list(range(70_001, 70_101))
    run(selective, shared, "s")
    assert tiered(selective).host_used == 2000
    run(back, shared, "s")
    assert tiered(back).host_used == 0  # still nothing: write-back copies only on eviction


def test_what_each_policy_keeps_when_the_gpu_evicts() -> None:
    outcome = {}
    for policy in ("write_through", "write_through_selective", "write_back"):
        model = hicache_model(policy)
        now, _, _ = run(model, A, "a")
        now, _, steps = run(model, B, "b", now)
        _, again, _ = run(model, A, "a2", now)
        counters = tiered(model).counters
        outcome[policy] = (again.cached_host, counters.backup_tokens, steps[0].duration)
    # write-through and write-back both kept A on the host; selective never copied it
    # (used once), so the GPU's eviction dropped it
    assert outcome["write_through"][0] > 2900 and outcome["write_back"][0] > 2900
    assert outcome["write_through_selective"][0] == 0
    # write-back copied A's two nodes (prompt, then output tail) while evicting them for B,
    # one blocking copy each: B's first step waited for both
    settings = hicache_model("write_back").hicache
    assert settings is not None
    stall = outcome["write_back"][2] - outcome["write_through"][2]
    assert stall == pytest.approx(settings.copy_s(3) + settings.copy_s(3000))


def test_write_through_with_a_full_host_drops_what_it_could_not_copy() -> None:
    model = hicache_model(hicache_ratio=0.25)  # a host pool of 1,001 tokens
    cache = tiered(model)
    now, _, _ = run(model, A, "a")
    assert cache.host_used == 0  # a 3,003-token node does not fit at all
    run(model, B, "b", now)
    assert cache.counters.dropped_tokens["write_through_unbacked_eviction"] > 0
    assert cache.peek_prefix(encode_tokens(A)) == 0


def test_write_back_without_host_room_drops_under_host_pressure() -> None:
    model = hicache_model("write_back", hicache_ratio=0.25)
    cache = tiered(model)
    now, _, _ = run(model, A, "a")
    run(model, B, "b", now)
    # the output tail (3 tokens) fitted and was copied; the 3,000-token prompt node could
    # not, so it was dropped with the tail below it
    assert cache.counters.dropped_tokens["host_pressure"] == 3000
    assert cache.counters.backup_tokens == 3 and cache.host_used == 0


# ---------------------------------------------------------------------- KV events
def mediums(events: list[Event]) -> list[tuple[str, str, int]]:
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(("stored", e.medium, len(e.block_hashes)))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", e.medium, len(e.block_hashes)))
    return out


def test_events_carry_the_medium_of_each_move() -> None:
    recorder = EventRecorder(1)
    model = hicache_model(listener=recorder)
    recorder.take()
    now, _, _ = run(model, A, "a")
    # the prompt's chunk (GPU), its copy (CPU_PINNED), then the finished sequence's tail
    assert mediums(recorder.take()) == [
        ("stored", "GPU", 3000), ("stored", "CPU_PINNED", 3000),
        ("stored", "GPU", 3), ("stored", "CPU_PINNED", 3),
    ]  # fmt: skip
    now, _, _ = run(model, B, "b", now)
    # A's two nodes leave the GPU (one coalesced removal) and stay on the host: no
    # CPU_PINNED removal; B is stored and copied
    assert mediums(recorder.take()) == [
        ("removed", "GPU", 3003),
        ("stored", "GPU", 3000), ("stored", "CPU_PINNED", 3000),
        ("stored", "GPU", 3), ("stored", "CPU_PINNED", 3),
    ]  # fmt: skip
    run(model, A, "a2", now)
    # A comes back to the GPU (loaded, then revived by the repeat's own insert), already
    # on the host: GPU stores only, B's first evicted node demoted
    got = mediums(recorder.take())
    assert {m for kind, m, _ in got if kind == "stored"} == {"GPU"}
    assert sum(n for kind, _, n in got if kind == "stored") == 3003
    assert all(m == "GPU" for kind, m, _ in got if kind == "removed")


def test_write_back_records_the_host_copy_before_the_gpu_removal() -> None:
    recorder = EventRecorder(1)
    model = hicache_model("write_back", listener=recorder)
    now, _, _ = run(model, A, "a")
    assert all(m == "GPU" for _, m, _ in mediums(recorder.take()))
    run(model, B, "b", now)
    got = mediums(recorder.take())
    first_copy = got.index(next(e for e in got if e[1] == "CPU_PINNED"))
    assert got[first_copy][0] == "stored" and got[first_copy + 1] == ("removed", "GPU", 3)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize(("page", "ratio"), [(1, 2.0), (16, 0.3)])
def test_events_rebuild_both_tiers_exactly(policy: str, page: int, ratio: float) -> None:
    """A consumer applying the events per medium holds, after every step, exactly the
    blocks the model holds on the GPU and on the host; the tree's invariants hold."""
    rng = random.Random(7)
    recorder = EventRecorder(page)
    config = SimConfig(capacity_tokens=2000, page_size=page, context_length=4096,
                       enable_hierarchical_cache=True, hicache_write_policy=policy,
                       hicache_ratio=ratio)  # fmt: skip
    model = WorkerModel.from_config(config, listener=recorder)
    cache = tiered(model)
    held: dict[str, set[int]] = {"GPU": set(), "CPU_PINNED": set()}
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(50, 600))] for _ in range(8)]
    now = 0.0
    for i in range(200):
        if rng.random() < 0.6:
            tail = [rng.randrange(1, 500) for _ in range(rng.randrange(0, 200))]
            model.submit(SimRequest(f"r{i}", rng.choice(prefixes) + tail,
                                    max_new_tokens=rng.randrange(1, 40)), now)  # fmt: skip
        if (result := model.step(now)) is not None:
            now = result.end
        cache.check_invariants()
        if i == 120 and model.num_in_system == 0:
            assert model.flush_cache()
        for e in recorder.take():
            if isinstance(e, AllBlocksCleared):
                held["GPU"].clear()
                held["CPU_PINNED"].clear()
            elif isinstance(e, BlockStored):
                assert held[e.medium].isdisjoint(e.block_hashes)
                held[e.medium].update(e.block_hashes)
            else:
                assert held[e.medium].issuperset(e.block_hashes)
                held[e.medium].difference_update(e.block_hashes)
        on_gpu: set[int] = set()
        on_host: set[int] = set()
        for node in cache.iter_nodes():  # no namespaces here: the hashes are the digests'
            hashes = [digest_to_hash(d) for d in node.meta]
            on_gpu.update(hashes)
            if getattr(node, "backuped", False):
                on_host.update(hashes)
        for node in cache.iter_host_nodes():
            on_host.update(digest_to_hash(d) for d in node.meta)
        assert held["GPU"] == on_gpu and held["CPU_PINNED"] == on_host
    assert cache.counters.backup_tokens > 0


# ---------------------------------------------------------------------- the replay
def test_a_replay_worker_built_with_hicache_has_the_same_tier() -> None:
    """The offline replay builds its workers with WorkerModel.from_config from the same
    SimConfig: the tier is there, and its true match counts what a request would load."""
    config = SimConfig(capacity_tokens=CAPACITY, enable_hierarchical_cache=True)
    worker = ModelWorker(config)
    assert worker.model.tiered is not None
    now = 0.0
    for rid, prompt in (("a", A), ("b", B)):
        worker.submit(rid, encode_tokens(prompt), 4, now)
        while (stepped := worker.step(now)) is not None:
            now += stepped[0]
    predicted = worker.true_match(encode_tokens(A))
    worker.submit("a2", encode_tokens(A), 4, now)
    reported = None
    while (stepped := worker.step(now)) is not None:
        now += stepped[0]
        reported = next((o.cached_tokens for o in stepped[1] if o.first_token), reported)
    assert predicted == reported == 2999
