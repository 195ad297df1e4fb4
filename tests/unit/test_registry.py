"""Registry: URL-derived ids, health flags by source, candidates and panic, leases."""

from __future__ import annotations

import pytest

from gateway.routing.lease import Lease
from gateway.workers.registry import HealthFlag, WorkerRegistry, worker_id_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _registry(n: int, panic: float = 0.5) -> WorkerRegistry:
    reg = WorkerRegistry(panic, Clock())
    for i in range(n):
        worker, created = reg.add(f"http://127.0.0.1:{18000 + i}")
        assert created
        worker.flags.clear()  # passed its first probe
    return reg


def test_ids_are_stable_and_path_safe() -> None:
    assert worker_id_for("http://127.0.0.1:18001") == "127.0.0.1-18001"
    assert worker_id_for("https://w.example:443") == "https-w.example-443"
    assert worker_id_for("http://[::1]:9000/v1").startswith("1.")  # digest-suffixed
    assert worker_id_for("http://h:1/a/b") != worker_id_for("http://h:1/a_b")
    assert worker_id_for("http://[::1]:1") != worker_id_for("http://1:1")
    assert worker_id_for("http://h:1/v1") == "h-1-v1"  # plain parts stay as they were
    assert "/" not in worker_id_for("http://h:1/a/b")


def test_add_is_idempotent_and_remove_notifies() -> None:
    reg = _registry(1)
    worker, created = reg.add("http://127.0.0.1:18000")
    assert not created and len(reg) == 1
    removed: list[str] = []
    reg.on_removed(lambda w: removed.append(w.id))
    assert reg.remove(worker.id) is worker
    assert removed == [worker.id] and len(reg) == 0
    assert reg.remove(worker.id) is None


def test_new_worker_is_unchecked() -> None:
    reg = WorkerRegistry(0.5, Clock())
    worker, _ = reg.add("http://127.0.0.1:1")
    assert worker.flags == {HealthFlag.UNCHECKED}
    assert not reg.ready()


def test_find_by_id_or_url() -> None:
    reg = _registry(2)
    assert reg.find("127.0.0.1-18001") is reg.find("http://127.0.0.1:18001/")
    assert reg.find("nope") is None


def test_candidates_exclude_flagged_and_excluded() -> None:
    reg = _registry(4)
    workers = list(reg)
    workers[0].flags.add(HealthFlag.EJECTED)
    ids = [w.id for w in reg.candidates(excluded=[workers[1].id])]
    assert ids == [workers[2].id, workers[3].id]


def test_flags_from_different_sources_do_not_overwrite() -> None:
    reg = _registry(3)
    w = next(iter(reg))
    w.flags |= {HealthFlag.EJECTED, HealthFlag.CHECK_FAILED}
    w.flags.discard(HealthFlag.EJECTED)
    assert not w.healthy and HealthFlag.CHECK_FAILED in w.flags


def test_panic_routes_to_all_non_draining() -> None:
    reg = _registry(4)
    workers = list(reg)
    for w in workers[:3]:
        w.flags.add(HealthFlag.CHECK_FAILED)
    workers[0].flags.add(HealthFlag.DRAINING)
    # 1 healthy of 4 < 0.5: panic, every non-draining worker, healthy first
    ids = [w.id for w in reg.candidates()]
    assert ids[0] == workers[3].id
    assert set(ids) == {w.id for w in workers[1:]}
    assert reg.ready()


def test_no_panic_above_threshold() -> None:
    reg = _registry(4)
    workers = list(reg)
    workers[0].flags.add(HealthFlag.CHECK_FAILED)
    assert len(reg.candidates()) == 3


def test_all_draining_means_no_candidates() -> None:
    reg = _registry(2)
    for w in reg:
        w.flags.add(HealthFlag.DRAINING)
    assert reg.candidates() == []
    assert not reg.ready()


def test_view_carries_counters_and_load_age() -> None:
    from policies.base import EngineLoad

    clock = Clock()
    reg = WorkerRegistry(0.5, clock)
    w, _ = reg.add("http://127.0.0.1:1")
    w.engine_load = EngineLoad(running_requests=3, waiting_requests=1)
    w.load_read_at = 98.0
    w.metadata.capacity_tokens = 1000
    with Lease(w, 50):
        view = w.view(clock(), matched_tokens=7)
        assert view.in_flight == 1 and view.queued_prefill_tokens == 50
        assert view.matched_tokens == 7 and view.capacity_tokens == 1000
        assert view.engine_load is not None and view.engine_load.age_s == pytest.approx(2.0)
    assert w.in_flight == 0


def test_lease_released_exactly_once() -> None:
    reg = _registry(1)
    w = next(iter(reg))
    first = Lease(w, 100)
    second = Lease(w, 30)
    assert (w.in_flight, w.queued_prefill_tokens) == (2, 130)
    assert second.queued_ahead == 100
    first.first_token()
    first.first_token()
    assert (w.queued_prefill_tokens, w.decoding_requests) == (30, 1)
    for _ in range(3):
        first.release()
        second.release()
    assert (w.in_flight, w.queued_prefill_tokens, w.decoding_requests) == (0, 0, 0)
    assert first.released and second.released
