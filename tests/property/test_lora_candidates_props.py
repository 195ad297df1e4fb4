"""LoRA-aware candidates (gateway.workers.registry, gateway.routing.lora): a request naming
an adapter goes only to workers that have it loaded whenever one of them is healthy (and
not excluded), among its model's workers; when none is, ``lora.unloaded`` decides."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import LoraConfig
from gateway.errors import GatewayError
from gateway.routing.lora import AdapterLoads, lora_candidates
from gateway.workers.registry import HealthFlag, WorkerMetadata, WorkerRegistry

ADAPTERS = ["a", "b", "c", "d"]
MODELS = ["llama", "qwen"]

fleets = st.lists(
    st.tuples(
        st.sampled_from(MODELS),
        st.booleans(),  # healthy
        st.frozensets(st.sampled_from(ADAPTERS)),  # loaded adapters
        st.booleans(),  # LoRA enabled
    ),
    min_size=1,
    max_size=10,
)
Fleet = list[tuple[str, bool, frozenset[str], bool]]


def _registry(fleet: Fleet) -> WorkerRegistry:
    registry = WorkerRegistry(panic_threshold=0.5, clock=lambda: 0.0)
    for i, (model, healthy, adapters, lora) in enumerate(fleet):
        worker, _ = registry.add(f"http://127.0.0.1:{21000 + i}", "sglang")
        worker.metadata = WorkerMetadata(model=model, models=frozenset({model}), lora_enabled=lora)
        registry.set_adapters(worker, {a: f"/lora/{a}" for a in adapters})
        worker.flags.clear()
        if not healthy:
            worker.flags.add(HealthFlag.CHECK_FAILED)
    return registry


@settings(max_examples=300, deadline=None)
@given(
    fleet=fleets,
    model=st.sampled_from(MODELS),
    adapter=st.sampled_from([*ADAPTERS, "never-seen"]),
    excluded=st.integers(0, 3),
    unloaded=st.sampled_from(["load", "reject"]),
)
def test_adapter_requests_land_on_workers_with_the_adapter(
    fleet: Fleet, model: str, adapter: str, excluded: int, unloaded: str
) -> None:
    registry = _registry(fleet)
    workers = list(registry)
    skip = [w.id for w in workers[:excluded]]
    of_model = [w for w in workers if w.serves(model) or len(registry.served_models()) < 2]
    holder_up = any(adapter in w.adapters and w.healthy and w.id not in skip for w in of_model)
    candidates = registry.candidates(skip, model, adapter)
    if holder_up:
        assert candidates and all(adapter in w.adapters for w in candidates)
        # the panic rule applies among the holders: unhealthy ones may join, never others
        assert all(w.id not in skip for w in candidates)
        assert any(w.healthy for w in candidates)
    config = LoraConfig(unloaded=unloaded)
    if not candidates:
        return
    try:
        chosen, path, setup = lora_candidates(candidates, adapter, config, registry, AdapterLoads())
    except GatewayError as exc:
        assert exc.status == 404 and not holder_up
        return
    if holder_up:
        assert path is None and chosen == candidates and setup == {}
    else:  # loadable: only LoRA-enabled workers, and a known path to load from
        assert unloaded == "load" or all(adapter in w.adapters for w in candidates)
        assert path is None or (path == f"/lora/{adapter}" and all(
            w.metadata.lora_enabled for w in chosen))  # fmt: skip
        # every candidate lacking the adapter carries the load time, no holder does
        assert set(setup) == {w.id for w in chosen if adapter not in w.adapters}
    # offered beside healthy holders (a policy weighing load time): holders stay first,
    # the others are loadable workers of the adapter's model, each with the load time
    others = [w for w in registry.candidates(skip, model) if adapter not in w.adapters]
    if holder_up and others:
        widened, wpath, wsetup = lora_candidates(
            candidates, adapter, config, registry, AdapterLoads(), others
        )
        assert widened[: len(candidates)] == candidates
        extra = widened[len(candidates) :]
        assert all(w.metadata.lora_enabled and adapter not in w.adapters for w in extra)
        assert set(wsetup) == {w.id for w in extra}
        assert unloaded == "load" or not extra
        assert (wpath is None) == (not extra)


@settings(max_examples=100, deadline=None)
@given(fleet=fleets, model=st.sampled_from(MODELS), excluded=st.integers(0, 3))
def test_no_adapter_means_candidates_as_before(fleet: Fleet, model: str, excluded: int) -> None:
    registry = _registry(fleet)
    skip = [w.id for w in list(registry)[:excluded]]
    before = [w.id for w in registry.candidates(skip, model)]
    assert [w.id for w in registry.candidates(skip, model, None)] == before


def test_reject_answers_404_naming_the_adapter() -> None:
    registry = _registry([("llama", True, frozenset({"a"}), True)])
    workers = registry.candidates((), "llama", "b")
    with pytest.raises(GatewayError) as caught:
        lora_candidates(workers, "b", LoraConfig(unloaded="reject"), registry, AdapterLoads())
    assert caught.value.status == 404 and "`b`" in str(caught.value)
