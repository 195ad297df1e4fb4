"""Typed application keys: how handlers reach the components the composition root built.

Contract: ``gateway.app`` sets every key (the configuration and registry when the app is
built, the rest in its ``cleanup_ctx`` at startup, once the client session exists);
handlers only read them. No module keeps component instances of its own.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.http.admission import Admission
from gateway.routing.decisions import DecisionLog
from gateway.routing.request import RequestSettings
from gateway.routing.router import Router
from gateway.tasks import TaskSet
from gateway.telemetry.hub import Telemetry
from gateway.workers.health import HealthChecker
from gateway.workers.registry import WorkerRegistry

CONFIG = web.AppKey("config", GatewayConfig)
REGISTRY = web.AppKey("registry", WorkerRegistry)
SETTINGS = web.AppKey("request_settings", RequestSettings)
ADMISSION = web.AppKey("admission", Admission)
DECISIONS = web.AppKey("decisions", DecisionLog)
TASKS = web.AppKey("tasks", TaskSet)
SESSION = web.AppKey("session", aiohttp.ClientSession)
HEALTH = web.AppKey("health", HealthChecker)
ROUTER = web.AppKey("router", Router)
TELEMETRY = web.AppKey("telemetry", Telemetry)
