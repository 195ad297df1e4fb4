"""Several models behind one gateway (issue 19's first part): requests go only to workers
serving their model, an unknown model gets OpenAI's 404 ``model_not_found``, /v1/models
lists the union; a single-model fleet accepts any model string as before."""

from __future__ import annotations

import pytest
from aiohttp import ClientSession

from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import run_gateway
from simulator.fleet import SimConfig, SimulatedFleet


def _chat(model: str, i: int) -> dict[str, object]:
    system = f"You serve {model}. " * 40
    return {"model": model, "max_tokens": 3, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]}  # fmt: skip


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft", "round_robin"])
async def test_each_request_reaches_a_worker_of_its_model(
    client: ClientSession, policy: str
) -> None:
    async with (
        await SimulatedFleet.start(2, SimConfig(speed=50.0, served_model_name="llama")) as llama,
        await SimulatedFleet.start(2, SimConfig(speed=50.0, served_model_name="qwen")) as qwen,
        run_gateway([*llama.urls, *qwen.urls], policy__name=policy) as gw,
    ):
        serving = {"llama": {worker_id_for(u) for u in llama.urls},
                   "qwen": {worker_id_for(u) for u in qwen.urls}}  # fmt: skip
        for i in range(16):
            model = "llama" if i % 3 else "qwen"
            async with client.post(gw.url + "/v1/chat/completions", json=_chat(model, i)) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["model"] == model
            assert gw.router.decisions.latest(1)[0].worker in serving[model]
        async with client.post(gw.url + "/v1/chat/completions", json=_chat("gpt-9", 0)) as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
        async with client.get(gw.url + "/v1/models") as resp:
            listed = {m["id"] for m in (await resp.json())["data"]}
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-9" in error["message"]
    assert {"llama", "qwen"} <= listed


async def test_a_single_model_fleet_takes_any_model_string(
    fleet: SimulatedFleet, client: ClientSession
) -> None:
    async with (
        run_gateway(fleet.urls, policy__name="cache_aware") as gw,
        client.post(gw.url + "/v1/chat/completions", json=_chat("whatever", 1)) as resp,
    ):
        assert resp.status == 200
