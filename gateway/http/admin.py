"""Worker administration, compatible with sglang-router's API.

Contract:
- ``POST /workers {"url": ..., "kind": ..., "worker_type": ..., "bootstrap_port": ...}``:
  validates the URL (http/https, host, port; else 400) and the optional kind (``sglang``,
  ``llamacpp``, ``vllm``, ``openai``, ``auto``; a ``url#kind`` suffix works too; absent:
  the ``worker_kind`` setting), and sglang-router's ``worker_type`` (``regular``; in PD
  mode ``prefill``, with its ``bootstrap_port``, or ``decode``: SGLang workers), registers
  the worker, probes it once at once, and answers 201 with its live state (200 if it was
  already registered).
- ``GET /workers``: every worker's live state; ``GET /workers/{id}``: one (404 if unknown);
  ``DELETE /workers/{id}``: removes it (in-flight requests finish; the prefix index and
  cost model forget it). ``{id}`` may also be the worker's URL, percent-encoded.
- Adding refuses (403) a URL whose host is outside ``server.worker_allowlist``.
- ``POST /workers/{id}/drain``: no new requests go there; in-flight ones finish (202).
  With ``drain.rehome`` (``?rehome=``) its recent prefixes get new homes, and with a
  prompt store (``?prewarm=``, ``?deadline_s=``) the hottest are pre-warmed there
  (``gateway.routing.prewarm``); the answer's ``drain`` member and ``GET
  /workers/{id}/drain`` (404 before any drain) hold the report. ``DELETE
  /workers/{id}?rehome=true`` re-homes before removing. A worker added at run time ramps
  under slow start and is pre-warmed with the fleet's most shared prefixes: ``GET
  /workers/{id}/join`` (404 when neither applies).
- Legacy: ``POST /add_worker?url=``, ``POST /remove_worker?url=``, ``GET /list_workers``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from gateway.config import validate_worker_url
from gateway.config.allowlist import HostAllowList, NotAllowed
from gateway.config.workerspec import SGLANG, configured_kind, parse_worker_spec
from gateway.errors import GatewayError
from gateway.http import app_keys
from gateway.routing.prewarm import Membership
from gateway.workers.registry import PREFILL, REGULAR, ROLES, HealthFlag, Worker

ALLOWLIST = web.AppKey("worker_allowlist", HostAllowList)  # set by gateway.app
MEMBERSHIP = web.AppKey("membership", Membership)  # set by gateway.app at startup


async def _allowed(app: web.Application, url: str) -> None:
    """403 unless ``url``'s host is in the worker allow-list (no SSRF via the admin API)."""
    allow = app.get(ALLOWLIST)
    if allow is not None:
        try:
            await allow.check(url)
        except NotAllowed as exc:
            raise GatewayError(403, str(exc), param="url") from None


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


def _url_from(value: object) -> str:
    try:
        return validate_worker_url(value)
    except ValueError as exc:
        raise GatewayError(400, str(exc), param="url") from None


def _spec_from(value: object, kind: object) -> tuple[str, str | None, bool]:
    """(url, kind, kind given): ``value`` may end in ``#kind``; ``kind`` overrides it."""
    spec = value if isinstance(value, str) else ""
    if kind is not None:
        if not isinstance(kind, str):
            raise GatewayError(400, "'kind' must be a string", param="kind")
        spec = f"{spec.partition('#')[0]}#{kind}"
    try:
        url, parsed = parse_worker_spec(spec) if spec else (value, None)
    except ValueError as exc:
        raise GatewayError(400, str(exc), param="kind") from None
    return _url_from(url), parsed, "#" in spec


def _worker(request: web.Request) -> Worker:
    wid = request.match_info["worker_id"]
    worker = request.app[app_keys.REGISTRY].find(wid)
    if worker is None:
        raise GatewayError(404, f"no worker {wid!r}")
    return worker


def _role_from(pd_mode: bool, worker_type: object, port: object) -> tuple[str, int | None]:
    """sglang-router's ``worker_type`` (and a prefill's ``bootstrap_port``), checked
    against the gateway's mode: PD mode takes prefill and decode workers only."""
    role = REGULAR if worker_type is None else worker_type
    if role not in ROLES:
        raise GatewayError(
            400, f"'worker_type' must be one of {', '.join(ROLES)}", param="worker_type"
        )
    if pd_mode and role == REGULAR:
        raise GatewayError(
            400, "in PD mode a worker's worker_type is prefill or decode", param="worker_type"
        )
    if not pd_mode and role != REGULAR:
        raise GatewayError(
            400, f"a {role} worker needs PD mode (--pd-disaggregation)", param="worker_type"
        )
    if port is not None and (role != PREFILL or type(port) is not int or not 1 <= port <= 65535):
        raise GatewayError(
            400, "'bootstrap_port' is a prefill worker's port, 1..65535", param="bootstrap_port"
        )
    return str(role), port if isinstance(port, int) else None


async def _add(
    request: web.Request,
    raw_url: object,
    kind: object = None,
    worker_type: object = None,
    bootstrap_port: object = None,
) -> web.Response:
    url, parsed, given = _spec_from(raw_url, kind)
    app = request.app
    config = app[app_keys.CONFIG]
    role, port = _role_from(config.pd.enabled, worker_type, bootstrap_port)
    if not given:
        parsed = SGLANG if role != REGULAR else configured_kind(config.worker_kind)
    await _allowed(app, url)
    worker, created = app[app_keys.REGISTRY].add(url, parsed, role, port)
    if created:
        await app[app_keys.HEALTH].check_now(worker)
        membership = app.get(MEMBERSHIP)
        if membership is not None:
            membership.joined(worker, prewarm=True)
    return _json(worker.describe(time.monotonic()), 201 if created else 200)


async def post_workers(request: web.Request) -> web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise GatewayError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict) or "url" not in body:
        raise GatewayError(400, "expected a JSON object with a 'url'", param="url")
    return await _add(
        request, body["url"], body.get("kind"), body.get("worker_type"), body.get("bootstrap_port")
    )


def _described(app: web.Application, workers: list[Worker]) -> list[dict[str, Any]]:
    """Each worker as the registry describes it, with its routing mode and the reason
    (exact mode's, from the fleet snapshot)."""
    now = time.monotonic()
    modes = {w.worker: w for w in app[app_keys.TELEMETRY].snapshot().workers}
    out = []
    for w in workers:
        d = w.describe(now)
        for entry in [d, *(d["dp_ranks"] or ())]:  # a DP worker's mode is its ranks'
            snap = modes.get(entry["id"]) or modes.get(w.targets()[0].id)
            if snap is not None:
                entry["index_mode"] = snap.index_mode
                entry["index_mode_reason"] = snap.index_mode_reason
        out.append(d)
    return out


async def list_workers(request: web.Request) -> web.Response:
    registry = request.app[app_keys.REGISTRY]
    workers = _described(request.app, list(registry))
    return _json({"workers": workers, "total": len(workers)})


async def get_worker(request: web.Request) -> web.Response:
    return _json(_described(request.app, [_worker(request)])[0])


def _flag(request: web.Request, name: str, default: bool) -> bool:
    value = request.query.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise GatewayError(400, f"'{name}' must be true or false", param=name)


def _seconds(request: web.Request, name: str) -> float | None:
    value = request.query.get(name)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 86400:
        raise GatewayError(400, f"'{name}' must be seconds in (0, 86400)", param=name)
    return seconds


async def delete_worker(request: web.Request) -> web.Response:
    worker = _worker(request)
    doc: dict[str, Any] = {"removed": worker.id, "url": worker.url}
    membership = request.app.get(MEMBERSHIP)
    if _flag(request, "rehome", False) and membership is not None:
        membership.rehome_now(worker)
        doc["drain"] = membership.report(worker.id)
    request.app[app_keys.REGISTRY].remove(worker.id)
    return _json(doc)


async def drain_worker(request: web.Request) -> web.Response:
    worker = _worker(request)
    config = request.app[app_keys.CONFIG].drain
    rehome = _flag(request, "rehome", config.rehome)
    prewarm = _flag(request, "prewarm", config.prewarm)
    deadline = _seconds(request, "deadline_s")
    worker.flags.add(HealthFlag.DRAINING)
    doc = worker.describe(time.monotonic())
    membership = request.app.get(MEMBERSHIP)
    if membership is not None:
        membership.drain(worker, rehome=rehome, prewarm=prewarm, deadline_s=deadline)
        doc["drain"] = membership.report(worker.id)
    return _json(doc, 202)


async def get_drain(request: web.Request) -> web.Response:
    worker_id = request.match_info["worker_id"]
    worker = request.app[app_keys.REGISTRY].find(worker_id)
    membership = request.app.get(MEMBERSHIP)
    key = worker.id if worker is not None else worker_id
    report = None if membership is None else membership.report(key)
    if report is None:  # a removed worker's last drain stays readable by its id
        raise GatewayError(404, f"no drain of worker {worker_id!r}")
    return _json(report)


async def get_join(request: web.Request) -> web.Response:
    worker = _worker(request)
    membership = request.app.get(MEMBERSHIP)
    report = None if membership is None else membership.join_report(worker.id)
    if report is None:
        raise GatewayError(404, f"worker {worker.id!r} is neither ramping nor pre-warmed")
    return _json(report)


async def legacy_add(request: web.Request) -> web.Response:
    return await _add(request, request.query.get("url"))


async def legacy_remove(request: web.Request) -> web.Response:
    url = _url_from(request.query.get("url"))
    registry = request.app[app_keys.REGISTRY]
    worker = registry.find(url)
    if worker is None:
        raise GatewayError(404, f"no worker {url!r}")
    registry.remove(worker.id)
    return _json({"removed": worker.id, "url": worker.url})


async def legacy_list(request: web.Request) -> web.Response:
    return _json({"urls": [w.url for w in request.app[app_keys.REGISTRY]]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/workers", post_workers)
    app.router.add_get("/workers", list_workers)
    app.router.add_get("/workers/{worker_id}", get_worker)
    app.router.add_delete("/workers/{worker_id}", delete_worker)
    app.router.add_post("/workers/{worker_id}/drain", drain_worker)
    app.router.add_get("/workers/{worker_id}/drain", get_drain)
    app.router.add_get("/workers/{worker_id}/join", get_join)
    app.router.add_post("/add_worker", legacy_add)
    app.router.add_post("/remove_worker", legacy_remove)
    app.router.add_get("/list_workers", legacy_list)
