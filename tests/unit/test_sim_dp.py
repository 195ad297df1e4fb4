"""The simulated worker's data-parallel ranks (``--dp-size``): SGLang's dispatch rule and
rank check, how a route reads the rank, per-rank metrics, the KV publishers' ports, the
configuration and the CLI flag."""

from __future__ import annotations

from typing import Any

import pytest
import zmq

from simulator.__main__ import build_parser, config_from_args
from simulator.config import KVEventsConfig, SimConfig
from simulator.http import metrics
from simulator.http.api import ApiError
from simulator.http.kv_publisher import KVEventPublisher
from simulator.http.sglang.dp import DPRank, DPRanks, routed_rank, start_publishers
from simulator.model.radix_worker import WorkerModel


def _ranks(n: int) -> DPRanks:
    config = SimConfig()
    return DPRanks([DPRank(r, WorkerModel.from_config(config), None) for r in range(n)])


def test_dispatch_is_round_robin_unless_a_rank_is_named() -> None:
    dp = _ranks(3)
    assert [dp.dispatch(None).rank for _ in range(4)] == [0, 1, 2, 0]
    assert dp.dispatch(2).rank == 2
    assert dp.dispatch(None).rank == 1  # a named rank does not take a turn
    # health checks have a round robin of their own
    assert [dp.health_rank().rank for _ in range(4)] == [0, 1, 2, 0]
    assert dp.dispatch(None).rank == 2


def test_rank_check_is_the_tokenizers() -> None:
    dp = _ranks(2)
    assert dp.check(None) is None and dp.check(0) == 0 and dp.check(1) == 1
    for bad in (2, -1):
        with pytest.raises(ValueError, match=rf"^routed_dp_rank={bad} out of range \[0, 2\)$"):
            dp.check(bad)
    single = _ranks(1)
    assert single.check(0) is None  # ignored on one rank
    with pytest.raises(ValueError, match=r"out of range \[0, 1\)"):
        single.check(1)


@pytest.mark.parametrize(
    ("body", "native", "expected"),
    [
        ({}, True, None),
        ({"routed_dp_rank": 1}, True, 1),
        ({"data_parallel_rank": 1}, True, 1),
        ({"data_parallel_rank": "1"}, True, 1),  # the alias is only pydantic's: lax
        ({"routed_dp_rank": 0, "data_parallel_rank": 1}, False, 0),
        ({"routed_dp_rank": None, "data_parallel_rank": 1}, False, 1),
        ({"routed_dp_rank": True}, False, 1),
        ({"routed_dp_rank": 1.0}, False, 1),
        ({"routed_dp_rank": " 2 "}, False, 2),
        ({"routed_dp_rank": -3}, False, -3),
    ],
)
def test_the_rank_a_request_names(body: dict[str, Any], native: bool, expected: int) -> None:
    assert routed_rank(body, native) == expected


@pytest.mark.parametrize(
    ("value", "kind"),
    [("x", "int_parsing"), (1.5, "int_from_float"), ([1], "int_type"), ({}, "int_type")],
)
def test_a_rank_that_is_no_integer_is_pydantics_400(value: Any, kind: str) -> None:
    for native in (True, False):
        with pytest.raises(ApiError) as err:
            routed_rank({"routed_dp_rank": value}, native)
        assert err.value.status == 400
        assert f"'type': '{kind}'" in err.value.body["message"]
        assert "('body', 'routed_dp_rank')" in err.value.body["message"]


@pytest.mark.parametrize(
    ("value", "shown"),
    [("1", 'string "1"'), (1.0, "floating point `1.0`"), (True, "boolean `true`")],
)
def test_generate_contract_wants_a_json_integer(value: Any, shown: str) -> None:
    with pytest.raises(ApiError) as err:
        routed_rank({"routed_dp_rank": value}, native=True)
    assert (err.value.status, err.value.body) == (
        400,
        {"error": f"invalid type: {shown}, expected i64"},
    )


def test_the_openai_header_wins() -> None:
    headers = {"X-Data-Parallel-Rank": "1"}
    assert routed_rank({"routed_dp_rank": 0}, False, headers) == 1
    with pytest.raises(ApiError) as err:
        routed_rank({}, False, {"X-Data-Parallel-Rank": "one"})
    assert err.value.body["message"] == (
        "Invalid X-Data-Parallel-Rank header: must be an integer, got 'one'"
    )
    assert err.value.body["type"] == "400"


def test_metrics_label_each_rank_and_one_rank_as_before() -> None:
    engines = [WorkerModel.from_config(SimConfig()) for _ in range(2)]
    snaps = [e.metrics_snapshot for e in engines]
    requests = metrics.RequestMetrics()
    single = metrics.render("m", snaps[0], requests, 1, 4096)
    assert metrics.render("m", snaps[:1], requests, 1, 4096) == single
    assert b"dp_rank" not in single
    text = metrics.render("m", snaps, requests, 1, 4096).decode()
    lines = [line for line in text.splitlines() if line.startswith("sglang:num_used_tokens{")]
    assert [line.split("{")[1].split(",")[0] for line in lines] == ['dp_rank="0"', 'dp_rank="1"']
    pid_lines = [line for line in text.splitlines() if line.startswith("sglang:num_paused_reqs{")]
    assert len(pid_lines) == 2 and all("pid=" in line for line in pid_lines)
    assert text.count("# TYPE sglang:num_used_tokens gauge") == 1


def test_config_and_flag() -> None:
    assert SimConfig().dp_size == 1
    with pytest.raises(ValueError, match="dp_size must be at least 1"):
        SimConfig(dp_size=0).validate()
    with pytest.raises(ValueError, match="dp_size is SGLang's"):
        SimConfig(engine="llamacpp", dp_size=2).validate()
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--dp-size", "3"])).dp_size == 3
    assert config_from_args(parser.parse_args(["--data-parallel-size", "2"])).dp_size == 2
    assert "--dp-size" in parser.format_help()


async def test_publishers_take_consecutive_ports_and_retry_when_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = KVEventsConfig.from_json(
        '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:0"}'
    )
    publishers = [KVEventPublisher(config, 1, dp_rank=r) for r in range(3)]
    real_bind = publishers[2].bind
    calls: list[tuple[int | None, int | None]] = []

    def taken_once(port: int | None = None, replay_port: int | None = None) -> None:
        calls.append((port, replay_port))
        if len(calls) == 1:
            raise zmq.ZMQError(zmq.EADDRINUSE)
        real_bind(port, replay_port)

    monkeypatch.setattr(publishers[2], "bind", taken_once)
    try:
        start_publishers(publishers)
        base, replay = publishers[0].port, publishers[0].replay_port
        assert base is not None and replay is not None
        assert [p.port for p in publishers] == [base, base + 1, base + 2]
        assert [p.replay_port for p in publishers] == [replay, replay + 1, replay + 2]
        assert len(calls) == 2 and calls[1] == (base + 2, replay + 2)
        # nothing went out before every rank was bound: each published its startup batch once
        assert [p.batches_sent for p in publishers] == [1, 1, 1]
        assert publishers[0].descriptor(3)["dp_size"] == 3
    finally:
        for publisher in publishers:
            await publisher.close()
