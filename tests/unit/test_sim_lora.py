"""The simulated worker's LoRA adapters (simulator.model.lora, the scheduler's batch
limit): SGLang 0.5.23's load, unload, eviction and request rules and messages."""

from __future__ import annotations

import pytest

from simulator.config import SimConfig
from simulator.model.lora import LoraAdapters, LoraRef, parse_lora_spec
from simulator.model.radix_worker import WorkerModel
from simulator.model.requests import SimRequest


def test_specs_as_sglang_parses_them() -> None:
    assert parse_lora_spec("a=/p/a") == LoraRef("a", "/p/a")
    assert parse_lora_spec("/p/b") == LoraRef("/p/b", "/p/b")
    assert parse_lora_spec('{"lora_name":"c","lora_path":"/c","pinned":true}').pinned
    with pytest.raises(ValueError):
        parse_lora_spec("a=")


def test_load_unload_evict_and_reload() -> None:
    loras = LoraAdapters(True, [LoraRef("a", "/a")], max_loras_per_batch=2, max_loaded_loras=2)
    assert loras.load(LoraRef("b", "/b")).success
    again = loras.load(LoraRef("b", "/b"))
    assert not again.success and "already loaded" in (again.error_message or "")
    loras.resolve(["a"])  # a is used now: b is the least recently used
    result = loras.load(LoraRef("c", "/c"))
    assert result.evicted == ["b"] and result.loaded_adapters == {"a": "/a", "c": "/c"}
    assert loras.resolve(["b"]) == [LoraRef("b", "/b")]  # loaded once: reloaded implicitly
    with pytest.raises(ValueError, match="never been loaded: zz"):
        loras.resolve(["zz"])
    gone = loras.unload("zz")
    assert not gone.success and "does not exist" in (gone.error_message or "")
    off = LoraAdapters(False)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        off.resolve(["a"])
    assert not off.load(LoraRef("a", "/a")).success


def test_config_checks_sglang_asserts() -> None:
    with pytest.raises(ValueError, match="max_loaded_loras should be"):
        SimConfig(lora_paths=("a=/a",), max_loras_per_batch=4, max_loaded_loras=2).validate()
    assert SimConfig(lora_paths=("a=/a",)).lora_enabled
    assert not SimConfig().lora_enabled


def test_at_most_max_loras_per_batch_adapters_run_together() -> None:
    model = WorkerModel(max_loras_per_batch=2)
    for i, adapter in enumerate(["a", "b", None, "a"]):
        model.submit(SimRequest(f"r{i}", list(range(i * 100, i * 100 + 50)), 4, adapter=adapter), 0)
    result = model.step(0.0)
    assert result is not None
    admitted = {o.rid for o in result.outputs}
    assert admitted == {"r0", "r1", "r3"}  # a, b and a again; the base model waits


def test_requests_wait_for_their_adapter_weights() -> None:
    model = WorkerModel(max_loras_per_batch=8)
    model.adapter_loading("a", 0.5)
    model.submit(SimRequest("r0", list(range(50)), 4, adapter="a"), 0.0)
    idle = model.step(0.0)
    assert idle is not None and idle.kind == "idle" and idle.duration == pytest.approx(0.5)
    step = model.step(0.5)
    assert step is not None and step.kind == "prefill"
