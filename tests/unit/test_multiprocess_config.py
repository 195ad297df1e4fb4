"""Several gateway processes (``--processes N``, ``server.processes``): the configuration
refuses what cannot work (N > 1 without Redis, PD mode, out of range) naming the flag, and
each process gets its own gateway id."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.cli import main, parse_config
from gateway.config import ConfigError
from gateway.multiprocess import child_configs

WORKER = ["--worker-urls", "http://127.0.0.1:18001"]
REDIS = ["--redis-url", "redis://127.0.0.1:6379/0"]


def test_one_process_by_default() -> None:
    assert parse_config(WORKER).server.processes == 1


def test_several_processes_need_redis_named_by_flag() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config([*WORKER, "--processes", "2"])
    message = str(info.value)
    assert message.startswith("server.processes (--processes):")
    assert "redis.url (--redis-url)" in message and "got 2" in message


def test_yaml_processes_without_redis_refused(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text("server: {processes: 3}\nworkers: [http://127.0.0.1:18001]\n")
    with pytest.raises(ConfigError, match=r"server\.processes \(--processes\).*redis\.url"):
        parse_config(["--config", str(path)])


def test_several_processes_with_redis_accepted() -> None:
    cfg = parse_config([*WORKER, *REDIS, "--processes", "4"])
    assert cfg.server.processes == 4


@pytest.mark.parametrize("n", ["0", "-1", "65"])
def test_out_of_range_refused(n: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.processes \(--processes\): must be in 1\.\.64"):
        parse_config([*WORKER, *REDIS, "--processes", n])


def test_pd_mode_stays_in_one_process() -> None:
    argv = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:18001", "--decode",
            "http://127.0.0.1:18002", "--processes", "2"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"--processes\).*PD mode runs in one process"):
        parse_config(argv)


def test_main_refuses_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*WORKER, "--processes", "2"]) == 2
    assert "--processes" in capsys.readouterr().err


def test_each_process_its_own_gateway_id() -> None:
    cfg = parse_config([*WORKER, *REDIS, "--processes", "3"])
    ids = [c.redis.gateway_id for c in child_configs(cfg, "base")]
    assert ids == ["base-0", "base-1", "base-2"]
    assert [c.server for c in child_configs(cfg, "base")] == [cfg.server] * 3
    drawn = [c.redis.gateway_id or "" for c in child_configs(cfg)]
    assert len({i.rsplit("-", 1)[0] for i in drawn}) == 1 and len(set(drawn)) == 3


def test_configured_gateway_id_is_the_base() -> None:
    cfg = parse_config([*WORKER, *REDIS, "--processes", "2"])
    named = dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, gateway_id="edge"))
    assert [c.redis.gateway_id for c in child_configs(named, "ignored")] == ["edge-0", "edge-1"]
