"""Per-model settings behind a live gateway (issue 19): two models routed each by its own
policy (the decision records name it), a third by the top-level one, live tuning that
leaves the per-model sets alone, per-model timeouts (the 504 of a slow worker for one
model while another model's equally slow worker answers), and the ``model`` label."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

from aiohttp import ClientSession

from gateway.workers.registry import worker_id_for
from loadtests.harness.inprocess import run_gateway, sim_faults
from simulator.fleet import SimConfig, SimulatedFleet

CHROMIUM = "/usr/bin/chromium"
HAS_CHROMIUM = Path(CHROMIUM).exists()  # Debian's package (make browser-deps)


def _chat(model: str, i: int) -> dict[str, Any]:
    system = f"You serve {model}, conversation {i % 3}. " * 30
    return {"model": model, "max_tokens": 3, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]}  # fmt: skip


async def _post(client: ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with client.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


async def _decisions(client: ClientSession, url: str) -> list[dict[str, Any]]:
    async with client.get(url + "/debug/decisions?limit=1000") as resp:
        assert resp.status == 200
        decisions: list[dict[str, Any]] = (await resp.json())["decisions"]
        return decisions[::-1]  # oldest first


async def test_each_model_is_routed_by_its_own_policy(client: ClientSession) -> None:
    models = {
        "llama": {"policy": {"name": "round_robin"}},
        # keyed by the model path: requests naming the served name fall under it too
        "/models/qwen": {"policy": {"name": "min_ttft"}},
    }
    async with (
        await SimulatedFleet.start(2, SimConfig(speed=50.0, served_model_name="llama")) as llama,
        await SimulatedFleet.start(
            2, SimConfig(speed=50.0, served_model_name="qwen", model_path="/models/qwen")
        ) as qwen,
        await SimulatedFleet.start(1, SimConfig(speed=50.0, served_model_name="mistral")) as mis,
        run_gateway(
            [*llama.urls, *qwen.urls, *mis.urls], policy__name="cache_aware", models=models
        ) as gw,
    ):
        for i in range(12):
            model = ("llama", "qwen", "mistral")[i % 3]
            status, body = await _post(client, gw.url, _chat(model, i))
            assert status == 200, body
        decisions = await _decisions(client, gw.url)
        async with client.put(gw.url + "/admin/policy", json={"name": "least_load"}) as resp:
            assert resp.status == 200
            running = await resp.json()
        for i in range(6):
            status, body = await _post(client, gw.url, _chat(("llama", "mistral")[i % 2], i))
            assert status == 200, body
        after = (await _decisions(client, gw.url))[len(decisions) :]
        status, _ = await _post(client, gw.url, _chat("gpt-9", 0))
        assert status == 404
        async with client.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
        async with client.get(gw.url + "/dashboard/data") as resp:
            dashboard = {m["model"]: m for m in (await resp.json())["models"]}
        if HAS_CHROMIUM:  # the page's Models table, in headless Chromium
            rows = await _dashboard_models(gw.url)
            assert rows == ["llama", "mistral", "other", "qwen"]
    by_model: dict[str, set[str]] = {}
    for d in decisions:
        by_model.setdefault(d["model"], set()).add(d["policy"])
    assert by_model == {"llama": {"round_robin"}, "qwen": {"min_ttft"}, "mistral": {"cache_aware"}}
    # round robin over llama's two workers, whatever the prefixes
    llama_ids = {worker_id_for(u) for u in llama.urls}
    picks = [d["worker"] for d in decisions if d["model"] == "llama"]
    assert set(picks) == llama_ids and all(a != b for a, b in pairwise(picks))
    # a live change moved the top-level policy only
    assert running["running"]["policy"]["name"] == "least_load"
    assert {m: s["policy"]["name"] for m, s in running["models"].items()} == {
        "llama": "round_robin",
        "/models/qwen": "min_ttft",
    }
    assert {(d["model"], d["policy"]) for d in after} == {
        ("llama", "round_robin"),
        ("mistral", "least_load"),
    }
    # per-model series beside the per-worker ones (whose labels are unchanged)
    route = 'route="/v1/chat/completions"'
    assert f'gateway_model_requests_total{{model="llama",{route},status="200"}} 7.0' in metrics
    assert f'gateway_model_requests_total{{model="qwen",{route},status="200"}} 4.0' in metrics
    assert f'gateway_model_requests_total{{model="other",{route},status="404"}} 1.0' in metrics
    assert 'gateway_model_prompt_tokens_total{model="mistral"}' in metrics
    assert 'gateway_model_cached_tokens_total{kind="predicted",model="qwen"}' in metrics
    assert f'gateway_requests_total{{{route},status="404",worker="none"}} 1.0' in metrics
    assert {m: d["requests"] for m, d in dashboard.items()} == {
        "llama": 7,
        "qwen": 4,
        "mistral": 7,
        "other": 1,
    }
    assert dashboard["qwen"]["reported_hit_rate"] is not None


async def _dashboard_models(url: str) -> list[str]:
    """The model rows the dashboard page shows, once it drew them."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--headless"])
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(url + "/dashboard")
            await page.wait_for_selector("#models-panel #models tbody tr", state="visible")
            rows: list[str] = await page.eval_on_selector_all(
                "#models tbody tr", "(rows) => rows.map((r) => r.dataset.model)"
            )
            assert errors == []
            return rows
        finally:
            await browser.close()


async def test_a_models_timeouts_bound_its_attempts_only(client: ClientSession) -> None:
    models = {
        "llama": {"request_timeout_s": 0.2},  # the whole attempt: 504, no retry
        "qwen": {"first_byte_timeout_s": 0.2},  # the head: retried on the other, then 504
    }
    async with (
        await SimulatedFleet.start(2, SimConfig(speed=50.0, served_model_name="llama")) as llama,
        await SimulatedFleet.start(2, SimConfig(speed=50.0, served_model_name="qwen")) as qwen,
        await SimulatedFleet.start(1, SimConfig(speed=50.0, served_model_name="mistral")) as mis,
        run_gateway([*llama.urls, *qwen.urls, *mis.urls], models=models) as gw,
    ):
        for url in [*llama.urls, *qwen.urls, *mis.urls]:
            await sim_faults(client, url, latency_s=1.0)  # every worker answers late
        llama_status, llama_body = await _post(client, gw.url, _chat("llama", 0))
        qwen_status, qwen_body = await _post(client, gw.url, _chat("qwen", 1))
        mistral_status, _ = await _post(client, gw.url, _chat("mistral", 2))  # server's 30 s
        decisions = await _decisions(client, gw.url)
    assert (llama_status, qwen_status, mistral_status) == (504, 504, 200)
    assert llama_body["error"]["message"] == qwen_body["error"]["message"] == "the worker timed out"
    attempts = Counter(d["model"] for d in decisions)
    assert attempts == {"llama": 1, "qwen": 2, "mistral": 1}
    qwen_workers = {d["worker"] for d in decisions if d["model"] == "qwen"}
    assert qwen_workers == {worker_id_for(u) for u in qwen.urls}
