"""The simulator's own LoRA counters (``sim_lora_counters`` in ``/server_info``): loads,
of them implicit reloads, and evictions beyond ``max_loaded_loras``."""

from __future__ import annotations

from simulator.model.lora import LoraAdapters, LoraRef


def test_loads_reloads_and_evictions_are_counted() -> None:
    loras = LoraAdapters(True, [LoraRef("pre", "/p")], max_loras_per_batch=2, max_loaded_loras=2)
    assert (loras.loads, loras.reloads, loras.evictions) == (0, 0, 0)  # preloaded: not counted
    assert loras.load(LoraRef("a", "/a")).success
    assert loras.load(LoraRef("b", "/b")).evicted == ["pre"]
    assert not loras.load(LoraRef("b", "/b")).success  # already loaded: no load
    reload = loras.resolve(["pre"])  # loaded once, evicted: reloaded implicitly
    assert [r.name for r in reload] == ["pre"]
    loras.load(reload[0])
    assert (loras.loads, loras.reloads, loras.evictions) == (3, 1, 2)
