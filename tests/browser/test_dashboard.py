"""The operator's dashboard in a real headless Chromium (Debian's package, via Playwright).

Checks: the page loads without console errors, lists the workers, and its figures change
after traffic; a page opened after traffic draws the recent past from its first poll (the
gateway's ring, ``?history=1``). Saves a screenshot under pytest's tmp_path. Skipped only when
``/usr/bin/chromium`` is absent (``make browser-deps`` installs it).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from playwright.async_api import Browser, ConsoleMessage, Page, async_playwright

import gateway.app
import gateway.telemetry.history
from gateway.config import config_from_dict, merge
from gateway.http import app_keys
from gateway.http.debug import add_telemetry_routes, dashboard_data
from gateway.http.handlers import start_site
from gateway.routing.decisions import CandidateScore, DecisionLog, DecisionRecord
from gateway.telemetry.hub import _CURRENT, Telemetry
from gateway.telemetry.logs import REQUEST_ID
from gateway.telemetry.snapshot import FleetSnapshot, IndexFigures, WorkerSnapshot
from simulator.fleet import SimConfig, SimulatedFleet

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
WORKERS = ["w1", "w2", "w3"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason=f"{CHROMIUM} is absent: install Debian's chromium (make browser-deps)",
    ),
]


@pytest.fixture(autouse=True)
def _fresh_request_context() -> Iterator[None]:
    rid = REQUEST_ID.set(None)
    current = _CURRENT.set(None)
    yield
    _CURRENT.reset(current)
    REQUEST_ID.reset(rid)


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def open_dashboard(browser: Browser, url: str) -> tuple[Page, list[str]]:
    """The page, and a list that collects console errors and uncaught exceptions."""
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []

    def on_console(msg: ConsoleMessage) -> None:
        if msg.type == "error":
            errors.append(msg.text)

    page.on("console", on_console)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(url + "/dashboard")
    return page, errors


async def open_recording(browser: Browser, url: str) -> tuple[Page, list[str], list[str]]:
    """Like :func:`open_dashboard`, plus the URLs of the ``/dashboard/data`` polls made."""
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    polls: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda r: polls.append(r.url) if "/dashboard/data" in r.url else None)
    await page.goto(url + "/dashboard")
    return page, errors, polls


async def chart_points(page: Page, chart: str) -> dict[str, list[tuple[float, float]]]:
    """Each line of chart ``chart`` (an svg id): worker -> its (x, y) points (y=160: zero)."""
    lines: dict[str, str] = await page.evaluate(
        """(id) => Object.fromEntries([...document.querySelectorAll('#' + id + ' polyline')]
             .map((l) => [l.dataset.worker, l.getAttribute('points')]))""",
        chart,
    )
    return {
        w: [(float(x), float(y)) for x, y in (p.split(",") for p in pts.split())]
        for w, pts in lines.items()
    }


class FakeFleet:
    """Three workers; in-flight figures and index modes set by the test."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.modes: dict[str, str | None] = {"w1": "exact", "w2": "degraded", "w3": None}

    def __call__(self) -> FleetSnapshot:
        return FleetSnapshot(
            workers=[
                WorkerSnapshot(
                    worker=w,
                    url=f"http://127.0.0.1:1800{i}",
                    healthy=w != "w3",
                    health_flags={"ejected": w == "w3"},
                    in_flight=self.in_flight + i,
                    engine_waiting=i,
                    engine_token_usage=0.1 * i,
                    index=IndexFigures(
                        blocks=100 * i,
                        approx_bytes=12800 * i,
                        predicted_tokens=200,
                        reported_tokens=100,
                    ),
                    index_mode=self.modes[w],
                )
                for i, w in enumerate(WORKERS)
            ],
            policy="min_ttft",
            admission_queued=0,
        )


def traffic(telemetry: Telemetry, log: DecisionLog, n: int, rng: random.Random) -> None:
    for i in range(n):
        worker = WORKERS[i % 2]
        rt = telemetry.begin_request(f"req-{i}", "/v1/chat/completions", "m")
        matched = rng.choice([0, 64, 128])
        held = {w: matched if w == worker else 0 for w in WORKERS} | {"w3": 128}  # w3: best
        rec = DecisionRecord(
            time=1.7e9 + i, request_id=f"req-{i}", policy="min_ttft", worker=worker,
            reason="prefix_hit" if matched else "load", prompt_tokens=160,
            matched_tokens=matched, available_tokens=128,
            candidates=tuple(CandidateScore(w, held[w], 0.01 * i) for w in WORKERS),
        )  # fmt: skip
        log.add(rec)
        rt.decided(rec)
        rt.finish(200, reported_cached_tokens=max(0, matched - 16), ttft_s=0.02 + 0.001 * i)


async def test_dashboard_on_fake_fleet(browser: Browser, tmp_path: Path) -> None:
    fleet = FakeFleet()
    telemetry = Telemetry(snapshot=fleet)
    log = DecisionLog(256)
    app = web.Application()
    add_telemetry_routes(app, telemetry=telemetry, decisions=log)
    runner, url = await serve(app)
    try:
        page, errors = await open_dashboard(browser, url)
        for w in WORKERS:
            await page.wait_for_selector(f'#workers tbody tr[data-worker="{w}"]')
        assert await page.inner_text("#total-requests") == "0"
        assert "ejected" in await page.inner_text('#workers tr[data-worker="w3"]')
        w1_mode = page.locator('#workers tr[data-worker="w1"] td[data-field="mode"] .badge')
        assert await w1_mode.inner_text() == "exact"
        assert "ok" in (await w1_mode.get_attribute("class") or "")
        assert await w1_mode.get_attribute("title") == "index fidelity 50.0%"
        w2_mode = page.locator('#workers tr[data-worker="w2"] td[data-field="mode"] .badge')
        assert await w2_mode.inner_text() == "degraded"
        assert "warn" in (await w2_mode.get_attribute("class") or "")
        w3_mode = '#workers tr[data-worker="w3"] td[data-field="mode"]'
        assert await page.inner_text(w3_mode) == "\u2013"  # not reported: a dash, no badge
        fleet.modes["w2"] = "exact"  # the next refresh redraws it
        await page.wait_for_selector(
            '#workers tr[data-worker="w2"] td[data-field="mode"] .badge[data-mode="exact"]',
            timeout=10_000,
        )
        assert await page.locator("#decisions tbody tr").count() == 0

        fleet.in_flight = 5
        traffic(telemetry, log, 30, random.Random(3))
        await page.wait_for_function(
            "document.getElementById('total-requests').textContent === '30'", timeout=10_000
        )
        await page.wait_for_function(
            "document.querySelectorAll('#decisions tbody tr').length === 20", timeout=10_000
        )
        w1 = await page.inner_text('#workers tr[data-worker="w1"] td[data-col="0"]')
        assert w1 == "5"
        p50 = await page.inner_text('#workers tr[data-worker="w1"] td[data-col="5"]')
        assert p50.endswith(" ms")
        reasons = await page.locator("#reasons tr[data-reason]").count()
        assert reasons >= 1
        # routing capture: the two ratios as /dashboard/data has them, with their requests
        capture = dashboard_data(telemetry, log)["routing_capture"]
        for card, ratio in (("captured", "captured_over_available"),
                            ("delivered", "delivered_over_available")):  # fmt: skip
            shown = await page.inner_text(f"#capture-{card}")
            assert shown.endswith("%") and abs(float(shown[:-1]) - 100 * capture[ratio]) < 0.06
        assert await page.inner_text("#capture-captured-n") == "over 30 requests"
        assert await page.inner_text("#capture-delivered-n") == "over 30 requests"
        latest = await page.inner_text("#decisions tbody tr:first-child td:nth-child(6)")
        assert latest.endswith(" / 128 / 160")  # matched / available / prompt
        # a second burst: the request-rate chart draws a line per busy worker
        traffic(telemetry, log, 30, random.Random(4))
        await page.wait_for_function(
            "document.getElementById('total-requests').textContent === '60'", timeout=10_000
        )
        await page.wait_for_selector('#chart-rate polyline[data-worker="w1"]', timeout=10_000)
        await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
        assert errors == []
        await page.close()
    finally:
        await runner.cleanup()
        telemetry.shutdown()


async def test_dashboard_draws_the_recent_past_on_first_paint(browser: Browser) -> None:
    """Traffic before the page opens: its first poll brings the ring and both charts have
    lines at once, not after minutes of polling."""
    fleet = FakeFleet()
    telemetry = Telemetry(snapshot=fleet)
    log = DecisionLog(256)
    app = web.Application()
    add_telemetry_routes(app, telemetry=telemetry, decisions=log, history_period_s=0.1)
    runner, url = await serve(app)
    try:
        rng = random.Random(5)
        for _ in range(4):  # bursts over ~10 samples, nobody watching
            traffic(telemetry, log, 10, rng)
            await asyncio.sleep(0.25)
        page, errors, polls = await open_recording(browser, url)
        await page.wait_for_selector('#workers tbody tr[data-worker="w1"]')  # first render
        rate = await chart_points(page, "chart-rate")
        ttft = await chart_points(page, "chart-ttft")
        assert polls == [url + "/dashboard/data?history=1"]  # drawn from the first poll alone
        for w in ("w1", "w2"):  # traffic went to w1 and w2 only
            assert len(rate[w]) >= 5, rate
            assert any(y < 160 for _, y in rate[w]), rate[w]  # the bursts show as rates > 0
            assert len(ttft[w]) >= 5, ttft
        assert "w3" not in rate
        assert await page.inner_text("#total-requests") == "40"
        assert errors == []
        await page.close()
    finally:
        await runner.cleanup()
        telemetry.shutdown()


async def _shared_prefix_traffic(url: str, n: int, sessions: int = 0) -> None:
    """``n`` chat requests in 4 groups sharing a long system prompt, 4 at a time; with
    ``sessions``, each carries one of that many ``x-session-id`` values."""
    systems = [f"You are assistant {g}. " + "Follow the house style. " * 120 for g in range(4)]
    sem = asyncio.Semaphore(4)
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            body = {"model": "sim-model", "max_tokens": 4, "stream": i % 2 == 0,
                    "messages": [{"role": "system", "content": systems[i % 4]},
                                 {"role": "user", "content": f"question {i}"}]}  # fmt: skip
            headers = {"x-session-id": f"s{i % sessions}"} if sessions else {}
            async with (
                sem,
                session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp,
            ):
                await resp.read()
                assert resp.status == 200

        await asyncio.gather(*(one(i) for i in range(n)))


async def test_dashboard_through_gateway_and_simulated_fleet(
    browser: Browser, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway.telemetry.history, "PERIOD_S", 0.25)  # the ring fills fast
    async with await SimulatedFleet.start(3, SimConfig(speed=50.0)) as fleet:
        config = config_from_dict(merge({}, {
            "workers": fleet.urls, "policy.name": "min_ttft", "policy.seed": 3,
            "health.interval_s": 0.1, "health.success_threshold": 1,
            "load.poll_interval_s": 0.2,
        }))  # fmt: skip
        app = gateway.app.build_app(config)
        runner, port = await start_site(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            ids = [w.id for w in app[app_keys.REGISTRY]]
            page, errors = await open_dashboard(browser, url)
            for wid in ids:
                await page.wait_for_selector(f'#workers tbody tr[data-worker="{wid}"]')
            await page.wait_for_function(
                "document.getElementById('workers-healthy').textContent === '3 / 3'",
                timeout=10_000,
            )
            assert await page.inner_text("#total-requests") == "0"
            assert await page.inner_text("#policy") == "min_ttft"
            for wid in ids:  # no tokenizer configured: every worker approximate, and why
                cell = f'#workers tr[data-worker="{wid}"] td[data-field="mode"]'
                await page.wait_for_selector(f"{cell} .reason", timeout=10_000)
                assert await page.inner_text(f"{cell} .badge") == "approximate"
                assert "no tokenizer configured" in await page.inner_text(f"{cell} .reason")

            await _shared_prefix_traffic(url, 24)
            await page.wait_for_function(
                "document.getElementById('total-requests').textContent === '24'", timeout=10_000
            )
            await page.wait_for_function(
                "document.querySelectorAll('#decisions tbody tr').length === 20", timeout=10_000
            )
            hits = [
                await page.inner_text(f'#workers tr[data-worker="{wid}"] td[data-col="9"]')
                for wid in ids
            ]
            assert any(h.endswith("%") and h != "0.0%" for h in hits), hits  # reported hit
            # min_ttft consults the index: both capture ratios are known
            assert (await page.inner_text("#capture-captured")).endswith("%")
            assert (await page.inner_text("#capture-delivered")).endswith("%")
            assert await page.locator("#reasons tr[data-reason]").count() >= 1
            await page.screenshot(path=str(tmp_path / "dashboard-gateway.png"), full_page=True)
            assert errors == []
            await page.close()

            # A page opened now draws the traffic above from its first poll.
            await asyncio.sleep(0.75)  # a few more samples of the gateway's ring
            page, errors, polls = await open_recording(browser, url)
            for wid in ids:
                await page.wait_for_selector(f'#workers tbody tr[data-worker="{wid}"]')
            rate = await chart_points(page, "chart-rate")
            ttft = await chart_points(page, "chart-ttft")
            assert polls == [url + "/dashboard/data?history=1"]
            busy = [w for w in ids if w in rate]
            assert busy, rate  # min_ttft spread the groups: at least one line per busy worker
            assert any(y < 160 for w in busy for _, y in rate[w]), rate
            assert any(len(points) >= 2 for points in ttft.values()), ttft
            assert errors == []
            await page.close()
        finally:
            await runner.cleanup()


async def test_dashboard_shows_shadows_ab_arms_and_policy_changes(
    browser: Browser, tmp_path: Path
) -> None:
    """A gateway with two shadows and an A/B split: the page lists every policy's figures
    on the same requests, both arms with their intervals, and a live policy change."""
    async with await SimulatedFleet.start(3, SimConfig(speed=50.0)) as fleet:
        config = config_from_dict(merge({}, {
            "workers": fleet.urls, "policy.name": "cache_aware", "policy.seed": 3,
            "policy.shadows": ["min_ttft", "round_robin"], "policy.ab_policy": "least_load",
            "policy.ab_fraction": 0.5, "health.interval_s": 0.1,
            "health.success_threshold": 1,
        }))  # fmt: skip
        app = gateway.app.build_app(config)
        runner, port = await start_site(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            page, errors = await open_dashboard(browser, url)
            await page.wait_for_function(
                "document.getElementById('workers-healthy').textContent === '3 / 3'",
                timeout=10_000,
            )
            await _shared_prefix_traffic(url, 32, sessions=8)
            for key in ("routed:cache_aware", "shadow:min_ttft", "shadow:round_robin"):
                await page.wait_for_selector(f'#shadows tr[data-policy="{key}"]', timeout=10_000)
            agreement = await page.inner_text(
                '#shadows tr[data-policy="shadow:min_ttft"] td:nth-child(4)'
            )
            assert agreement.endswith("%"), agreement
            assert "shadows: min_ttft, round_robin" in await page.inner_text("#running")
            assert "B: least_load (50 %)" in await page.inner_text("#running")
            for arm in ("A", "B"):
                await page.wait_for_selector(f'#ab tr[data-arm="{arm}"]', timeout=10_000)
                cached = await page.inner_text(f'#ab tr[data-arm="{arm}"] td:nth-child(3)')
                assert cached[0].isdigit(), cached  # a value, not the empty mark
            await page.wait_for_selector('#ab tr[data-arm="verdict"]')

            async with aiohttp.ClientSession() as session:
                change = {"name": "min_ttft"}
                async with session.put(url + "/admin/policy", json=change) as resp:
                    assert resp.status == 200
            await page.wait_for_function(
                "document.querySelector('#changes tbody tr')?.textContent.includes('min_ttft')",
                timeout=10_000,
            )
            await page.wait_for_function(
                "document.getElementById('policy').textContent === 'min_ttft'", timeout=10_000
            )
            await page.screenshot(path=str(tmp_path / "dashboard-tuning.png"), full_page=True)
            assert errors == []
        finally:
            await runner.cleanup()
