"""Who may call what: client API keys, a separate admin key, open probe paths.

Contract:
- Keys come from any mix of sources (:func:`collect_keys`): single values (``--api-key``),
  lists in the config, an environment variable holding keys separated by commas or
  whitespace, and a file with one key per line (``#`` comments). Empty sources add none.
- :class:`Authenticator` classifies a path (:func:`path_scope`: ``admin``, ``probe`` or
  ``api``) and checks ``Authorization: Bearer <key>`` (or ``x-api-key``). Keys are
  compared in constant time against every configured key (no early exit, so the time
  does not tell which key nearly matched). Failures raise ``GatewayError``:
  401 without a key or with an unknown one, 403 when a client key asks for an admin path.
- Admin paths need an admin key when one is configured; without one they fall back to
  the client keys (the single ``--api-key`` behaviour of sglang-router), or only to
  ``admin_fallback`` when given: ``gateway.http.handlers`` gives ``server.api_key``
  alone when it is set, because it is also the key workers receive, and a holder of
  another client key who could register a worker of its own would receive it with the
  first probe. Probe paths are open unless ``protect_probes``. With no key configured
  at all, everything is open.
- :meth:`Authenticator.check` returns the caller's principal, a short label such as
  ``client-2`` or ``admin`` (never the key), used for rate limits and logs.
- What workers see of the client's credentials is ``gateway.forward.credentials``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

from gateway.config.keyfiles import read_key_file
from gateway.errors import GatewayError

ADMIN_PREFIXES = ("/workers", "/admin", "/debug", "/dashboard")
ADMIN_PATHS = frozenset({"/add_worker", "/remove_worker", "/list_workers"})
PROBE_PATHS = frozenset({"/health", "/readiness", "/liveness", "/metrics"})
ANONYMOUS = "anonymous"


def path_scope(path: str) -> str:
    """``admin``, ``probe`` or ``api`` for a request path."""
    if path in ADMIN_PATHS or any(path == p or path.startswith(p + "/") for p in ADMIN_PREFIXES):
        return "admin"
    if path in PROBE_PATHS:
        return "probe"
    return "api"


def collect_keys(
    *,
    single: str | None = None,
    listed: Iterable[str] = (),
    env_var: str | None = None,
    file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """Every key from every source, deduplicated in order."""
    env = os.environ if environ is None else environ
    keys: list[str] = []
    if single:
        keys.append(single)
    keys.extend(k for k in listed if k)
    if env_var and env.get(env_var):
        keys.extend(env[env_var].replace(",", " ").split())
    if file:
        keys.extend(read_key_file(file))
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


def _digest(key: str | bytes) -> bytes:
    raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


class Authenticator:
    def __init__(
        self,
        client_keys: Iterable[str],
        admin_keys: Iterable[str] = (),
        *,
        protect_probes: bool = False,
        admin_fallback: Iterable[str] | None = None,
    ) -> None:
        # Digests of equal length: compare_digest then costs the same for every key.
        keys = list(client_keys)
        self._clients = [(f"client-{i}", _digest(k)) for i, k in enumerate(keys)]
        allowed = set(keys if admin_fallback is None else admin_fallback)
        # the client principals that may use admin paths while no admin key is configured
        self._fallback = frozenset(f"client-{i}" for i, k in enumerate(keys) if k in allowed)
        self._admins = [
            ("admin" if i == 0 else f"admin-{i}", _digest(k)) for i, k in enumerate(admin_keys)
        ]
        self._protect_probes = protect_probes

    @property
    def enabled(self) -> bool:
        return bool(self._clients or self._admins)

    @staticmethod
    def presented(headers: Mapping[str, str]) -> str | None:
        """The key the caller sent, if any (Bearer token, else ``x-api-key``)."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return headers.get("x-api-key") or None

    @staticmethod
    def _match(table: list[tuple[str, bytes]], digest: bytes) -> str | None:
        found = None
        for name, expected in table:  # no early exit: the same work whatever matches
            if hmac.compare_digest(expected, digest) and found is None:
                found = name
        return found

    def check(self, path: str, headers: Mapping[str, str]) -> str:
        """The caller's principal, or GatewayError 401/403 (see the module contract)."""
        scope = path_scope(path)
        if not self.enabled or (scope == "probe" and not self._protect_probes):
            return ANONYMOUS
        key = self.presented(headers)
        if key is None:
            raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'")
        digest = _digest(key)
        admin = self._match(self._admins, digest)
        client = self._match(self._clients, digest)
        if scope == "admin":
            if admin is not None:
                return admin
            if not self._admins and client is not None and client in self._fallback:
                return client
            if client is not None:
                raise GatewayError(403, "this key may not use the admin API")
            raise GatewayError(401, "invalid API key")
        if client is not None:
            return client
        if admin is not None:
            return admin  # the operator's key may use the API too
        raise GatewayError(401, "invalid API key")
