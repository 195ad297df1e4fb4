"""Measure a real SGLang 0.5.23 CPU server's TTFT, cold and cached, and fit a profile.

The simulator's latency model (``simulator/model/profiles.py``) prices a prefill of
``n`` new tokens over ``c`` cached ones as ``fixed + per_token·n + per_cached·c +
per_pair·n·(c + n/2) + cached_pair·c²/2``
and a decode step of one request with context ``L`` as
``max(floor, per_request) + per_context·L + overhead``. This module measures one real
server (the tiny Hugging Face model of :mod:`loadtests.engine.sglang_model`, the flags of
:mod:`loadtests.engine.sglang_fleet`), one request at a time (no queueing):

* **cold**: prompts of ``COLD_SIZES`` syllable tokens no request has sent before;
* **cached**: a prefix of ``c`` tokens sent once (the warm-up), then the same prefix with a
  new ``CACHED_NEW``-token message: ``usage`` says how many tokens were cached and new;
* **repeat**: the same prompt twice (all but the last page cached: the fixed part);
* **decode**: ``DECODE_TOKENS`` tokens with ``ignore_eos``; per token =
  ``(latency - TTFT) / (tokens - 1)``, at a short and a long context.

TTFT is client-side, to the first streamed event (SGLang streams its first chunk with the
first token, i.e. after prefill), so it includes the HTTP, tokenizer and detokenizer hops
the simulator folds into ``prefill_fixed_s``. Each point is the median of ``reps`` runs.
A fresh server is slow on the first prompt of each new length (seconds for a few hundred
tokens: first-time work per shape), so one discarded warm-up pass sends every size first.
The prefill constants are the non-negative least-squares fit of the cold and cached
points (the ``n``, ``c`` the engine reported), the decode constants the line through the
two decode points. The server's own limits (``/server_info``: ``max_total_num_tokens``,
``chunked_prefill_size``, ``max_prefill_tokens``, ``max_running_requests``,
``context_length``) are printed beside the fit.

Contract: prints one JSON object (points, fit, server limits) and writes it to
``--json`` if given; starts one server and stops its process group on exit, or measures
``--url`` (a running server) and starts nothing.

    python -m loadtests.engine.sglang_calibrate [--reps 5] [--json results/sglang_fit.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadtests.engine.client import ChatResult, stream_chat
from loadtests.engine.sglang_model import SERVED_MODEL_NAME
from loadtests.engine.workload import syllable_text

COLD_SIZES: tuple[int, ...] = (250, 500, 1000, 2000, 3000)
CACHED_PREFIXES: tuple[int, ...] = (500, 1000, 2000, 3000)
CACHED_NEW = 200
DECODE_CONTEXTS: tuple[int, ...] = (200, 3000)
DECODE_TOKENS = 33
SERVER_LIMITS: tuple[str, ...] = (
    "max_total_num_tokens", "chunked_prefill_size", "max_prefill_tokens",
    "effective_max_running_requests_per_dp", "max_req_input_len", "page_size",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Point:
    """One measured prefill: engine-reported new and cached tokens, median TTFT."""

    kind: str  # "cold", "cached" or "repeat"
    new_tokens: int
    cached_tokens: int
    ttft_s: float
    samples: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class DecodePoint:
    """Median seconds per decoded token at a context of ``context_tokens``."""

    context_tokens: int
    per_token_s: float
    samples: tuple[float, ...]


def body(messages: Sequence[dict[str, str]], max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    """A chat body for the served tiny model, greedy."""
    return {
        "model": SERVED_MODEL_NAME,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


async def _send(session: aiohttp.ClientSession, url: str, b: dict[str, Any]) -> ChatResult:
    result = await stream_chat(session, url, b)
    if not result.ok or result.ttft_s is None:
        raise RuntimeError(f"request failed: {result.status} {result.error}")
    return result


async def measure(url: str, reps: int, seed: int = 0) -> tuple[list[Point], list[DecodePoint]]:
    """Every point of the module docstring on the server at ``url``, sequentially.

    Fresh text (a seeded RNG) for every cold prompt and every prefix, so nothing is
    cached unless this function cached it on purpose.
    """
    rng = random.Random(seed)
    points: list[Point] = []
    decode: list[DecodePoint] = []
    async with aiohttp.ClientSession() as session:
        for n in (*COLD_SIZES, *CACHED_PREFIXES, CACHED_NEW):  # warm-up, discarded
            warm = {"role": "user", "content": syllable_text(rng, n)}
            await _send(session, url, body([warm]))
            await _send(session, url, body([warm, {"role": "user", "content": "hi"}], 4))
        for n in COLD_SIZES:
            runs = []
            for _ in range(reps):
                cold = {"role": "user", "content": syllable_text(rng, n)}
                runs.append(await _send(session, url, body([cold])))
            points.append(_point("cold", runs))
        for c in CACHED_PREFIXES:
            runs = []
            for _ in range(reps):
                prefix = {"role": "system", "content": syllable_text(rng, c)}
                await _send(session, url, body([prefix, {"role": "user", "content": "hello"}]))
                msg = {"role": "user", "content": syllable_text(rng, CACHED_NEW)}
                runs.append(await _send(session, url, body([prefix, msg])))
            points.append(_point("cached", runs))
        runs = []
        for _ in range(reps):
            same = body([{"role": "user", "content": syllable_text(rng, 1000)}])
            await _send(session, url, same)
            runs.append(await _send(session, url, same))
        points.append(_point("repeat", runs))
        for ctx in DECODE_CONTEXTS:
            per_token = []
            for _ in range(reps):
                msg = {"role": "user", "content": syllable_text(rng, ctx)}
                r = await _send(session, url, body([msg], DECODE_TOKENS, ignore_eos=True))
                assert r.ttft_s is not None
                per_token.append((r.latency_s - r.ttft_s) / (DECODE_TOKENS - 1))
            decode.append(DecodePoint(ctx, statistics.median(per_token), tuple(per_token)))
    return points, decode


def _point(kind: str, runs: Sequence[ChatResult]) -> Point:
    ttfts = [r.ttft_s for r in runs if r.ttft_s is not None]
    cached = int(statistics.median(r.cached_tokens for r in runs))
    new = int(statistics.median(r.prompt_tokens - r.cached_tokens for r in runs))
    return Point(kind, new, cached, statistics.median(ttfts), tuple(ttfts))


PREFILL_TERMS: tuple[str, ...] = (
    "prefill_fixed_s", "prefill_per_token_s", "prefill_per_cached_token_s",
    "attention_per_pair_s", "cached_pair_s",
)  # fmt: skip


def prefill_terms(new: float, cached: float) -> list[float]:
    """The factors of :data:`PREFILL_TERMS` for a prefill of ``new`` over ``cached``:
    ``1, n, c, n·(c + n/2), c²/2`` (the profile's ``prefill_time``)."""
    return [1.0, new, cached, new * (cached + new / 2), cached * cached / 2]


def fit_prefill(points: Sequence[Point]) -> dict[str, float]:
    """Least squares of ``ttft = fixed + per_token·n + per_cached·c + per_pair·n·(c + n/2)
    + cached_pair·c²/2`` over the cold and cached points (the repeat is kept out: it checks
    the fit), every constant ≥ 0: the best unconstrained fit over each subset of the terms
    whose constants all come out non-negative (exact NNLS for this few unknowns).

    On the real CPU server a prefill over a cached prefix costs nearly what a cold prompt
    of the same total length does (the last two terms), which the three-term model of the
    GPU profiles cannot express."""
    used = [p for p in points if p.kind in ("cold", "cached")]
    a = np.array([prefill_terms(p.new_tokens, p.cached_tokens) for p in used])
    y = np.array([p.ttft_s for p in used])
    k = a.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            cols = list(subset)
            sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(k)
            coef[cols] = sol
            err = float(np.sum((a @ coef - y) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, coef)
    assert best is not None  # the fixed term alone: the mean of positive TTFTs
    return {name: float(x) for name, x in zip(PREFILL_TERMS, best[1], strict=True)}


def fit_decode(points: Sequence[DecodePoint]) -> dict[str, float]:
    """The line ``per_token = base + per_context·L`` through the decode points."""
    lo, hi = points[0], points[-1]
    slope = max(0.0, (hi.per_token_s - lo.per_token_s) / (hi.context_tokens - lo.context_tokens))
    return {
        "decode_base_s": lo.per_token_s - slope * lo.context_tokens,
        "decode_per_context_token_s": slope,
    }


def predicted(fit: dict[str, float], p: Point) -> float:
    """The fitted model's TTFT for a measured point (for the residuals)."""
    terms = prefill_terms(p.new_tokens, p.cached_tokens)
    return sum(fit[name] * x for name, x in zip(PREFILL_TERMS, terms, strict=True))


async def server_limits(url: str) -> dict[str, Any]:
    """The scheduler limits the profile copies, from ``GET /server_info``."""
    async with aiohttp.ClientSession() as session, session.get(url + "/server_info") as r:
        info = await r.json()
    return {k: info.get(k) for k in SERVER_LIMITS}


@contextlib.contextmanager
def _server(url: str | None, max_total_tokens: int) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from loadtests.engine.sglang_fleet import SGLangFleet, SGLangSettings
    from loadtests.engine.sglang_install import ensure_sglang
    from loadtests.engine.sglang_model import ensure_sglang_model
    from loadtests.engine.tiny_model import default_cache_dir

    env = ensure_sglang()
    model = ensure_sglang_model(default_cache_dir(), env.python)
    settings = SGLangSettings(env.python, model.resolve(), max_total_tokens)
    with SGLangFleet.start(1, settings) as fleet:
        yield fleet.urls[0]


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: measure, fit, print the JSON (and write it with ``--json``)."""
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.engine.sglang_calibrate", description=__doc__
    )
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with _server(args.url, args.max_total_tokens) as url:
        points, decode = asyncio.run(measure(url, args.reps))
        limits = asyncio.run(server_limits(url))
    fit = fit_prefill(points)
    out = {
        "points": [{**asdict(p), "fitted_s": predicted(fit, p)} for p in points],
        "decode": [asdict(d) for d in decode],
        "fit": {**fit, **fit_decode(decode)},
        "server": limits,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
