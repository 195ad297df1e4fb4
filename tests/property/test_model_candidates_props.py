"""Model-aware candidates (gateway.workers.registry): with several models behind the
gateway, a request never reaches a worker of another model; with one, nothing changes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.workers.registry import HealthFlag, WorkerMetadata, WorkerRegistry

MODELS = ["llama", "qwen", "mistral"]

fleets = st.lists(
    st.tuples(
        st.sampled_from(MODELS),  # the model it serves
        st.booleans(),  # healthy
        st.booleans(),  # also known by its path
    ),
    min_size=1,
    max_size=12,
)


def _registry(fleet: list[tuple[str, bool, bool]]) -> WorkerRegistry:
    registry = WorkerRegistry(panic_threshold=0.5, clock=lambda: 0.0)
    for i, (model, healthy, by_path) in enumerate(fleet):
        worker, _ = registry.add(f"http://127.0.0.1:{20000 + i}", "sglang")
        names = {model, f"/models/{model}"} if by_path else {model}
        worker.metadata = WorkerMetadata(model=model, models=frozenset(names))
        worker.flags.clear()
        if not healthy:
            worker.flags.add(HealthFlag.CHECK_FAILED)
    return registry


@settings(max_examples=300, deadline=None)
@given(fleet=fleets, model=st.sampled_from([*MODELS, "unknown"]), excluded=st.integers(0, 3))
def test_a_request_reaches_only_workers_of_its_model(
    fleet: list[tuple[str, bool, bool]], model: str, excluded: int
) -> None:
    registry = _registry(fleet)
    skip = [w.id for w in list(registry)[:excluded]]
    chosen = registry.candidates(skip, model)
    if len({m for m, _, _ in fleet}) > 1:
        assert all(w.serves(model) for w in chosen)
        # the health and panic rules, among the model's workers only
        pool = [w for w in registry if w.serves(model)]
        healthy = [w for w in pool if not w.flags and w.id not in skip]
        if healthy and len(healthy) >= 0.5 * len(pool):
            assert chosen == healthy
        else:
            assert {w.id for w in chosen} == {w.id for w in pool if w.id not in skip}
        assert registry.serves_any(model) == (model in {m for m, *_ in fleet})
    else:  # one model: any name goes anywhere, as before
        assert registry.candidates(skip, model) == registry.candidates(skip)


@settings(max_examples=100, deadline=None)
@given(fleet=fleets)
def test_a_model_is_known_by_its_path_too(fleet: list[tuple[str, bool, bool]]) -> None:
    registry = _registry(fleet)
    for (model, _, by_path), worker in zip(fleet, registry, strict=True):
        assert worker.serves(model)
        assert worker.serves(f"/models/{model}") == by_path
