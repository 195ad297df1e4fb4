"""Red-team findings on LoRA adapters (issue 19): hostile clients naming adapters, hostile
workers reporting them, and the ``POST /load_lora_adapter`` calls the gateway makes.

Each test is a confirmed problem's reproduction against the first LoRA commit (96bd759):
- a worker's reported path was loaded on every other worker (the last report won, so a
  worker could re-point a name others hold at a path of its own);
- an adapter seen on one model's workers was loaded onto another model's;
- N concurrent requests for an unloaded adapter made N load calls (on several workers);
- loads were unbounded in rate (each may evict an adapter others use);
- a load's answer was read whole, and a 200 without the adapter counted as loaded;
- what workers report (cards, ``loaded_adapters``) was kept unbounded;
- ``split_model`` depended on the iteration order of a set.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import ClientSession, ClientTimeout, web

from gateway.config import LoraConfig
from gateway.errors import GatewayError
from gateway.routing.lora import AdapterLoads, lora_candidates
from gateway.routing.request import split_model
from gateway.workers.registry import (
    MAX_ADAPTER_NAME,
    MAX_WORKER_ADAPTERS,
    WorkerMetadata,
    WorkerRegistry,
)
from loadtests.harness.inprocess import GatewayHandle, run_gateway

API = "/v1/chat/completions"
LoadAnswer = Callable[["LoraWorker", dict[str, Any]], Awaitable[web.StreamResponse]]


@dataclass
class LoraWorker:
    """A LoRA-enabled SGLang look-alike: ``cards`` (name → path) are its /v1/models
    adapters; every load body is recorded; ``load_answer`` decides how it answers."""

    model: str = "m"
    cards: dict[str, Any] = field(default_factory=dict)
    extra_cards: list[Any] = field(default_factory=list)
    loads: list[dict[str, Any]] = field(default_factory=list)
    served: int = 0
    load_answer: LoadAnswer | None = None
    url: str = ""

    async def _info(self, _: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"served_model_name": self.model, "enable_lora": True, "page_size": 1}
        )

    async def _models(self, _: web.Request) -> web.StreamResponse:
        data = [{"id": self.model, "object": "model", "root": self.model, "parent": None}]
        data += [{"id": n, "root": p, "parent": self.model} for n, p in self.cards.items()]
        return web.json_response({"object": "list", "data": data + self.extra_cards})

    async def _load(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.loads.append(body)
        if self.load_answer is not None:
            return await self.load_answer(self, body)
        await asyncio.sleep(0.2)  # a load takes a while: concurrent requests overlap it
        self.cards[body["lora_name"]] = body["lora_path"]
        return web.json_response(
            {"success": True, "error_message": None, "loaded_adapters": dict(self.cards)}
        )

    async def _chat(self, _: web.Request) -> web.StreamResponse:
        self.served += 1
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    async def _ok(self, _: web.Request) -> web.StreamResponse:
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/server_info", self._info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/load_lora_adapter", self._load)
        app.router.add_post(API, self._chat)
        app.router.add_post("/abort_request", self._ok)
        app.router.add_get("/{tail:.*}", self._ok)
        return app


@asynccontextmanager
async def serving(*workers: LoraWorker) -> AsyncIterator[None]:
    runners = []
    try:
        for worker in workers:
            runner = web.AppRunner(worker.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            worker.url = f"http://127.0.0.1:{port}"
            runners.append(runner)
        yield
    finally:
        for runner in runners:
            await runner.cleanup()


@asynccontextmanager
async def gateway(*workers: LoraWorker, **overrides: Any) -> AsyncIterator[GatewayHandle]:
    async with (
        serving(*workers),
        run_gateway([w.url for w in workers], worker_kind="sglang", **overrides) as gw,
    ):
        await sees(gw, {w.url: set(w.cards) for w in workers})
        yield gw


async def sees(gw: GatewayHandle, adapters: dict[str, set[str]]) -> None:
    """Until the gateway's registry shows ``adapters`` (worker URL → names), 5 s at most."""
    have: dict[str, set[str]] = {}
    for _ in range(100):
        have = {w.url: set(w.adapters) for w in gw.router.registry if w.metadata.lora_enabled}
        if have == adapters:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"gateway sees {have}, expected {adapters}")


def chat(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]} | (
        extra
    )


async def post(gw: GatewayHandle, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
    async with (
        ClientSession(timeout=ClientTimeout(total=20)) as client,
        client.post(gw.url + API, json=body) as resp,
    ):
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


# --- a hostile worker's paths ----------------------------------------------------------


async def test_a_worker_cannot_repoint_an_adapter_others_hold() -> None:
    """Before: the last reported path won, so a hostile worker listing ``alpha`` with its
    own ``root`` made the gateway load that path, under ``alpha``'s name, on honest
    workers once no worker held it. Now the disagreement makes the name unloadable from
    workers' reports (404 saying so), and the operator's ``lora.paths`` settles it."""
    honest = LoraWorker(cards={"alpha": "/loras/alpha"})
    hostile = LoraWorker(cards={"alpha": "hf://attacker/evil-weights"})
    spare = LoraWorker()
    async with gateway(honest, hostile, spare) as gw:
        honest.cards.clear()
        hostile.cards.clear()
        await sees(gw, {honest.url: set(), hostile.url: set(), spare.url: set()})
        status, answer, _ = await post(gw, chat("m:alpha"))
        assert status == 404, answer
        assert "disagree" in answer["error"]["message"]
        assert not honest.loads + hostile.loads + spare.loads
    honest.cards["alpha"] = "/loras/alpha"
    hostile.cards["alpha"] = "hf://attacker/evil-weights"
    paths = ["alpha=/loras/alpha"]
    async with gateway(honest, hostile, spare, lora__paths=paths) as gw:
        honest.cards.clear()
        hostile.cards.clear()
        await sees(gw, {honest.url: set(), hostile.url: set(), spare.url: set()})
        for _ in range(3):
            status, answer, _ = await post(gw, chat("m:alpha"))
            assert status == 200, answer
    sent = {body["lora_path"] for w in (honest, hostile, spare) for body in w.loads}
    assert sent == {"/loras/alpha"}


async def test_worker_paths_can_be_refused() -> None:
    """``lora.paths_from_workers: false``: a path only a worker named is never loaded."""
    seen = LoraWorker(cards={"beta": "/anything/a/worker/said"})
    other = LoraWorker()
    async with gateway(seen, other, lora__paths_from_workers=False) as gw:
        seen.cards.clear()
        await sees(gw, {seen.url: set(), other.url: set()})
        status, answer, _ = await post(gw, chat(lora_path="beta"))
    assert status == 404 and "configured path" in answer["error"]["message"]
    assert not seen.loads + other.loads


async def test_an_adapter_is_loaded_only_on_its_base_models_workers() -> None:
    """Before: ``mx:alpha`` with ``alpha`` seen only on model ``my``'s workers loaded
    ``my``'s adapter onto an ``mx`` worker. Now: 404, no load."""
    mx = LoraWorker(model="mx")
    my = LoraWorker(model="my", cards={"alpha": "/loras/my-alpha"})
    async with gateway(mx, my) as gw:
        status, answer, _ = await post(gw, chat("mx:alpha"))
        assert status == 404 and answer["error"]["code"] == "model_not_found", answer
        assert not mx.loads
        status, answer, _ = await post(gw, chat("my:alpha"))  # its own model: served
        assert status == 200 and my.served == 1, answer


# --- concurrent and churning loads -------------------------------------------------------


async def test_concurrent_requests_for_one_adapter_make_one_load() -> None:
    """Before: each of N concurrent requests loaded the adapter (round robin: on both
    workers). Now: one load; the others wait for it on the same worker."""
    one, two = LoraWorker(), LoraWorker()
    async with gateway(one, two, lora__paths=["gamma=/loras/gamma"]) as gw:
        answers = await asyncio.gather(*(post(gw, chat("m:gamma")) for _ in range(12)))
    assert [a[0] for a in answers] == [200] * 12
    assert len(one.loads) + len(two.loads) == 1
    assert one.served + two.served == 12 and 0 in (one.served, two.served)


async def test_loads_are_rate_bounded() -> None:
    """Before: a client cycling adapter names made one load call per request (each may
    evict an adapter other clients use). Now: beyond ``lora.load_burst`` at
    ``lora.load_rate_per_s``, a 503 with Retry-After and no load call."""
    paths = [f"a{i}=/loras/a{i}" for i in range(6)]
    worker = LoraWorker()
    async with gateway(
        worker, lora__paths=paths, lora__load_rate_per_s=0.01, lora__load_burst=2
    ) as gw:
        worker.loads.clear()
        results = [await post(gw, chat(f"m:a{i}")) for i in range(2, 6)]
        async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/metrics") as resp:
            metrics = await resp.text()
    assert [r[0] for r in results] == [200, 200, 503, 503]
    # counted as the 503s the client got (the metrics said 404 before)
    limited_lines = [m for m in metrics.splitlines() if m.startswith("gateway_requests_total")]
    assert any('status="503"' in m and m.endswith(" 2.0") for m in limited_lines), limited_lines
    assert not any('status="404"' in m for m in limited_lines)
    limited = results[2]
    assert limited[1]["error"]["code"] == "lora_load_rate_limited"
    assert "Retry-After" in limited[2]
    assert len(worker.loads) == 2


# --- a hostile worker's load answers -------------------------------------------------------


async def _huge(worker: LoraWorker, body: dict[str, Any]) -> web.StreamResponse:
    return web.Response(body=b'{"success": true, "pad": "' + b"x" * (4 << 20) + b'"}')


async def _claims(worker: LoraWorker, body: dict[str, Any]) -> web.StreamResponse:
    return web.json_response({"success": True, "error_message": None, "loaded_adapters": {}})


async def _says_failed(worker: LoraWorker, body: dict[str, Any]) -> web.StreamResponse:
    return web.json_response({"success": False, "error_message": "no", "loaded_adapters": {}})


@pytest.mark.parametrize("answer", [_huge, _claims, _says_failed])
async def test_a_bad_load_answer_is_a_failed_load(answer: LoadAnswer) -> None:
    """A load answered with 4 MiB (read whole before), a 200 whose loaded_adapters lacks
    the adapter (counted as loaded before: requests then went to a worker without it), or
    ``success: false``: the load failed, the client gets a JSON 502, the worker is not
    taken to hold the adapter."""
    worker = LoraWorker(load_answer=answer)
    async with gateway(worker, lora__paths=["delta=/loras/delta"]) as gw:
        status, body, _ = await post(gw, chat("m:delta"))
        assert status == 502 and "load_lora_adapter" in body["error"]["message"], body
        held = [w.adapters for w in gw.router.registry]
    assert held == [{}] and worker.served == 0


async def _floods(worker: LoraWorker, body: dict[str, Any]) -> web.StreamResponse:
    loaded = {f"n{i}": f"/p/{i}" for i in range(5000)} | {body["lora_name"]: body["lora_path"]}
    return web.json_response({"success": True, "loaded_adapters": loaded})


async def test_reported_adapters_are_bounded() -> None:
    """/v1/models with thousands of cards, huge or control-character ids and paths,
    malformed cards; a load answer listing 5,000 adapters: what the gateway keeps is
    bounded, the rest dropped, and it keeps serving."""
    cards: list[Any] = [
        {"id": "x" * 100_000, "root": "/r", "parent": "m"},
        {"id": "bad\nname", "root": "/r", "parent": "m"},
        {"id": "longpath", "root": "/" + "p" * 100_000, "parent": "m"},
        {"id": 7, "parent": "m"},
        {"id": "noroot", "root": ["/r"], "parent": {"nested": True}},
        "not a card",
        None,
    ]
    cards += [{"id": f"c{i}", "root": f"/r/{i}", "parent": "m"} for i in range(3000)]
    flood = LoraWorker(extra_cards=cards)
    async with serving(flood), run_gateway([flood.url], worker_kind="sglang") as gw:
        for _ in range(100):
            kept = next(iter(gw.router.registry)).adapters
            if kept:
                break
            await asyncio.sleep(0.05)
        assert len(kept) == MAX_WORKER_ADAPTERS
        assert all(len(n) <= MAX_ADAPTER_NAME and "\n" not in n for n in kept)
        status, _, _ = await post(gw, chat("m:c1"))
        assert status == 200
    registry = WorkerRegistry(panic_threshold=0.5)
    worker, _ = registry.add("http://127.0.0.1:9", "sglang")
    registry.set_adapters(worker, {f"n{i}": f"/p/{i}" for i in range(5000)})
    assert len(worker.adapters) == MAX_WORKER_ADAPTERS


async def test_a_flooding_load_answer_is_bounded() -> None:
    worker = LoraWorker(load_answer=_floods)
    async with gateway(worker, lora__paths=["eps=/loras/eps"]) as gw:
        status, _, _ = await post(gw, chat("m:eps"))
        kept = next(iter(gw.router.registry)).adapters
    # the adapter asked for is last in the worker's list, beyond the bound: not kept, so
    # the load counts as failed rather than sending requests to a worker without it
    assert status == 502 and len(kept) <= MAX_WORKER_ADAPTERS


# --- hostile clients' adapter names ----------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"model": "m:" + "a" * 200_000},
        {"model": "m:a:b:c"},
        {"model": "m:\u0000\n\u202e"},
        {"lora_path": "z" * 100_000},
        {"lora_path": ["", None, "ghost"]},
    ],
)
async def test_odd_adapter_names_get_a_short_404(extra: dict[str, Any]) -> None:
    worker = LoraWorker(cards={"alpha": "/loras/alpha"})
    async with gateway(worker) as gw:
        status, body, _ = await post(gw, chat() | extra)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert len(body["error"]["message"]) < 300
    assert not worker.loads


@pytest.mark.parametrize("value", [5, True, {"a": 1}, [1], [{"x": 1}], 1.5])
async def test_lora_path_of_another_type_is_a_400(value: Any) -> None:
    worker = LoraWorker(cards={"alpha": "/loras/alpha"})
    async with gateway(worker) as gw:
        status, body, _ = await post(gw, chat(lora_path=value))
    assert status == 400 and body["error"]["param"] == "lora_path", body


def test_split_model_is_independent_of_set_order() -> None:
    """Before: with served names ``a`` and ``a:b``, ``a:b:c`` split at either, by the
    set's iteration order. Now: after the longest served name."""
    for served in (["a", "a:b"], ["a:b", "a"]):
        assert split_model("a:b:c", dict.fromkeys(served)) == ("a:b", "c")


def test_conflicts_stay_until_the_operator_names_a_path() -> None:
    registry = WorkerRegistry(panic_threshold=0.5, clock=lambda: 0.0)
    honest, _ = registry.add("http://127.0.0.1:1", "sglang")
    hostile, _ = registry.add("http://127.0.0.1:2", "sglang")
    spare, _ = registry.add("http://127.0.0.1:3", "sglang")
    for w in (honest, hostile, spare):
        w.metadata = WorkerMetadata(model="m", models=frozenset({"m"}), lora_enabled=True)
        w.flags.clear()
    registry.set_adapters(honest, {"alpha": "/good"})
    registry.set_adapters(hostile, {"alpha": "/evil"})
    registry.set_adapters(honest, {})
    registry.set_adapters(hostile, {})
    registry.set_adapters(hostile, {"alpha": "/evil"})  # alone now: still not trusted
    registry.set_adapters(hostile, {})
    with pytest.raises(GatewayError) as caught:
        lora_candidates([spare], "alpha", LoraConfig(), registry, AdapterLoads())
    assert caught.value.status == 404
    chosen, path, _ = lora_candidates(
        [spare], "alpha", LoraConfig(paths=("alpha=/good",)), registry, AdapterLoads()
    )
    assert chosen == [spare] and path == "/good"
