"""PD mode end to end (issue 18): the OpenAI client streams through the gateway from a
simulated prefill + decode pair; repeated prefixes hit on the prefill side; a decode
worker killed mid-stream gives an error event and later requests go to the other one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from aiohttp import ClientSession
from openai.types.chat import ChatCompletionMessageParam

from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import GatewayHandle, run_gateway
from simulator.fleet import SimConfig, SimulatedFleet

SYSTEM = "You are a careful assistant for the disaggregated fleet. " * 40


@asynccontextmanager
async def _pd_fleet(
    prefills: int = 2, decodes: int = 2, **gateway: Any
) -> AsyncIterator[tuple[SimulatedFleet, SimulatedFleet, GatewayHandle]]:
    pconf = SimConfig(speed=20.0, disaggregation_mode="prefill", disaggregation_bootstrap_port=0)
    dconf = SimConfig(speed=20.0, disaggregation_mode="decode")
    async with (
        await SimulatedFleet.start(prefills, pconf) as pf,
        await SimulatedFleet.start(decodes, dconf) as df,
        run_gateway([], pd__enabled=True, pd__prefill=pf.urls, pd__decode=df.urls, **gateway) as gw,
    ):
        for _ in range(500):  # the first probes (and the bootstrap ports they learn)
            if gw.registry.healthy_count() == prefills + decodes:
                break
            await asyncio.sleep(0.01)
        yield pf, df, gw


def _messages(user: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


async def test_openai_client_streams_through_a_pd_pair_and_prefixes_hit_on_prefill() -> None:
    async with _pd_fleet(policy__name="min_ttft") as (pf, df, gw):
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        cached = []
        for turn in range(4):
            stream = await client.chat.completions.create(
                model="m",
                messages=_messages(f"question {turn}"),
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    usage = chunk.usage
            assert text and usage is not None and usage.completion_tokens == 6
            details = usage.prompt_tokens_details
            cached.append(details.cached_tokens if details and details.cached_tokens else 0)
            record = gw.router.decisions.latest(1)[0]
            assert record.worker in {worker_id_for(u) for u in pf.urls}
            assert record.decode is not None
            assert record.decode[0] in {worker_id_for(u) for u in df.urls}
            assert record.outcome is not None and record.outcome.status == 200
        await client.close()
        # the shared system prompt is computed once, then hit on the prefill that holds it
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
        prefill_ids = {r.worker for r in gw.router.decisions.latest(4)}
        assert len(prefill_ids) == 1
        async with ClientSession() as session, session.get(gw.url + "/workers") as resp:
            roles = {w["url"]: w["worker_type"] for w in (await resp.json())["workers"]}
        assert roles == {**dict.fromkeys(pf.urls, "prefill"), **dict.fromkeys(df.urls, "decode")}


async def test_non_streamed_generate_and_chat_through_the_pair(client: ClientSession) -> None:
    async with _pd_fleet(1, 1) as (_, _, gw):
        body = {"text": "hello " * 50, "sampling_params": {"max_new_tokens": 4}}
        async with client.post(gw.url + "/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            doc = await resp.json()
        assert doc["meta_info"]["completion_tokens"] == 4
        chat = {"model": "m", "messages": _messages("hi"), "max_tokens": 3}
        async with client.post(gw.url + "/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-gateway-prefill-worker"] != resp.headers["x-gateway-worker"]


async def test_a_decode_killed_mid_stream_gives_an_error_event_and_is_avoided(
    client: ClientSession,
) -> None:
    async with _pd_fleet(1, 2, policy__name="min_ttft") as (_, df, gw):
        chat = {"model": "m", "messages": _messages("long"), "max_tokens": 400, "stream": True}
        async with client.post(gw.url + "/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200
            decode_url = resp.headers["x-gateway-worker"]
            victim = df.urls.index(decode_url)
            first = await resp.content.readuntil(b"\n\n")
            assert first.startswith(b"data: ")
            await df.stop_worker(victim)
            rest = (await resp.content.read()).decode()
        assert '"error"' in rest and rest.rstrip().endswith("data: [DONE]"), rest[-300:]
        survivor = df.urls[1 - victim]
        for i in range(3):
            short = {"model": "m", "messages": _messages(f"after {i}"), "max_tokens": 2}
            async with client.post(gw.url + "/v1/chat/completions", json=short) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-gateway-worker"] == survivor


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_a_dead_side_before_the_first_byte_is_retried_on_a_new_pair(
    client: ClientSession, side: str
) -> None:
    async with _pd_fleet(2, 2) as (pf, df, gw):
        fleet = pf if side == "prefill" else df
        await fleet.stop_worker(0)  # the gateway has not noticed yet: still a candidate
        dead = worker_id_for(fleet.urls[0])
        for i in range(4):
            chat = {"model": "m", "messages": _messages(f"retry {i}"), "max_tokens": 2}
            async with client.post(gw.url + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200, await resp.text()
        records = gw.router.decisions.latest(8)

        def side_of(r: Any) -> str:
            return str(r.worker if side == "prefill" else (r.decode or ("",))[0])

        ok = [r for r in records if r.outcome is not None and r.outcome.status == 200]
        assert len(ok) == 4 and all(side_of(r) != dead for r in ok)
        failed = [r for r in records if r.outcome is not None and r.outcome.status != 200]
        assert failed and all(side_of(r) == dead for r in failed)
        assert all(r.outcome.retries == 1 for r in ok if r.outcome and r.outcome.retries)


async def test_a_request_the_prefill_refuses_is_answered_with_its_error(
    client: ClientSession,
) -> None:
    async with _pd_fleet(1, 1) as (_, _, gw):
        bad = {"model": "m", "messages": _messages("x"), "max_tokens": 10**7}  # > context
        async with client.post(gw.url + "/v1/chat/completions", json=bad) as resp:
            assert resp.status == 400, await resp.text()
            body = await resp.json()
        assert "error" in body or body.get("object") == "error", body
        record = gw.router.decisions.latest(1)[0]
        assert record.outcome is not None and record.outcome.status == 400
        # nothing is left counted on either side
        assert all(w.in_flight == 0 for w in gw.registry.targets())
