"""Red-team findings on the surfaces added after the data plane's hardening: run-time
policy changes (``PUT /admin/policy``), shadows and A/B arms, the characters-per-token
learnt from workers, the replay trace, and the gateway-owned rid.

Each test is a confirmed problem's reproduction; those whose fix lives in
``gateway/routing/`` fail until that fix is applied (see each test's docstring).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import orjson
import pytest
from aiohttp import ClientSession, ClientTimeout
from scripted_worker import Exchange, ScriptedWorker, StartWorker, http_response, replies

from gateway.config import ConfigError
from gateway.http.tuning import TUNING, rehearse
from gateway.routing.policy_set import PolicySet
from gateway.telemetry.tuning import MAX_TRACE_IDS
from loadtests.harness.inprocess import GatewayHandle, run_gateway
from policies.base import Decision, Policy, RouteContext
from policies.registry import create_policy
from policies.round_robin import RoundRobinPolicy

API = "/v1/chat/completions"
ADMIN = {"Authorization": "Bearer admin-key"}
CLIENT = {"Authorization": "Bearer client-key"}
OK = http_response(b'{"ok":1}')
ROLE_OVERHEAD = len("user") + 3  # the canonical prompt: role, 3 separators, content


def chat(content: str = "hello there, " * 8, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


@asynccontextmanager
async def gateway(workers: list[ScriptedWorker], **overrides: Any) -> AsyncIterator[GatewayHandle]:
    async with run_gateway(
        [w.url for w in workers],
        worker_kind="sglang",
        server__admin_api_key="admin-key",
        server__api_keys=["client-key"],
        **overrides,
    ) as gw:
        yield gw


async def post(
    gw: GatewayHandle, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    async with (
        ClientSession(timeout=ClientTimeout(total=10)) as client,
        client.post(gw.url + API, json=body, headers={**CLIENT, **(headers or {})}) as resp,
    ):
        return resp.status, await resp.read()


async def put_policy(gw: GatewayHandle, change: dict[str, Any]) -> tuple[int, bytes]:
    async with (
        ClientSession(timeout=ClientTimeout(total=10)) as client,
        client.put(gw.url + "/admin/policy", data=orjson.dumps(change), headers=ADMIN) as resp,
    ):
        return resp.status, await resp.read()


def usage_answer(tokens: Callable[[int], int]) -> Any:
    """A worker reporting ``usage.prompt_tokens = tokens(canonical prompt characters)``."""

    async def answer(exchange: Exchange, writer: asyncio.StreamWriter, n: int) -> bool:
        content = orjson.loads(exchange.body)["messages"][0]["content"]
        chars = len(content.encode()) + ROLE_OVERHEAD
        body = orjson.dumps({"ok": n, "usage": {"prompt_tokens": tokens(chars)}})
        writer.write(http_response(body))
        await writer.drain()
        return True

    return answer


# --- PUT /admin/policy: a change that parses but cannot decide ---------------------------

# Each was accepted by the constructors' checks, then raised inside ``select`` on the first
# request with two candidates (TypeError from range(1.5), OverflowError from ceil(inf),
# ValueError from max([]) once NaN scores empty the band): every live request was a 500.
# Now the constructors refuse them, and a set that still fails a rehearsal of a few
# decisions is refused too (``gateway.http.tuning.rehearse``, tested below).
UNDECIDABLE = {
    "live: float virtual_nodes": {"name": "consistent_hash", "params": {"virtual_nodes": 1.5}},
    "shadow: float virtual_nodes": {"shadows": ["consistent_hash:virtual_nodes=1.5"]},
    "shadow: infinite load_factor": {"shadows": ["min_ttft:load_factor=.inf"]},
    "shadow: NaN work_weight": {"shadows": ["min_ttft:work_weight=.nan"]},
    "arm B: infinite load_factor": {"ab_policy": "consistent_hash:load_factor=.inf",
                                    "ab_fraction": 1.0},
}  # fmt: skip


@pytest.mark.parametrize("change", list(UNDECIDABLE.values()), ids=list(UNDECIDABLE))
async def test_a_policy_change_that_cannot_decide_is_refused(
    scripted: StartWorker, change: dict[str, Any]
) -> None:
    """Fixed in ``gateway.http.tuning.PolicyControl.apply``: the new set rehearses a few
    decisions before it is swapped in; a policy that raises is a 400, the running set
    stays and keeps routing."""
    workers = [await scripted(replies(OK)), await scripted(replies(OK))]
    async with gateway(workers) as gw:
        status, body = await put_policy(gw, change)
        assert status == 400, body
        assert b"policy." in body  # the key is named
        running = gw.router.core.policies
        assert running.live.name == "round_robin" and not running.shadows and running.ab is None
        for headers in ({"x-session-id": "s1"}, {}):
            assert await post(gw, chat(), headers) == (200, b'{"ok":1}')


class _RaisingShadow(Policy):
    """A shadow whose ``select`` fails, as any policy bug (or bad parameter) would."""

    name: ClassVar[str] = "raising"

    def select(self, ctx: RouteContext) -> Decision:
        raise ZeroDivisionError("shadow bug")


async def test_a_failing_shadow_never_breaks_live_routing(scripted: StartWorker) -> None:
    """Fails until ``gateway.routing.decide.RoutingCore._shadows`` isolates each shadow:
    ``select`` of a shadow in ``try/except Exception``, a failed shadow logged (rate
    limited) and left out of ``choice.shadows``; the request is routed by the live pick.
    The docs promise shadows 'never route'; one that raises answered every request 500."""
    workers = [await scripted(replies(OK)), await scripted(replies(OK))]
    async with gateway(workers) as gw:
        gw.router.core.configure(PolicySet(RoundRobinPolicy(), (_RaisingShadow(),)))
        assert await post(gw, chat()) == (200, b'{"ok":1}')


# --- characters per token: one worker's word for the whole fleet -------------------------


async def test_one_worker_cannot_set_the_fleet_wide_chars_per_token(
    scripted: StartWorker,
) -> None:
    """Fails until ``gateway.routing.tokens.TokenAccounting`` stops pooling every
    worker's raw counts into the per-model estimate: ``chars_per_token(model)`` should be
    the median of the per-worker estimates of the workers that answered that model (one
    worker of three then cannot move it). Today a ratio of sums is dominated by whoever
    reports the most tokens: one worker claiming 9 tokens per character (inside the
    accepted [0.1, 64]) drags every client's prompt estimate to ~20x its size, and with
    it leases' queued tokens and min_ttft's TTFT estimates on every worker."""
    honest = usage_answer(lambda chars: max(1, chars // 4))
    workers = [await scripted(honest), await scripted(honest)]
    workers.append(await scripted(usage_answer(lambda chars: chars * 9)))
    async with gateway(workers) as gw:
        for i in range(30):
            status, _ = await post(gw, chat(f"conversation {i}: " + "some ordinary text " * 40))
            assert status == 200
        tokens = gw.router.core.tokens
        assert tokens is not None
        assert 3.0 <= tokens.chars_per_token("m") <= 5.5, tokens.describe()


# --- the replay trace: what a worker's count makes the gateway keep ----------------------


async def test_trace_entries_stay_small_whatever_a_worker_reports(scripted: StartWorker) -> None:
    """Fixed in ``gateway.telemetry.tuning.TraceLog.add``: the ids kept per entry are
    capped (``MAX_TRACE_IDS``). The step between kept block hashes came from the worker's
    ``prompt_tokens``: a worker claiming huge counts made every entry keep every 64-char
    block hash (~40 bytes held per 64 prompt bytes, for 20,000 entries)."""
    worker = await scripted(usage_answer(lambda chars: chars * 9))
    prompt = "x" * 500_000
    async with gateway([worker]) as gw:
        assert (await post(gw, chat(prompt)))[0] == 200
        entries = gw.app[TUNING].trace.since(0)
    assert len(entries) == 1
    assert len(entries[0].hash_ids) <= MAX_TRACE_IDS  # honest (4 chars/token): ~62


# --- the gateway-owned rid: batches -------------------------------------------------------


async def test_a_batch_never_carries_the_clients_request_id_upstream(
    scripted: StartWorker,
) -> None:
    """Fails until ``gateway.routing.router.Router._send`` sends a gateway id in the
    upstream ``x-request-id`` for batches too: ``relay.upstream_headers(request.headers,
    rid or new_rid(), ...)`` instead of ``rid or call.request_id`` (docs/SECURITY.md:
    'The worker's rid and x-request-id are the gateway's own 128 random bits, never the
    client's'). A batch has no gateway rid, so the client's x-request-id went upstream."""
    worker = await scripted(replies(OK))
    body = {"model": "m", "prompt": ["first prompt", "second prompt"], "max_tokens": 1}
    async with (
        gateway([worker]) as gw,
        ClientSession(timeout=ClientTimeout(total=10)) as client,
        client.post(
            gw.url + "/v1/completions",
            json=body,
            headers={**CLIENT, "x-request-id": "victim-request-0001"},
        ) as resp,
    ):
        assert resp.status == 200
    upstream = worker.inference[0].header("x-request-id")
    assert upstream is not None and upstream != "victim-request-0001"


class _Broken(Policy):
    """Accepted by every check a constructor can make, broken in ``select``."""

    name: ClassVar[str] = "broken"

    def select(self, ctx: RouteContext) -> Decision:
        raise ZeroDivisionError("a policy bug")


class _Stray(Policy):
    name: ClassVar[str] = "stray"

    def select(self, ctx: RouteContext) -> Decision:
        return Decision("a worker it was not offered", "load")


@pytest.mark.parametrize("bad", [_Broken(), _Stray()])
def test_a_set_that_fails_a_rehearsal_is_refused(bad: Policy) -> None:
    for policies in (PolicySet(bad), PolicySet(create_policy("round_robin"), (bad,)),
                     PolicySet(create_policy("round_robin"), ab=bad, ab_fraction=0.5)):  # fmt: skip
        with pytest.raises(ConfigError, match="test decision"):
            rehearse(policies)
    rehearse(PolicySet(create_policy("min_ttft"), (create_policy("cache_aware"),)))
