"""Data-parallel ranks: each rank of an SGLang worker with ``dp_size > 1`` is a routing
target of its own (registry, load, the forwarded body's rank member, exact mode)."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from gateway.config.workerspec import rank_target_id, split_target_id
from gateway.exact.manager import MODE_EXACT, KVEventsManager, KVEventsSettings, _WorkerState
from gateway.exact.tokenizer import load_tokenizer
from gateway.exact.wire import Descriptor, Stored
from gateway.forward.outbound import body_with_members
from gateway.routing.lease import Lease
from gateway.workers.kinds import dp_rank_key, kind_named
from gateway.workers.registry import HealthFlag, Worker, WorkerMetadata, WorkerRegistry
from gateway.workers.replies import parse_server_info
from loadtests.harness.inprocess import SIM_TOKENIZER


def _registry(*dp_sizes: int) -> tuple[WorkerRegistry, list[Worker], list[str]]:
    reg = WorkerRegistry(0.5, lambda: 100.0)
    gone: list[str] = []
    reg.on_target_removed(lambda t: gone.append(t.id))
    workers = []
    for i, size in enumerate(dp_sizes):
        worker, _ = reg.add(f"http://127.0.0.1:{18000 + i}")
        worker.flags.clear()
        worker.metadata = WorkerMetadata(model="m", dp_size=size, capacity_tokens=1000)
        reg.sync_ranks(worker)
        workers.append(worker)
    return reg, workers, gone


def test_target_ids_round_trip() -> None:
    assert rank_target_id("127.0.0.1-18000", 3) == "127.0.0.1-18000@dp3"
    assert split_target_id("127.0.0.1-18000@dp3") == ("127.0.0.1-18000", 3)
    assert split_target_id("127.0.0.1-18000") == ("127.0.0.1-18000", None)
    assert split_target_id("@dp3") == ("@dp3", None)


def test_each_rank_is_a_candidate_and_a_one_rank_worker_is_itself() -> None:
    reg, (dp, single), _ = _registry(4, 1)
    ids = [c.id for c in reg.candidates()]
    assert ids == [f"{dp.id}@dp{r}" for r in range(4)] + [single.id]
    assert [r.dp_rank for r in dp.ranks] == [0, 1, 2, 3]
    assert single.ranks == () and single.dp_rank is None
    assert reg.get(f"{dp.id}@dp2") is dp.ranks[2]
    assert reg.find(f"{dp.id}@dp2") is None  # the admin API names workers, not ranks
    assert [t.id for t in reg.targets()] == ids


def test_a_rank_shares_its_workers_health_url_and_metadata() -> None:
    reg, (dp, other), _ = _registry(2, 1)
    rank = dp.ranks[1]
    assert rank.url == dp.url and rank.server is dp and dp.server is dp
    assert rank.metadata is dp.metadata and rank.kind == dp.kind
    rank.flags.add(HealthFlag.EJECTED)  # what outlier detection does, through a rank
    assert HealthFlag.EJECTED in dp.flags
    rank.consecutive_5xx = 3
    assert dp.consecutive_5xx == 3
    assert [c.id for c in reg.candidates()] == [other.id]
    dp.flags.clear()
    # excluding the worker excludes all its ranks; excluding one rank, only that one
    assert [c.id for c in reg.candidates([dp.id])] == [other.id]
    assert [c.id for c in reg.candidates([rank.id])] == [dp.ranks[0].id, other.id]


def test_leases_count_per_rank_and_the_worker_reports_the_sum() -> None:
    _, (dp,), _ = _registry(2)
    a = Lease(dp.ranks[0], 100)
    b = Lease(dp.ranks[1], 50)
    b.first_token()
    assert (dp.ranks[0].in_flight, dp.ranks[0].queued_prefill_tokens) == (1, 100)
    assert (dp.ranks[1].decoding_requests, dp.in_flight) == (1, 0)
    view = dp.ranks[0].view(0.0)
    assert view.id == dp.ranks[0].id and view.in_flight == 1 and view.capacity_tokens == 1000
    d = dp.describe(0.0)
    assert (d["in_flight"], d["queued_prefill_tokens"], d["decoding_requests"]) == (2, 100, 1)
    assert d["dp_size"] == 2 and [r["id"] for r in d["dp_ranks"]] == [r.id for r in dp.ranks]
    a.release()
    b.release()
    assert all(r.in_flight == 0 for r in dp.ranks)


def test_rank_changes_and_removal_tell_the_target_listeners() -> None:
    reg, (dp,), gone = _registry(4)
    assert gone == [dp.id]  # its entries as one target do not hold per rank
    gone.clear()
    dp.metadata = WorkerMetadata(dp_size=2)
    assert reg.sync_ranks(dp)
    assert gone == [f"{dp.id}@dp2", f"{dp.id}@dp3"] and len(dp.ranks) == 2
    assert reg.get(f"{dp.id}@dp3") is None
    gone.clear()
    assert not reg.sync_ranks(dp)  # unchanged
    removed: list[str] = []
    reg.on_removed(lambda w: removed.append(w.id))
    reg.remove(dp.id)
    assert gone == [f"{dp.id}@dp0", f"{dp.id}@dp1", dp.id] and removed == [dp.id]
    assert reg.get(f"{dp.id}@dp0") is None


def test_a_worker_back_to_one_rank_is_one_target_again() -> None:
    reg, (dp,), gone = _registry(2)
    gone.clear()
    dp.metadata = WorkerMetadata(dp_size=1)
    reg.sync_ranks(dp)
    assert dp.ranks == () and [c.id for c in reg.candidates()] == [dp.id]
    assert gone == [f"{dp.id}@dp0", f"{dp.id}@dp1", dp.id]


def test_server_info_tells_dp_size_and_version() -> None:
    info = {"served_model_name": "m", "dp_size": 4, "version": "0.5.23"}
    meta = parse_server_info(info)
    assert (meta.dp_size, meta.version) == (4, "0.5.23")
    for bad in (0, -1, True, "4", None, 2.0):
        assert parse_server_info({"dp_size": bad}).dp_size == 1


@pytest.mark.parametrize(
    ("version", "key"),
    [
        ("0.5.23", "routed_dp_rank"),
        ("0.5.10", "routed_dp_rank"),
        ("0.5.10rc0", "routed_dp_rank"),
        ("0.6.0", "routed_dp_rank"),
        ("0.5.9", "data_parallel_rank"),
        ("0.4.10.post2", "data_parallel_rank"),
        (None, "data_parallel_rank"),
        ("main", "data_parallel_rank"),
    ],
)
def test_the_rank_member_is_spelled_as_the_version_expects(version: str | None, key: str) -> None:
    assert dp_rank_key(version) == key


def test_body_members_replace_the_clients_spellings() -> None:
    body = b'{"model":"m","data_parallel_rank":7,"messages":[]}'
    out = orjson.loads(
        body_with_members(
            body,
            {"routed_dp_rank": 1},
            rewrite=True,
            drop=("routed_dp_rank", "data_parallel_rank"),
        )
    )
    assert out == {"model": "m", "messages": [], "routed_dp_rank": 1}
    appended = body_with_members(b'{"a":1}', {"rid": "r", "routed_dp_rank": 0}, rewrite=False)
    assert orjson.loads(appended) == {"a": 1, "rid": "r", "routed_dp_rank": 0}
    assert orjson.loads(body_with_members(b"{ }", {"x": 2}, rewrite=False)) == {"x": 2}


def test_v1_loads_per_rank() -> None:
    raw = orjson.dumps(
        {
            "loads": [
                {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1,
                 "max_total_num_tokens": 500, "token_usage": 0.5},
                {"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0,
                 "max_total_num_tokens": 500, "token_usage": 0.0},
                {"dp_rank": "x", "num_running_reqs": 9},
            ]
        }
    )  # fmt: skip
    kind = kind_named("sglang")
    ranks = kind.parse_rank_loads("/v1/loads", raw)
    assert sorted(ranks) == [0, 1]
    assert ranks[0][0].running_requests == 3 and ranks[0][1] == 500
    assert ranks[1][0].running_requests == 0
    whole = kind.parse_load("/v1/loads", raw)
    assert whole is not None and whole[0].running_requests == 12
    get_load = orjson.dumps([{"dp_rank": 1, "num_reqs": 4, "num_waiting_reqs": 1}])
    assert kind.parse_rank_loads("/get_load", get_load)[1][0].running_requests == 3
    assert kind.parse_rank_loads("/metrics", raw) == {}
    assert kind_named("llamacpp").parse_rank_loads("/v1/loads", raw) == {}


async def test_exact_mode_keeps_each_ranks_blocks_apart() -> None:
    settings = KVEventsSettings(enabled="true", stale_timeout_s=100.0, hybrid=False)
    async with aiohttp.ClientSession() as session:
        mgr = KVEventsManager(settings, load_tokenizer(SIM_TOKENIZER), list, session)
        try:
            desc = Descriptor("127.0.0.1", 1, "", 4, 2, None)
            mgr._states["w"] = _WorkerState(tokenizer=mgr.tokenizers.default, desc=desc)
            ids = list(range(1, 10))
            mgr._apply("w", 1, 0.0, [Stored([7, 8], None, ids[:8], 4)])
            ns = (None, None, None)
            assert mgr.match(ids, ns, ["w@dp0", "w@dp1"]) == {"w@dp0": 0, "w@dp1": 8}
            assert mgr.mode("w@dp0") == MODE_EXACT
            assert mgr.block_size("w@dp1") == 4
            first = mgr.request_hashes(ids, ns, 4)[0]
            mgr._apply("w", 0, 0.0, [Stored([5, 6], None, ids[:8], 4)])
            assert mgr.index.holds("w@dp0", first) and mgr.index.holds("w@dp1", first)
            mgr._gap_lost("w", 1)  # a rank's lost batches clear that rank only
            assert mgr.index.holds("w@dp0", first) and not mgr.index.holds("w@dp1", first)
            mgr.index.clear("w")  # the worker's clear reaches its ranks' blocks
            assert not mgr.index.holds("w@dp0", first)
        finally:
            await mgr.close()
