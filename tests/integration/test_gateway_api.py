"""The inference API through the gateway: three APIs, streaming and not, the openai client,
request ids, unknown fields, models and readiness."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp import ClientSession

from loadtests.harness.inprocess import run_gateway, sim_stats

pytest.importorskip("simulator.fleet")  # lands with the simulated worker
from simulator.fleet import SimulatedFleet

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "Hello there"}],
    "max_tokens": 8,
}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "m", "prompt": "Once upon a time", "max_tokens": 8},
    "/generate": {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8}},
}


def _events(raw: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


@pytest.mark.parametrize("path", list(BODIES))
async def test_non_streaming(fleet: SimulatedFleet, client: ClientSession, path: str) -> None:
    async with run_gateway(fleet.urls) as gw:
        for _ in range(3):
            async with client.post(gw.url + path, json=BODIES[path]) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
                assert resp.headers["x-gateway-worker"] in fleet.urls
                assert int(resp.headers["x-gateway-matched-tokens"]) >= 0
                assert len(resp.headers["x-request-id"]) >= 16
        assert ("choices" in body) or ("text" in body)
        assert all(w.in_flight == 0 for w in gw.registry)


@pytest.mark.parametrize("path", list(BODIES))
async def test_streaming(fleet: SimulatedFleet, client: ClientSession, path: str) -> None:
    async with run_gateway(fleet.urls) as gw:
        body = {**BODIES[path], "stream": True}
        async with client.post(gw.url + path, json=body) as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = await resp.read()
        events = _events(raw)
        assert events[-1] == b"[DONE]"
        assert raw.count(b"[DONE]") == 1
        assert len(events) >= 3
        for event in events[:-1]:
            assert b"error" not in orjson.loads(event)
        record = gw.router.decisions.latest(1)[0]
        assert record.outcome is not None and record.outcome.ttft_s is not None
        assert all(w.in_flight == 0 and w.decoding_requests == 0 for w in gw.registry)


async def test_embeddings(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with (
        run_gateway(fleet.urls) as gw,
        client.post(gw.url + "/v1/embeddings", json={"model": "m", "input": "hello"}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["data"][0]["embedding"]


async def test_openai_client(fleet: SimulatedFleet) -> None:
    import openai

    async with run_gateway(fleet.urls) as gw:
        oai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        try:
            chat = await oai.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6
            )
            assert chat.choices[0].message.content
            stream = await oai.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            assert text
            assert parts[-1].usage is not None
            comp = await oai.completions.create(model="m", prompt="abc", max_tokens=5)
            assert comp.choices[0].text
            comp_stream = await oai.completions.create(
                model="m", prompt="abc", max_tokens=5, stream=True
            )
            assert "".join([c.choices[0].text async for c in comp_stream if c.choices])
            models = await oai.models.list()
            assert [m.id for m in models.data]
        finally:
            await oai.close()


async def test_unknown_fields_and_request_id_reach_worker(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls[:1]) as gw:
        body = {
            **CHAT,
            "my_extension": {"nested": [1, 2.5, "x"]},
            "top_k": 3,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        async with client.post(
            gw.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "req-abc-123"}
        ) as resp:
            assert resp.status == 200
            assert resp.headers["x-request-id"] == "req-abc-123"
        seen = (await sim_stats(client, fleet.urls[0]))["last_request_body"]
        assert seen["my_extension"] == {"nested": [1, 2.5, "x"]}
        assert seen["chat_template_kwargs"] == {"enable_thinking": False}
        # the worker's rid is the gateway's own, not the client's request id (issue 16)
        assert seen["rid"] != "req-abc-123" and len(seen["rid"]) == 32
        assert {k: v for k, v in seen.items() if k != "rid"} == body
        # sglang-router's other request-id headers are honoured too
        async with client.post(
            gw.url + "/v1/chat/completions", json=CHAT, headers={"x-correlation-id": "corr-9"}
        ) as resp:
            assert resp.headers["x-request-id"] == "corr-9"
        assert (await sim_stats(client, fleet.urls[0]))["last_request_body"]["rid"] != "corr-9"


async def test_models_aggregated_and_deduplicated(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls) as gw:
        async with client.get(gw.url + "/v1/models") as resp:
            assert resp.status == 200
            data = (await resp.json())["data"]
        ids = [card["id"] for card in data]
        assert ids and len(ids) == len(set(ids))
        assert set(ids) == {w.model for w in fleet.workers}


async def test_health_and_readiness(fleet: SimulatedFleet, client: ClientSession) -> None:
    async with run_gateway(fleet.urls) as gw:
        for path in ("/health", "/readiness"):
            async with client.get(gw.url + path) as resp:
                assert resp.status == 200
    async with run_gateway([]) as gw:
        for path in ("/health", "/readiness"):
            async with client.get(gw.url + path) as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"]
        async with client.get(gw.url + "/liveness") as resp:  # alive without workers
            assert resp.status == 200
            assert await resp.json() == {"status": "ok"}


async def test_expect_continue_from_the_client(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with run_gateway(fleet.urls[:1]) as gw:
        body = {**CHAT, "messages": [{"role": "user", "content": "long " * 400}]}
        async with client.post(gw.url + "/v1/chat/completions", json=body, expect100=True) as resp:
            assert resp.status == 200, await resp.text()
        seen = await sim_stats(client, fleet.urls[0])
        assert "expect" not in {k.lower() for k in seen.get("last_request_headers", {})}


async def test_form_content_type_still_reaches_worker_as_json(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    import json

    form = {"Content-Type": "application/x-www-form-urlencoded"}  # what `curl -d` sends
    async with (
        run_gateway(fleet.urls[:1]) as gw,
        client.post(gw.url + "/v1/chat/completions", data=json.dumps(CHAT), headers=form) as resp,
    ):
        assert resp.status == 200, await resp.text()
