"""Exact mode tokenizes a large request body off the event loop (docs/KV_EVENTS.md).

Before, a chat body just under ``kv_events.max_tokenize_bytes`` (1 MiB) was rendered and
BPE-encoded on the loop: ~0.7 s during which no other request moved. Now the router awaits
``ExactRequest.prepare_tokens`` before its synchronous decision, which runs a body over
``OFFLOAD_BYTES`` in the manager's threads (``tokenizers`` encodes without the GIL) and a
small one inline. Behaviour, not benchmarks: the bounds are generous.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gateway.exact.request import OFFLOAD_BYTES, ExactRequest, request_tokens
from gateway.exact.tokenizer import HFTokenizer, Tokenizer

pytest.importorskip("tokenizers")
from exact_loop_probe import Ticker, chat_body, exact_gateway, varied_text
from test_exact_hostile import _Counting, _Mgr

from loadtests.engine.sglang_model import write_tokenizer

BIG = int(0.9 * (1 << 20))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("model")
    write_tokenizer(directory)
    return directory


class _Unfollowed(_Mgr):
    """No candidate is followed (no worker publishes events, or none has a tokenizer)."""

    def tokenizer_for(self, worker_id: str) -> Tokenizer | None:
        return None

    def wants_tokens(self, worker_ids: Any) -> bool:
        return False


class _Counted(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(1)
        self.jobs = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


async def test_a_large_body_is_tokenized_while_the_loop_serves_a_small_one(
    model_dir: Path,
) -> None:
    tok = HFTokenizer(str(model_dir))
    big_body, small_body = chat_body(varied_text(BIG)), chat_body(varied_text(500))
    with _Counted() as executor:
        big = ExactRequest(_Mgr(tok), "chat", big_body, executor=executor)
        small = ExactRequest(_Mgr(tok), "chat", small_body, executor=executor)
        async with Ticker() as ticker:
            task = asyncio.get_running_loop().create_task(big.prepare_tokens(["w"]))
            await asyncio.sleep(0)  # the large body is now in the executor
            await small.prepare_tokens(["w"])  # inline: no thread hop for a small body
            small_tokens = small.match(["w"])
            assert not task.done(), "the small request waited for the large one"
            await task
        assert executor.jobs == 1  # the large one only
    assert small_tokens["w"] > 0 and ticker.ticks >= 10  # the loop kept ticking meanwhile
    assert big.tokens(tok) == request_tokens("chat", big_body, tok)  # the same ids, cached
    assert big.match(["w"])["w"] > BIG // 4


async def test_no_followed_candidate_means_no_tokenization_at_all() -> None:
    tok = _Counting()
    body = chat_body("x" * (4 * OFFLOAD_BYTES))
    with _Counted() as executor:
        req = ExactRequest(_Unfollowed(tok), "chat", body, executor=executor)
        await req.prepare_tokens(["w"])
        assert req.match(["w"]) == {} and executor.jobs == 0 and tok.calls == 0
        followed = ExactRequest(_Mgr(tok), "chat", body, executor=executor)
        await followed.prepare_tokens(["w"])
        await followed.prepare_tokens(["w"])  # a retry: already tokenized
        followed.dispatched("w")
        assert followed.match(["w"]) == {"w": 3} and executor.jobs == 1 and tok.calls == 1


async def test_the_gateway_keeps_serving_while_it_tokenizes_a_large_body(
    model_dir: Path,
) -> None:
    big = chat_body(varied_text(BIG))
    async with exact_gateway(model_dir) as (url, s):
        async with s.post(url, data=big) as resp:
            assert resp.status == 200
            await resp.read()
        # it was tokenized in the manager's threads, not on the loop (how long the loop
        # pauses is measured, not asserted: docs/KV_EVENTS.md, exact_loop_probe.py)
        assert any(t.name.startswith("exact-tokenize") for t in threading.enumerate())
