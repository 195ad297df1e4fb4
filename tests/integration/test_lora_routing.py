"""LoRA adapters behind one gateway (issue 19): two simulated workers with different
adapters; a request naming an adapter (``model: "base:adapter"`` or ``lora_path``) reaches
the worker that has it loaded; one loaded nowhere is loaded first (``lora.unloaded: load``)
or refused with OpenAI's 404 (``reject``); ``/v1/models`` lists the adapters."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import ClientSession

from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import GatewayHandle, run_gateway
from simulator.fleet import SimConfig, SimulatedFleet

LORA = SimConfig(speed=50.0, enable_lora=True, max_loras_per_batch=4, lora_load_s=0.05)


def _chat(i: int, model: str = "sim-model", **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 3, **extra, "messages": [
        {"role": "system", "content": "You are a helpful tenant bot. " * 30},
        {"role": "user", "content": f"q{i}"}]}  # fmt: skip


async def _post(client: ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with client.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _sees(gw: GatewayHandle, adapters: dict[str, set[str]]) -> None:
    """Until the gateway's registry shows ``adapters`` (worker id → names) or 5 s."""
    for _ in range(100):
        have = {w.id: set(w.adapters) for w in gw.router.registry}
        if all(have.get(wid) == names for wid, names in adapters.items()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"gateway sees {have}, expected {adapters}")


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft", "round_robin"])
async def test_adapter_requests_reach_the_worker_holding_it(
    client: ClientSession, policy: str
) -> None:
    async with await SimulatedFleet.start(2, LORA) as fleet:
        one, two = fleet.urls
        for url, name in ((one, "alpha"), (two, "beta")):
            status, _ = await _post(
                client, url + "/load_lora_adapter", {"lora_name": name, "lora_path": f"/l/{name}"}
            )
            assert status == 200
        async with run_gateway(fleet.urls, policy__name=policy) as gw:
            await _sees(gw, {worker_id_for(one): {"alpha"}, worker_id_for(two): {"beta"}})
            holder = {"alpha": worker_id_for(one), "beta": worker_id_for(two)}
            for i in range(12):
                name = "alpha" if i % 3 else "beta"
                body = _chat(i, f"sim-model:{name}") if i % 2 else _chat(i, lora_path=name)
                status, answer = await _post(client, gw.url + "/v1/chat/completions", body)
                assert status == 200, answer
                assert gw.router.decisions.latest(1)[0].worker == holder[name]
            # no adapter: either worker, as before
            status, _ = await _post(client, gw.url + "/v1/chat/completions", _chat(99))
            assert status == 200
            async with client.get(gw.url + "/v1/models") as resp:
                cards = {m["id"]: m for m in (await resp.json())["data"]}
    assert cards["alpha"]["parent"] == "sim-model" and cards["alpha"]["root"] == "/l/alpha"
    assert cards["beta"]["parent"] == "sim-model"


async def test_unloaded_adapter_is_loaded_first_or_refused(client: ClientSession) -> None:
    async with await SimulatedFleet.start(2, LORA) as fleet:
        one, two = fleet.urls
        body = {"lora_name": "gamma", "lora_path": "/l/gamma"}
        assert (await _post(client, one + "/load_lora_adapter", body))[0] == 200
        async with run_gateway(fleet.urls, policy__name="round_robin") as load_gw:
            await _sees(load_gw, {worker_id_for(one): {"gamma"}})
            # unloaded everywhere: the gateway remembers its path and loads it where it routes
            unload = await _post(client, one + "/unload_lora_adapter", {"lora_name": "gamma"})
            assert unload[0] == 200
            await _sees(load_gw, {worker_id_for(one): set(), worker_id_for(two): set()})
            status, answer = await _post(
                client, load_gw.url + "/v1/chat/completions", _chat(1, "sim-model:gamma")
            )
            assert status == 200, answer
            chosen = load_gw.router.registry.get(load_gw.router.decisions.latest(1)[0].worker)
            assert chosen is not None and "gamma" in chosen.adapters
            # never seen anywhere: 404 naming it (SGLang itself would answer 400)
            status, answer = await _post(
                client, load_gw.url + "/v1/chat/completions", _chat(2, lora_path="nowhere")
            )
        assert status == 404 and answer["error"]["code"] == "model_not_found"
        assert "nowhere" in answer["error"]["message"]
        async with run_gateway(fleet.urls, lora__unloaded="reject") as reject_gw:
            await _sees(reject_gw, {w.id: set(w.adapters) for w in load_gw.router.registry})
            status, answer = await _post(
                client, reject_gw.url + "/v1/chat/completions", _chat(3, "sim-model:delta")
            )
    assert status == 404 and "delta" in answer["error"]["message"]


async def test_an_explicit_load_is_paid_once(client: ClientSession) -> None:
    """``/load_lora_adapter`` answers once the weights are in (``lora_load_s``): a request
    sent after it waits for no second load (it did: the load was charged twice)."""
    config = SimConfig(speed=10.0, enable_lora=True, lora_load_s=2.0)
    async with await SimulatedFleet.start(1, config) as fleet:
        url = fleet.urls[0]
        body = {"lora_name": "alpha", "lora_path": "/l/alpha"}
        assert (await _post(client, url + "/load_lora_adapter", body))[0] == 200
        generate = {"text": "hello there", "lora_path": "alpha",
                    "sampling_params": {"max_new_tokens": 1}}  # fmt: skip
        status, answer = await _post(client, url + "/generate", generate)
        assert status == 200, answer
        assert answer["meta_info"]["e2e_latency"] < 1.0  # modelled seconds; a load is 2.0
