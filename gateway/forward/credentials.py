"""What a worker sees in place of the client's credentials, and the gateway's own key.

Contract: :class:`WorkerCredentials` decides what a worker sees in place of the client's
credentials (:func:`worker_credentials`): with client keys on, the client's
``Authorization`` and ``x-api-key`` are dropped (a client's key is the gateway's
secret); ``Authorization: Bearer <key>`` replaces them, on the request path
(``drop`` / ``session_headers`` applied by the router) and on the gateway's own calls,
where the key is the worker key (:func:`worker_key`) if one is configured, else
``server.api_key`` (sglang-router sends its one ``--api-key`` to the workers too, so a
fleet sharing one key keeps working); with no key at all, the client's headers pass
through (clients that hold the workers' key). A worker key of its own needs an admin
key (:func:`worker_key_exposed`): else anyone allowed to add a worker could point one
at a host of theirs and receive the key with the first probe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from gateway.config import ServerConfig

# client header names (lower case) that carry a key to the gateway
CLIENT_CREDENTIALS = frozenset({"authorization", "x-api-key"})


def worker_key(
    configured: str | None, env_var: str | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The key the gateway presents to workers: ``configured``, else the environment
    variable named ``env_var``; None when neither holds one."""
    env = os.environ if environ is None else environ
    key = configured or (env.get(env_var) if env_var else None)
    return key.strip() or None if key else None


class WorkerCredentials:
    """What workers get in place of the client's credentials (see the module contract)."""

    __slots__ = ("_authorization", "drop", "rewrites")

    def __init__(self, worker_key: str | None, *, gateway_checks_keys: bool) -> None:
        self._authorization = f"Bearer {worker_key}" if worker_key else None
        # False: the client's headers go to the worker as they came (nothing to do)
        self.rewrites = gateway_checks_keys or self._authorization is not None
        # client header names (lower case) never forwarded
        self.drop = CLIENT_CREDENTIALS if self.rewrites else frozenset()

    def __repr__(self) -> str:  # never the key
        return f"WorkerCredentials(worker_key={self._authorization is not None})"

    def session_headers(self) -> dict[str, str]:
        """Headers to add to every request to a worker (the key, if any)."""
        return {"Authorization": self._authorization} if self._authorization else {}


def _shared_key(server: ServerConfig) -> str | None:
    key = server.api_key
    return key.strip() or None if key else None


def worker_credentials(
    server: ServerConfig,
    *,
    gateway_checks_keys: bool = False,
    environ: Mapping[str, str] | None = None,
) -> WorkerCredentials:
    """The worker key (``server.worker_api_key`` or its environment variable), else the
    gateway's own ``server.api_key`` (see the module contract)."""
    own = worker_key(server.worker_api_key, server.worker_api_key_env, environ)
    shared = _shared_key(server)
    return WorkerCredentials(
        own or shared, gateway_checks_keys=gateway_checks_keys or shared is not None
    )


def worker_key_exposed(server: ServerConfig, environ: Mapping[str, str] | None = None) -> bool:
    """A worker key of its own is configured but no admin key guards ``POST /workers``."""
    own = worker_key(server.worker_api_key, server.worker_api_key_env, environ)
    admin = (server.admin_api_key or "").strip() or server.admin_api_keys_file
    return own is not None and not admin
