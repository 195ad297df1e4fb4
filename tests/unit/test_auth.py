"""Client and admin keys: sources, scopes, 401 versus 403, principals."""

from __future__ import annotations

from pathlib import Path

import pytest
from multidict import CIMultiDict

from gateway.config import ServerConfig
from gateway.errors import GatewayError
from gateway.forward.credentials import (
    WorkerCredentials,
    worker_credentials,
    worker_key,
    worker_key_exposed,
)
from gateway.http.auth import Authenticator, collect_keys, path_scope


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_scopes() -> None:
    for path in (
        "/workers",
        "/workers/abc/drain",
        "/add_worker",
        "/list_workers",
        "/debug/index",
        "/dashboard",
        "/dashboard/data",
        "/admin",
    ):
        assert path_scope(path) == "admin", path
    for path in ("/health", "/readiness", "/metrics"):
        assert path_scope(path) == "probe"
    for path in ("/v1/chat/completions", "/generate", "/v1/models", "/workersx"):
        assert path_scope(path) == "api"


def test_keys_from_every_source(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nk-file-1\n\nk-file-2\n")
    keys = collect_keys(
        single="k-flag",
        listed=["k-list", "k-flag"],
        env_var="GW_KEYS",
        file=str(f),
        environ={"GW_KEYS": "k-env-1, k-env-2"},
    )
    assert keys == ("k-flag", "k-list", "k-env-1", "k-env-2", "k-file-1", "k-file-2")


def test_unreadable_key_file_names_the_file_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read API key file"):
        collect_keys(file=str(tmp_path / "missing"))


def test_open_without_keys() -> None:
    assert Authenticator([]).check("/workers", {}) == "anonymous"


def test_client_keys_and_admin_key() -> None:
    auth = Authenticator(["c1", "c2"], ["adm"])
    assert auth.check("/v1/chat/completions", _bearer("c2")) == "client-1"
    assert auth.check("/v1/chat/completions", {"x-api-key": "c1"}) == "client-0"
    assert auth.check("/workers", _bearer("adm")) == "admin"
    assert auth.check("/health", {}) == "anonymous"
    cases = [
        ("/v1/chat/completions", {}, 401),
        ("/v1/chat/completions", _bearer("nope"), 401),
        ("/workers", {}, 401),
        ("/workers", _bearer("nope"), 401),
        ("/workers", _bearer("c1"), 403),
        ("/debug/decisions", _bearer("c1"), 403),
    ]
    for path, headers, status in cases:
        with pytest.raises(GatewayError) as err:
            auth.check(path, headers)
        assert err.value.status == status, (path, headers)


def test_admin_falls_back_to_client_keys_and_probes_can_be_keyed() -> None:
    auth = Authenticator(["c1"], protect_probes=True)
    assert auth.check("/workers", _bearer("c1")) == "client-0"
    with pytest.raises(GatewayError) as err:
        auth.check("/metrics", {})
    assert err.value.status == 401


def test_worker_key_sources() -> None:
    env = {"WK": "  from-env  "}
    assert worker_key("flag", "WK", env) == "flag"  # the configured key wins
    assert worker_key(None, "WK", env) == "from-env"
    assert worker_key(None, "WK", {}) is None
    assert worker_key(None, None, env) is None
    assert worker_key(None, "WK", {"WK": "   "}) is None


def test_worker_credentials_rewrite() -> None:
    client = CIMultiDict(
        [("Authorization", "Bearer client"), ("X-Api-Key", "client"), ("x-session-id", "s")]
    )
    stripped = WorkerCredentials(None, gateway_checks_keys=True)
    assert stripped.rewrites and stripped.session_headers() == {}
    kept = [(k, v) for k, v in client.items() if k.lower() not in stripped.drop]
    assert kept == [("x-session-id", "s")]
    keyed = WorkerCredentials("wk", gateway_checks_keys=False)
    assert keyed.rewrites and keyed.session_headers() == {"Authorization": "Bearer wk"}
    assert keyed.drop == {"authorization", "x-api-key"}
    passthrough = WorkerCredentials(None, gateway_checks_keys=False)
    assert not passthrough.rewrites and not passthrough.drop  # forwarded as they came
    assert "wk" not in repr(keyed)


def test_worker_credentials_from_config() -> None:
    server = ServerConfig(worker_api_key=None, worker_api_key_env="WK")
    assert worker_credentials(server, environ={"WK": "e"}).session_headers() == {
        "Authorization": "Bearer e"
    }
    assert "secret" not in repr(ServerConfig(worker_api_key="secret"))


def test_the_gateway_key_goes_to_workers_unless_they_have_their_own() -> None:
    shared = worker_credentials(ServerConfig(api_key="k"), environ={})
    assert shared.session_headers() == {"Authorization": "Bearer k"}
    assert shared.drop == {"authorization", "x-api-key"}
    own = worker_credentials(ServerConfig(api_key="k", worker_api_key="w"), environ={})
    assert own.session_headers() == {"Authorization": "Bearer w"}
    open_gateway = worker_credentials(ServerConfig(), environ={})
    assert open_gateway.session_headers() == {} and open_gateway.drop == frozenset()


def test_a_worker_key_of_its_own_needs_an_admin_key() -> None:
    assert worker_key_exposed(ServerConfig(worker_api_key="w"), environ={})
    assert worker_key_exposed(ServerConfig(worker_api_key_env="WK"), environ={"WK": "w"})
    assert not worker_key_exposed(ServerConfig(worker_api_key="w", admin_api_key="a"), {})
    assert not worker_key_exposed(ServerConfig(api_key="k"), environ={})  # the shared key
