"""Helpers of the real-SGLang tests: HTTP calls, SSE framing, JSON skeletons, a simulated
worker configured as the real servers are, and prompts of known token ids."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests.engine.sglang_fleet import SERVED_MODEL_NAME, SGLangFleet, SGLangSettings
from loadtests.engine.sglang_install import SGLangEnv
from loadtests.engine.workload import syllable_text
from simulator.fleet import SimConfig, SimulatedFleet

PAGE = 16
CAPACITY = 8192
CONTEXT = 32768  # the tiny model's max_position_embeddings
TIMEOUT = aiohttp.ClientTimeout(total=120)


def start_fleet(
    env: SGLangEnv, model: Path, kv_modes: list[str | None], log_dir: Path
) -> contextlib.AbstractContextManager[SGLangFleet]:
    """Real servers with the given KV-event modes (one server each), started together."""
    settings = [
        SGLangSettings(env.python, model, CAPACITY, PAGE, kv_events=mode) for mode in kv_modes
    ]
    return SGLangFleet.start(len(settings), settings[0], log_dir=log_dir, per_server=settings)


def sim_config(kv_events_config: str | None = None) -> SimConfig:
    """A simulated SGLang worker configured as the real servers of these tests."""
    return SimConfig(
        speed=50.0,
        page_size=PAGE,
        capacity_tokens=CAPACITY,
        context_length=CONTEXT,
        served_model_name=SERVED_MODEL_NAME,
        kv_events_config=kv_events_config,
    )


@contextlib.asynccontextmanager
async def simulated(kv_events_config: str | None = None) -> AsyncIterator[str]:
    """One simulated worker (in this event loop); yields its URL."""
    async with await SimulatedFleet.start(1, sim_config(kv_events_config)) as fleet:
        yield fleet.urls[0]


async def call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
) -> tuple[int, str | None, bytes]:
    """(status, Content-Type, body bytes) of one request; ``raw`` is sent as JSON bytes."""
    kwargs: dict[str, Any] = {"timeout": TIMEOUT}
    if raw is not None:
        kwargs.update(data=raw, headers={"Content-Type": "application/json"})
    elif body is not None:
        kwargs["json"] = body
    async with session.request(method, url, **kwargs) as resp:
        return resp.status, resp.headers.get("Content-Type"), await resp.read()


async def post_json(session: aiohttp.ClientSession, url: str, body: Any) -> Any:
    """POST ``body``; the 200 answer's JSON (AssertionError on any other status)."""
    status, _, data = await call(session, "POST", url, body)
    assert status == 200, (url, status, data[:500])
    return orjson.loads(data)


def sse_events(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, checking SGLang's framing on the way: every
    event is exactly ``data: <payload>\\n\\n`` (no ``event:``/comment lines) and the last one
    is ``[DONE]`` (returned too)."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    parts = raw.split(b"\n\n")
    assert parts[-1] == b"", raw[-50:]
    events = []
    for part in parts[:-1]:
        assert part.startswith(b"data: ") and b"\n" not in part, part[:200]
        events.append(part[len(b"data: ") :])
    return events


def skeleton(value: Any) -> Any:
    """A JSON value's shape: keys (in order) kept, leaves replaced by their type name;
    a list by the shape of its first element (empty: ``[]``)."""
    if isinstance(value, dict):
        return {k: skeleton(v) for k, v in value.items()}
    if isinstance(value, list):
        return [skeleton(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return value  # None


def chat_body(seed: int, system_tokens: int = 40, **extra: Any) -> dict[str, Any]:
    """A chat request of pseudo-text (one syllable = one token to both tokenizers)."""
    rng = random.Random(f"chat:{seed}")
    return {
        "model": SERVED_MODEL_NAME,
        "messages": [
            {"role": "system", "content": syllable_text(rng, system_tokens)},
            {"role": "user", "content": syllable_text(rng, 8)},
        ],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def token_ids(seed: int, n: int) -> list[int]:
    """``n`` token ids in the tiny model's ordinary range, different per seed."""
    rng = random.Random(f"ids:{seed}")
    return [rng.randrange(10, 2000) for _ in range(n)]
