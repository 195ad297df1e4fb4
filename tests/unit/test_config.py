"""Configuration: defaults documented in config/gateway.yaml, flags over file, errors named."""

from __future__ import annotations

import dataclasses
import io
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from gateway.cli import configure_logging, main, parse_config
from gateway.config import (
    ConfigError,
    GatewayConfig,
    _build,
    config_from_dict,
    merge,
    validate_worker_url,
)
from gateway.telemetry.logs import JsonFormatter, PlainFormatter

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "config" / "gateway.yaml"


def _keys() -> set[str]:
    """Dotted keys of every config field: ``section.field`` or a top-level ``field``."""
    default = GatewayConfig()
    out: set[str] = set()
    for f in dataclasses.fields(default):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out |= {f"{f.name}.{g.name}" for g in dataclasses.fields(value)}
        else:
            out.add(f.name)
    return out


def _flatten(data: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in data.items():
        mappings = ("params", "tokenizers", "chat_templates", "models")
        if isinstance(value, dict) and key not in mappings:
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def test_documented_file_holds_every_key_with_its_default() -> None:
    data = yaml.safe_load(DOC.read_text())
    assert _flatten(data) == _keys()
    assert _build(GatewayConfig, data, "") == GatewayConfig()


def test_flags_override_file(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(
        "server: {port: 1234, host: 127.0.0.2}\nhealth: {interval_s: 9}\npolicy: {name: random}\n"
    )
    cfg = parse_config(
        [
            "--config",
            str(path),
            "--port",
            "4321",
            "--health-check-timeout-secs",
            "0.5",
            "--worker-urls",
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
        ]
    )
    assert cfg.server.port == 4321
    assert cfg.server.host == "127.0.0.2"
    assert cfg.health.interval_s == 9.0
    assert cfg.health.timeout_s == 0.5
    assert cfg.policy.name == "random"
    assert cfg.workers == ("http://127.0.0.1:1", "http://127.0.0.1:2")


def test_sglang_router_defaults() -> None:
    cfg = parse_config(["--policy", "round_robin"])
    assert cfg.server.host == "127.0.0.1"
    assert cfg.server.port == 30000
    assert cfg.health.interval_s == 5.0
    assert cfg.health.timeout_s == 2.0
    assert cfg.health.endpoint == "/health"
    assert cfg.policy.cache_threshold == 0.3
    assert cfg.policy.balance_abs_threshold == 64
    assert cfg.policy.balance_rel_threshold == 1.5
    assert GatewayConfig().policy.name == "min_ttft"


def test_policy_args_parsed_as_yaml() -> None:
    cfg = parse_config(["--policy", "round_robin", "--request-id-headers", "x-a", "x-b"])
    assert cfg.server.request_id_headers == ("x-a", "x-b")
    merged = merge({"policy": {"params": {"a": 1}}}, {"policy.params": {"b": 2.5}})
    assert merged["policy"]["params"] == {"a": 1, "b": 2.5}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--policy", "nope"], "policy.name (--policy)"),
        (["--port", "0"], "server.port (--port)"),
        (["--health-check-interval-secs", "-1"], "health.interval_s"),
        (["--health-failure-threshold", "0"], "--health-failure-threshold"),
        (["--worker-urls", "ftp://h:1"], "workers[0] (--worker-urls)"),
        (["--worker-urls", "http://h"], "explicit port"),
        (["--log-level", "loud"], "server.log_level"),
        (["--health-check-endpoint", "health"], "health.endpoint"),
        (["--policy-arg", "novalue"], "--policy-arg"),
        (["--policy-arg", "unknown_param=1"], "policy.params"),
        (["--cache-threshold", "2"], "policy.cache_threshold"),
        (["--queue-size", "-3"], "admission.queue_size"),
        (["--slot-wait-secs", "-1"], "--slot-wait-secs"),
    ],
)
def test_invalid_values_name_the_key(argv: list[str], named: str) -> None:
    base = [] if "--policy" in argv else ["--policy", "round_robin"]
    with pytest.raises(ConfigError) as info:
        parse_config(base + argv)
    assert named in str(info.value)


def test_file_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text("health: {intervl_s: 3}\n")
    with pytest.raises(ConfigError, match=r"health\.intervl_s: unknown key"):
        parse_config(["--config", str(path)])
    path.write_text("server: {port: eighty}\n")
    with pytest.raises(ConfigError, match=r"server\.port.*integer"):
        parse_config(["--config", str(path)])
    with pytest.raises(ConfigError, match="--config"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])


def test_main_exits_2_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--policy", "round_robin", "--port", "99999"]) == 2
    err = capsys.readouterr().err
    assert "server.port (--port)" in err and "65535" in err


def test_config_is_frozen() -> None:
    cfg = config_from_dict({"policy": {"name": "random"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.port = 1  # type: ignore[misc]


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://w.example:443/"])
def test_worker_url_accepted(url: str) -> None:
    assert validate_worker_url(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "",
        "127.0.0.1:8000",
        "ws://h:1",
        "http://:80",
        "http://h:x",
        "http://h",
        "http://h:1/?q=1",
        5,
    ],
)
def test_worker_url_refused(url: object) -> None:
    with pytest.raises(ValueError):
        validate_worker_url(url)


def test_log_json_flag_selects_the_json_formatter() -> None:
    assert parse_config([]).server.log_json is False
    cfg = parse_config(["--log-json", "--log-level", "warn"])
    assert cfg.server.log_json is True
    root = logging.getLogger()
    level = root.level
    buf = io.StringIO()
    handler = configure_logging(cfg.server, stream=buf)
    try:
        assert isinstance(handler.formatter, JsonFormatter)
        assert root.level == logging.WARNING
        logging.getLogger("gateway.test").warning("started on %d", 30000)
        doc = orjson.loads(buf.getvalue().splitlines()[-1])
        assert doc["message"] == "started on 30000" and doc["level"] == "WARNING"
        plain = configure_logging(parse_config([]).server, stream=io.StringIO())
        assert isinstance(plain.formatter, PlainFormatter)  # replaced, not added
        assert handler not in root.handlers
    finally:
        for h in [h for h in root.handlers if h.get_name() == handler.get_name()]:
            root.removeHandler(h)
            h.close()
        root.setLevel(level)
