"""``make demo``'s suggested first request shows prefix routing (loadtests/demo.py).

Sent twice through a gateway configured as ``config/demo.yaml`` (its policy, four simulated
workers), the second send goes to the worker that served the first, the gateway reports a
matched prefix, and the worker reports cached tokens. A bare ``"Hello!"`` (the request the
demo suggested before) is shorter than one hash block: nothing to match, which is why the
suggested request carries a system prompt.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtests.demo import _CURL_BODY, DEMO_BODY, _usage
from loadtests.harness.inprocess import run_gateway
from simulator.fleet import SimConfig, SimulatedFleet

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "config" / "demo.yaml"


async def _send_twice(url: str, body: dict[str, Any]) -> list[tuple[str, int, int | None]]:
    """(worker, matched tokens, reported cached tokens) of each of two sends."""
    out = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                doc = await resp.json()
                details = doc["usage"].get("prompt_tokens_details") or {}
                out.append(
                    (
                        resp.headers["x-gateway-worker"],
                        int(resp.headers["x-gateway-matched-tokens"]),
                        details.get("cached_tokens"),
                    )
                )
    return out


async def test_suggested_request_sent_twice_hits_the_same_worker_cached() -> None:
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    async with (
        await SimulatedFleet.start(len(demo["workers"]), SimConfig(speed=50.0)) as fleet,
        run_gateway(fleet.urls, policy__name=demo["policy"]["name"]) as gw,
    ):
        (w1, m1, _), (w2, m2, cached2) = await _send_twice(gw.url, DEMO_BODY)
        assert m1 == 0
        assert w2 == w1, "the second send must go where the prefix is"
        assert m2 > 0
        assert cached2 is not None and cached2 > 0

        hello = {"model": "sim-model", "max_tokens": 16,
                 "messages": [{"role": "user", "content": "Hello!"}]}  # fmt: skip
        (_, _, _), (_, hello_matched, _) = await _send_twice(gw.url, hello)
        assert hello_matched == 0  # shorter than one block: no prefix to route by


def test_printed_curl_command_carries_that_body() -> None:
    """The usage text's curl line is valid shell with this exact JSON body."""
    text = _usage("http://127.0.0.1:30000", "four simulated workers")
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("curl "))
    command = (lines[start].rstrip("\\") + lines[start + 1]).strip()
    argv = shlex.split(command)
    assert argv[argv.index("-d") + 1] == _CURL_BODY
    assert json.loads(_CURL_BODY) == DEMO_BODY
