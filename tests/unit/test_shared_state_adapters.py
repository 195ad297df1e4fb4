"""The shared state's adapters to the registry, the prefix index and Prometheus (no Redis)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.config import ConfigError, RedisConfig, config_from_dict
from gateway.peers.adapters import (
    PeerIndexTarget,
    RegistryFleet,
    ReplicatingIndex,
    SharedStateCollector,
    settings_from,
)
from gateway.peers.state import SharedSettings, SharedState
from gateway.routing.prefix_index import PrefixIndex
from gateway.workers.registry import HealthFlag, Worker, WorkerRegistry

A, B, C = "http://127.0.0.1:18001", "http://127.0.0.1:18002", "http://127.0.0.1:18003"


def _fleet(*urls: str) -> tuple[WorkerRegistry, RegistryFleet, list[str]]:
    registry = WorkerRegistry(0.5)
    for url in urls:
        registry.add(url)
    added: list[str] = []

    def add(url: str, kind: str | None) -> Worker | None:
        added.append(url)
        return registry.add(url, kind)[0]

    return registry, RegistryFleet(registry, add), added


def test_peer_load_is_added_to_the_view() -> None:
    registry, fleet, _ = _fleet(A, B)
    wa = registry.find(A)
    assert wa is not None
    wa.in_flight, wa.queued_prefill_tokens = 2, 100
    assert fleet.local_load()[wa.id] == (2, 100, 0)
    fleet.set_peer_load({wa.id: (3, 50, 1)})
    view = wa.view(0.0)
    assert (view.in_flight, view.queued_prefill_tokens, view.decoding_requests) == (5, 150, 1)
    fleet.set_peer_load({})
    assert wa.view(0.0).in_flight == 2


def test_apply_workers_adds_drains_removes_and_keeps_pending() -> None:
    registry, fleet, added = _fleet(A, B)
    fleet.apply_workers({A: "draining", C: "active llamacpp"}, keep=frozenset({B}))
    wa, wb, wc = registry.find(A), registry.find(B), registry.find(C)
    assert wa is not None and wa.draining
    assert wb is not None  # a local change not yet written: left alone
    assert wc is not None and wc.kind == "llamacpp" and added == [C]
    assert fleet.worker_states() == {A: "draining", B: "active", C: "active llamacpp"}
    fleet.apply_workers({A: "active", C: "active"}, keep=frozenset())
    assert registry.find(B) is None
    assert HealthFlag.DRAINING not in wa.flags


def test_replicating_index_queues_local_records_only() -> None:
    index = PrefixIndex(block_tokens=16.0)
    replicating = ReplicatingIndex(index)
    _, fleet, _ = _fleet(A)
    state = SharedState(
        SharedSettings(url="redis://127.0.0.1:1/0"), PeerIndexTarget(replicating), fleet
    )
    replicating.attach(state)
    replicating.record([1, 2, 3], "w1")
    PeerIndexTarget(replicating).record([7, 8], "w2")
    assert replicating.match([1, 2, 3]) == {"w1": 3}
    assert replicating.match([7, 8]) == {"w2": 2}
    assert state._pending.keys() == {("w1", 3)}
    assert replicating.blocks("w1") == [1, 2, 3]  # most recently used first
    rebuilt = PrefixIndex(block_tokens=16.0)
    rebuilt.record(replicating.blocks("w1"), "w1")
    assert rebuilt.blocks("w1") == [1, 2, 3]


def test_collector_exports_degraded_dropped_and_lag() -> None:
    _, fleet, _ = _fleet(A)
    state = SharedState(
        SharedSettings(url="redis://127.0.0.1:1/0"),
        PeerIndexTarget(ReplicatingIndex(PrefixIndex())),
        fleet,
    )
    state.dropped["records"] = 4
    state.lag.observe(0.12)
    registry = CollectorRegistry()
    registry.register(SharedStateCollector(state))
    text = generate_latest(registry).decode()
    assert "gateway_shared_state_degraded 1.0" in text
    assert 'gateway_shared_state_dropped_total{kind="records"} 4.0' in text
    assert 'gateway_shared_state_replication_lag_seconds_bucket{le="0.2"} 1.0' in text


def test_redis_config_and_password_from_env() -> None:
    cfg = config_from_dict({"redis": {"url": "rediss://h:6380/2", "prefix": "prod"}}).redis
    settings = settings_from(cfg, {"GATEWAY_REDIS_PASSWORD": "s3cret"})
    assert (settings.url, settings.prefix, settings.password) == (
        "rediss://h:6380/2",
        "prod",
        "s3cret",
    )
    assert settings_from(cfg, {}).password is None
    assert config_from_dict({}).redis == RedisConfig()
    for bad in ({"url": "http://h:1"}, {"prefix": "{x}"}, {"tick_s": 2.0, "load_ttl_s": 1.0}):
        try:
            config_from_dict({"redis": bad})
        except ConfigError as exc:
            assert "redis." in str(exc)
            assert "s3cret" not in str(exc)
        else:
            raise AssertionError(f"accepted {bad}")
