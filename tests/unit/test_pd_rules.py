"""PD mode's pure parts: the configuration's refusals, the pair's body (bootstrap fields),
input logprobs merged from the prefill, roles in the registry and readiness."""

from __future__ import annotations

import orjson
import pytest

from gateway.cli import parse_config
from gateway.config import ConfigError, parse_prefill_spec
from gateway.routing import pd
from gateway.routing.request import ApiKind
from gateway.workers.registry import DECODE, PREFILL, HealthFlag, WorkerMetadata, WorkerRegistry
from gateway.workers.replies import parse_server_info

P, D = "http://127.0.0.1:30001", "http://127.0.0.1:30002"


def test_pd_flags_as_sglang_router_takes_them() -> None:
    cfg = parse_config(
        ["--pd-disaggregation", "--prefill", P, "8998", "--prefill", "http://127.0.0.1:30003",
         "--decode", D, "--prefill-policy", "cache_aware", "--decode-policy", "round_robin"]
    )  # fmt: skip
    assert cfg.pd.enabled and cfg.pd.decode == (D,)
    assert [parse_prefill_spec(s) for s in cfg.pd.prefill] == [
        (P, 8998),
        ("http://127.0.0.1:30003", None),
    ]
    assert (cfg.pd.prefill_policy, cfg.pd.decode_policy) == ("cache_aware", "round_robin")
    assert parse_prefill_spec(f"{P} none") == (P, None)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--prefill", P], "(--prefill): needs pd.enabled (--pd-disaggregation)"),
        (["--decode", D], "(--decode): needs pd.enabled"),
        (["--pd-disaggregation", "--decode", D], "(--prefill): PD mode needs at least one"),
        (["--pd-disaggregation", "--prefill", P], "(--decode): PD mode needs at least one"),
        (["--pd-disaggregation", "--prefill", P, "0", "--decode", D], "bootstrap port"),
        (["--pd-disaggregation", "--prefill", P, "x", "--decode", D], "bootstrap port"),
        (["--pd-disaggregation", "--prefill", P, "1", "2", "--decode", D], "URL [BOOTSTRAP_PORT]"),
        (["--pd-disaggregation", "--prefill", "ftp://h:1", "--decode", D], "pd.prefill[0]"),
        (["--pd-disaggregation", "--prefill", P, "--decode", P], "already listed in pd.prefill"),
        (["--pd-disaggregation", "--prefill", P, "--prefill", P, "--decode", D], "already listed"),
        (
            ["--pd-disaggregation", "--prefill", P, "--decode", D, "--worker-urls", D],
            "(--worker-urls): in PD mode",
        ),
        (
            ["--pd-disaggregation", "--prefill", P, "--decode", D, "--decode-policy", "x"],
            "pd.decode_policy (--decode-policy): unknown policy",
        ),
        (
            ["--pd-disaggregation", "--prefill", P, "--decode", D, "--redis-url", "redis://h:1"],
            "redis.url (--redis-url)",
        ),
    ],
)
def test_bad_pd_configurations_are_refused_naming_the_flag(argv: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(argv)
    assert named in str(info.value)


def test_the_pair_body_carries_the_bootstrap_fields_and_replaces_the_clients() -> None:
    body = b'{"text":"hi","bootstrap_room":1,"bootstrap_host":"evil","routed_dp_rank":3}'
    out = orjson.loads(pd.pair_body(body, P, 8998, 12345, {"rid": "r1"}))
    assert out == {
        "text": "hi",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 12345,
        "rid": "r1",
    }
    v6 = orjson.loads(pd.pair_body(b"{}", "http://[::1]:30001", None, 7, {}))
    assert v6["bootstrap_host"] == "[::1]" and v6["bootstrap_port"] is None


def test_rooms_are_63_bit_with_batch_headroom() -> None:
    rooms = {pd.new_room() for _ in range(200)}
    assert len(rooms) == 200
    assert all(0 <= r < (1 << 63) - (1 << 32) for r in rooms)


def test_input_logprobs_are_merged_from_the_prefill() -> None:
    assert pd.wants_input_logprobs(ApiKind.GENERATE, b'{"text":"a","return_logprob":true}')
    assert not pd.wants_input_logprobs(ApiKind.GENERATE, b'{"text":"a"}')
    assert not pd.wants_input_logprobs(ApiKind.CHAT, b'{"return_logprob":true}')
    prefill = orjson.dumps({"text": "x", "meta_info": {"input_token_logprobs": [[-1.0, 5, None]]}})
    found = pd.input_logprobs(prefill)
    assert found == [[[-1.0, 5, None]]]
    merge = pd.merger(found)
    decode = orjson.dumps({"text": "xy", "meta_info": {"input_token_logprobs": [[-2.0, 6, None]]}})
    merged = orjson.loads(merge(decode))
    assert merged["meta_info"]["input_token_logprobs"] == [[-1.0, 5, None], [-2.0, 6, None]]
    # a stream: every event with meta_info gets the prefill's list first
    stream = b'data: {"text":"a","meta_info":{}}\n\ndata: [DONE]\n\n'
    out = merge(stream)
    assert out.endswith(b"data: [DONE]\n\n")
    first = orjson.loads(out.split(b"\n\n")[0].removeprefix(b"data: "))
    assert first["meta_info"]["input_token_logprobs"] == [[-1.0, 5, None]]
    streamed = b'data: {"meta_info":{"input_token_logprobs":[[-3.0,1,null]]}}\n\ndata: [DONE]\n\n'
    assert pd.input_logprobs(streamed) == [[[-3.0, 1, None]]]
    assert pd.input_logprobs(b"not json") is None


def test_roles_candidates_and_readiness() -> None:
    reg = WorkerRegistry(0.5, lambda: 0.0)
    p, _ = reg.add(P, "sglang", PREFILL, 8998)
    d, _ = reg.add(D, "sglang", DECODE)
    for w in (p, d):
        w.flags.clear()
    assert [w.id for w in reg.candidates(role=PREFILL)] == [p.id]
    assert [w.id for w in reg.candidates(role=DECODE)] == [d.id]
    assert reg.ready()
    d.flags.add(HealthFlag.CHECK_FAILED)
    assert not reg.ready()  # a prefill alone cannot serve
    described = p.describe(0.0)
    assert described["worker_type"] == PREFILL and described["bootstrap_port"] == 8998


def test_server_info_tells_the_pd_role_and_bootstrap_port() -> None:
    meta = parse_server_info(
        {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 9000}
    )
    assert (meta.disaggregation_mode, meta.bootstrap_port) == ("prefill", 9000)
    assert parse_server_info({"disaggregation_bootstrap_port": 0}).bootstrap_port is None
    assert WorkerMetadata().disaggregation_mode is None
