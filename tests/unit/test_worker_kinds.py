"""Worker kinds: spec parsing, discovery hints, per-kind metadata and load parsers; the
prefix index's sequence bound (llama.cpp's one prompt per slot)."""

from __future__ import annotations

import random

import orjson
import pytest

from gateway.config.workerspec import (
    KIND_NAMES,
    LLAMACPP,
    OPENAI,
    SGLANG,
    VLLM,
    configured_kind,
    parse_worker_spec,
)
from gateway.forward.relay import cached_tokens
from gateway.routing.hashing import block_hashes
from gateway.routing.prefix_index import PrefixIndex
from gateway.workers.kinds import kind_from_models, kind_from_server_header, kind_named
from policies.base import RouteContext, WorkerView
from policies.min_ttft import MinTtftPolicy

# Shapes as measured on llama.cpp (xllamacpp 2026.10.11549, docs/REAL_ENGINE.md).
LLAMA_PROPS = {
    "total_slots": 2,
    "default_generation_settings": {"n_ctx": 4096, "params": {}},
    "model_alias": "tiny-llama",
    "model_path": "/m/tiny.gguf",
    "build_info": "b0-unknown",
}
LLAMA_METRICS = b"""# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5018
llamacpp:prompt_tokens_cached_total 1200
llamacpp:requests_processing 2
llamacpp:requests_deferred 1
"""
VLLM_METRICS = b"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0
"""


def test_worker_spec_names_a_kind() -> None:
    assert parse_worker_spec("http://h:1") == ("http://h:1", None)
    assert parse_worker_spec("http://h:1#llamacpp") == ("http://h:1", LLAMACPP)
    assert parse_worker_spec("http://h:1#VLLM") == ("http://h:1", VLLM)
    assert parse_worker_spec("http://h:1#auto") == ("http://h:1", None)
    with pytest.raises(ValueError, match="unknown worker kind"):
        parse_worker_spec("http://h:1#tgi")
    assert configured_kind("auto") is None
    assert configured_kind("openai") == OPENAI


def test_every_kind_has_an_adapter_and_unknown_means_sglang() -> None:
    assert [kind_named(k).name for k in KIND_NAMES] == list(KIND_NAMES)
    assert kind_named("auto").name == SGLANG
    assert kind_named(SGLANG).abort_path == "/abort_request"
    assert all(kind_named(k).abort_path is None for k in (LLAMACPP, VLLM, OPENAI))
    assert kind_named(SGLANG).health_path("/ping") == "/ping"
    assert kind_named(LLAMACPP).health_path("/ping") == "/health"
    assert kind_named(OPENAI).health_path("/health") == "/v1/models"


def test_discovery_hints() -> None:
    assert kind_from_server_header("llama.cpp") == LLAMACPP
    assert kind_from_server_header("uvicorn") is None
    assert kind_from_server_header(None) is None
    assert kind_from_models({"data": [{"id": "m", "owned_by": "vllm"}]}) == VLLM
    assert kind_from_models({"data": [{"id": "m", "owned_by": "llamacpp"}]}) == LLAMACPP
    assert kind_from_models({"data": [{"id": "m", "owned_by": "sglang"}]}) == SGLANG
    assert kind_from_models({"data": [{"id": "gpt", "owned_by": "openai"}]}) == OPENAI
    assert kind_from_models({"object": "list"}) == OPENAI


def test_llamacpp_props_give_slots_and_context() -> None:
    meta = kind_named(LLAMACPP).parse_info("/props", LLAMA_PROPS)
    assert meta is not None
    assert (meta.model, meta.max_sequences, meta.capacity_tokens) == ("tiny-llama", 2, 8192)
    assert kind_named(LLAMACPP).parse_info("/props", {"model_alias": "x"}) is None
    no_ctx = kind_named(LLAMACPP).parse_info("/props", {"total_slots": 4})
    assert no_ctx is not None and (no_ctx.max_sequences, no_ctx.capacity_tokens) == (4, None)


def test_llamacpp_load_from_metrics_or_slots() -> None:
    kind = kind_named(LLAMACPP)
    reading = kind.parse_load("/metrics", LLAMA_METRICS)
    assert reading is not None
    load, capacity = reading
    assert (load.running_requests, load.waiting_requests, capacity) == (2, 1, None)
    assert kind.parse_load("/metrics", b"sglang:num_running_reqs 1\n") is None
    slots = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}]
    reading = kind.parse_load("/slots", orjson.dumps(slots))
    assert reading is not None and reading[0].running_requests == 1
    assert kind.parse_load("/slots", b"not json") is None


def test_vllm_metrics_give_queue_usage_and_kv_size() -> None:
    reading = kind_named(VLLM).parse_load("/metrics", VLLM_METRICS)
    assert reading is not None
    load, capacity = reading
    assert (load.running_requests, load.waiting_requests) == (3, 5)
    assert load.token_usage == pytest.approx(0.42)
    assert capacity == 2048 * 16
    meta = kind_named(VLLM).parse_info("/v1/models", {"data": [{"id": "meta/llama"}]})
    assert meta is not None and meta.model == "meta/llama"


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-Inf", "-3", "1e300"])
def test_a_gauge_that_is_no_count_reads_as_none_and_never_stops_the_poll(bad: str) -> None:
    """A misbehaving vLLM or llama.cpp worker: the figure is 0, the reading still made
    (``int()`` of NaN or infinity raised, and the worker's last figures stayed for good)."""
    vllm = (
        f"vllm:num_requests_running {bad}\nvllm:num_requests_waiting {bad}\n"
        f"vllm:kv_cache_usage_perc {bad}\n"
    ).encode()
    reading = kind_named(VLLM).parse_load("/metrics", vllm)
    assert reading is not None
    load = reading[0]
    assert (load.running_requests, load.waiting_requests) == (0, 0)
    assert 0.0 <= load.token_usage <= 1.0
    llama = f"llamacpp:requests_processing {bad}\nllamacpp:requests_deferred {bad}\n".encode()
    reading = kind_named(LLAMACPP).parse_load("/metrics", llama)
    assert reading is not None and (reading[0].running_requests, reading[0].waiting_requests) == (
        0,
        0,
    )


def test_sglang_kind_keeps_the_existing_parsers() -> None:
    kind = kind_named(SGLANG)
    body = {"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1, "max_total_num_tokens": 9}]}
    reading = kind.parse_load("/v1/loads", orjson.dumps(body))
    assert reading is not None and reading[1] == 9 and reading[0].running_requests == 2
    meta = kind.parse_info("/server_info", {"model_path": "/m", "max_total_num_tokens": 100})
    assert meta is not None and meta.capacity_tokens == 100
    assert kind_named(OPENAI).parse_load("/metrics", b"") is None


def test_cached_tokens_from_llamacpp_usage_or_timings() -> None:
    plain = {
        "usage": {"prompt_tokens": 1100, "prompt_tokens_details": {"cached_tokens": 1000}},
        "timings": {"cache_n": 1000, "prompt_n": 100},
    }
    assert cached_tokens(orjson.dumps(plain)) == 1000
    final_chunk = b'data: {"choices":[{"delta":{}}],"timings":{"cache_n":37}}'
    assert cached_tokens(final_chunk) == 37  # a stream without include_usage


def _chain(label: str, blocks: int) -> list[int]:
    return block_hashes("".join(f"{label}{i:062d}\n" for i in range(blocks)))


def _prompt(prefix: str, message: str) -> list[int]:
    """A 10-block shared prefix and a 2-block message, as the e2e workload."""
    return block_hashes(
        "".join(f"{prefix}{i:062d}\n" for i in range(10))
        + "".join(f"{message}{i:062d}\n" for i in range(2))
    )


def test_sequence_bound_keeps_one_prompt_per_slot() -> None:
    ix = PrefixIndex()
    ix.set_capacity("w", 8192, max_sequences=2)
    a, b, c = _chain("a", 5), _chain("b", 5), _chain("c", 5)
    for prompt in (a, b, c):
        ix.record(prompt, "w")
    # after A, B, C on two slots: C and B held, A's slot was taken (as measured)
    assert ix.match(c) == {"w": 5}
    assert ix.match(b) == {"w": 5}
    assert ix.match(a) == {}
    ix.record(b, "w")  # B used again: now A would evict C
    ix.record(a, "w")
    assert ix.match(c) == {}
    assert ix.match(b) == {"w": 5}


def test_a_sibling_takes_over_its_prefix_holder() -> None:
    ix = PrefixIndex()
    ix.set_capacity("w", 8192, max_sequences=2)
    p1a, p1b, p2a = _prompt("p", "a"), _prompt("p", "b"), _prompt("q", "a")
    ix.record(p1a, "w")
    ix.record(p2a, "w")
    ix.record(p1b, "w")  # reuses P1's slot: P2 stays, P1+a's message is gone
    assert ix.match(p2a) == {"w": 12}
    assert ix.match(p1b) == {"w": 12}
    assert ix.match(p1a) == {"w": 10}
    ix.record(p1a[:11], "w")  # a shorter chain reusing the slot keeps the shared part
    assert ix.match(p1b) == {"w": 10}
    assert ix.match(p2a) == {"w": 12}


def test_sequence_bound_is_per_worker_and_optional() -> None:
    ix = PrefixIndex()
    ix.set_capacity("llama", 8192, max_sequences=1)
    a, b = _chain("a", 4), _chain("b", 4)
    for worker in ("llama", "sglang"):
        ix.record(a, worker)
        ix.record(b, worker)
    assert ix.match(a) == {"sglang": 4}
    assert ix.match(b) == {"llama": 4, "sglang": 4}
    ix.set_capacity("llama", 8192, max_sequences=None)  # bound lifted: blocks only
    ix.record(a, "llama")
    assert ix.match(b) == {"llama": 4, "sglang": 4}
    with pytest.raises(ValueError):
        ix.set_capacity("llama", 8192, max_sequences=0)


def test_setting_the_bound_forgets_untracked_blocks() -> None:
    ix = PrefixIndex()
    ix.record(_chain("a", 4), "w")  # recorded before the worker's slots were known
    ix.set_capacity("w", 8192, max_sequences=2)
    assert ix.match(_chain("a", 4)) == {}
    assert ix.stats("w").blocks == 0


def test_correct_does_not_trim_a_slot_worker() -> None:
    ix = PrefixIndex()
    ix.set_capacity("w", 8192, max_sequences=2)
    p = _prompt("p", "a")
    ix.record(p, "w")
    ix.correct("w", p, predicted_blocks=12, reported_tokens=0)
    assert ix.match(p) == {"w": 12}  # it holds the prompt it just answered
    stats = ix.stats("w")
    assert stats.predicted_tokens == 12 * 16 and stats.reported_tokens == 0


def test_free_sequences_count_room_left() -> None:
    ix = PrefixIndex()
    assert ix.free_sequences("w") is None  # unknown worker: no bound
    ix.set_capacity("w", 8192, max_sequences=2)
    assert ix.free_sequences("w") == 2
    ix.record(_prompt("p", "a"), "w")
    ix.record(_prompt("p", "b"), "w")  # a sibling takes over its slot
    assert ix.free_sequences("w") == 1
    ix.record(_prompt("q", "a"), "w")
    ix.record(_prompt("r", "a"), "w")
    assert ix.free_sequences("w") == 0


def test_min_ttft_places_a_cold_prompt_where_a_slot_is_free() -> None:
    full = [WorkerView(id=f"full{i}", free_sequences=0) for i in range(3)]
    room = WorkerView(id="room", free_sequences=1)
    policy = MinTtftPolicy()
    for seed in range(20):
        ctx = RouteContext(prompt_tokens=1000, candidates=[*full, room], rng=random.Random(seed))
        assert policy.select(ctx).worker_id == "room"
    # a worker without a bound (SGLang) makes the room signal moot: ties stay random
    mixed = [WorkerView(id="sglang"), room]
    chosen = {
        policy.select(RouteContext(1000, mixed, random.Random(seed))).worker_id
        for seed in range(20)
    }
    assert chosen == {"sglang", "room"}


def test_a_free_slot_beats_a_queue_for_a_cold_prompt() -> None:
    busy_with_room = WorkerView(
        id="room", in_flight=1, queued_prefill_tokens=1000, free_sequences=1
    )
    idle_full = WorkerView(id="full", free_sequences=0)
    ctx = RouteContext(1000, [idle_full, busy_with_room], random.Random(0))
    assert MinTtftPolicy().select(ctx).worker_id == "room"


def test_a_miss_on_a_full_slot_worker_drops_the_chain_it_overwrote() -> None:
    ix = PrefixIndex()
    ix.set_capacity("w", 8192, max_sequences=2)
    p6a, p6b, p7 = _prompt("p", "a"), _prompt("p", "b"), _prompt("q", "a")
    ix.record(p7, "w")
    ix.record(p6a, "w")
    ix.record(p6b, "w")  # a sibling sent while p6a still ran: another slot, p7's
    ix.correct("w", p6b, predicted_blocks=10, reported_tokens=8)
    assert ix.match(p7) == {}  # overwritten
    assert ix.match(p6b) == {"w": 12}
    assert ix.free_sequences("w") == 1
    ix.correct("w", p6b, predicted_blocks=10, reported_tokens=8)  # a free slot: no drop
    assert ix.match(p6b) == {"w": 12}


def test_config_takes_kinds_and_refuses_unknown_ones() -> None:
    from gateway.config import ConfigError, config_from_dict

    config = config_from_dict({"workers": ["http://h:1#llamacpp", "http://h:2"]})
    assert config.worker_kind == "auto"
    assert config_from_dict({"worker_kind": "vllm"}).worker_kind == "vllm"
    with pytest.raises(ConfigError, match="worker_kind"):
        config_from_dict({"worker_kind": "tgi"})
    with pytest.raises(ConfigError, match=r"workers\[0\].*unknown worker kind"):
        config_from_dict({"workers": ["http://h:1#tgi"]})
