"""Red team of exact mode's tokenizers: a hostile client (huge prompts, conversations a
template handles quadratically) and a hostile worker (what its ``/server_info`` names).

Each test reproduces a confirmed problem, fixed in ``gateway/exact/``:

* a body of a few MiB stalled the event loop for seconds in BPE (8 MiB: ~10 s), now not
  tokenized above ``kv_events.max_tokenize_bytes``;
* a conversation of 4,000 short messages made Gemma 4's template render for 95 s on the
  loop, now cut at ``kv_events.max_render_s``;
* a ``tokenizer_path`` too long for the filesystem raised out of discovery (no worker
  discovered any more), a malformed descriptor likewise, and a ``dp_size`` of 10^9 asked
  for 10^9 feeds: now each is that worker's reason only;
* a worker-named template's syntax error put the file's line in ``/workers`` and the log,
  a relative ``chat_template`` was read from the gateway's directory, and every spelling of
  a path was a new tokenizer in the cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.config import ConfigError, KVEventsConfig, config_from_dict
from gateway.exact.chat_template import ChatTemplate, RenderBudgetExceeded
from gateway.exact.choice import TokenizerChoice
from gateway.exact.index import Namespace
from gateway.exact.manager import (
    MAX_QUOTED,
    FollowedWorker,
    KVEventsManager,
    _named_tokenizer,
)
from gateway.exact.request import ExactRequest, request_tokens
from gateway.exact.tokenizer import HFTokenizer, Tokenizer

pytest.importorskip("tokenizers")
from loadtests.engine.sglang_model import write_tokenizer

CUBIC = (
    "{% for a in messages %}{% for b in messages %}{% for c in messages %}"
    "{{ c['role'][:0] }}{% endfor %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
)
EMPTY_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _messages(n: int) -> list[dict[str, str]]:
    return [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(n)] + [
        {"role": "user", "content": "x"}
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("model")
    write_tokenizer(directory)
    return directory


class _Counting:
    """A tokenizer that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, **kw: Any
    ) -> list[int]:
        self.calls += 1
        return [1, 2, 3]

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [1, 2, 3]


class _Mgr:
    """The manager as an ExactRequest sees it: one followed worker."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def tokenizer_for(self, worker_id: str) -> Tokenizer | None:
        return self.tok

    def wants_tokens(self, worker_ids: Any) -> bool:
        return True

    def match(self, ids: Sequence[int] | None, namespace: Namespace, worker_ids: Any) -> Any:
        return {w: 0 if ids is None else len(ids) for w in worker_ids}

    def match_tiers(self, ids: Sequence[int] | None, namespace: Namespace, worker_ids: Any) -> Any:
        return {w: (t, 0) for w, t in self.match(ids, namespace, worker_ids).items()}

    def dispatched(self, worker_id: str, ids: Sequence[int] | None, ns: Namespace) -> None:
        pass

    def mode(self, worker_id: str) -> str:
        return "exact"

    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None:
        pass


# ------------------------------------------------------------------ hostile client
def test_a_body_over_max_tokenize_bytes_is_never_tokenized() -> None:
    tok = _Counting()
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * 5000}]})
    big = ExactRequest(_Mgr(tok), "chat", body, max_bytes=4096)
    assert big.skipped and big.match(["w"]) == {}  # approximate index for every worker
    big.dispatched("w")
    assert big.tokens(tok) == (None, (None, None, None)) and tok.calls == 0
    small = ExactRequest(_Mgr(tok), "chat", body, max_bytes=len(body))
    assert not small.skipped and small.match(["w"]) == {"w": 3} and tok.calls == 1


async def test_the_manager_applies_max_tokenize_bytes() -> None:
    async with aiohttp.ClientSession() as session:
        settings = KVEventsConfig(max_tokenize_bytes=100)
        mgr = KVEventsManager(settings, _Counting(), list, session)
        try:
            assert mgr.prepare("generate", b'{"text":"' + b"a" * 200 + b'"}').skipped
            assert not mgr.prepare("generate", b'{"text":"a"}').skipped
        finally:
            await mgr.close()


@pytest.mark.parametrize("source", [CUBIC, EMPTY_LOOPS], ids=["cubic", "empty-range-loops"])
def test_a_render_is_cut_at_its_budget(source: str) -> None:
    template = ChatTemplate(source, budget_s=0.05)
    with pytest.raises(RenderBudgetExceeded):  # the cut itself: no wall-clock assertion
        template.render(_messages(400), add_generation_prompt=True)  # ~64M steps unbounded
    assert ChatTemplate(CUBIC, budget_s=0.05).render(_messages(3)) == "hi"  # small: fine


def test_a_slow_template_gets_no_exact_hit_and_no_retry(model_dir: Path) -> None:
    tok = HFTokenizer(str(model_dir), render_budget_s=0.05)
    assert tok.template is not None
    tok.template._template = tok.template._env.from_string(CUBIC)  # the model's, made cubic
    body = orjson.dumps(
        {
            "messages": _messages(400),
            "tools": [{"type": "function", "function": {"name": "f"}}],  # would retry
        }
    )
    renders = 0
    render = tok.template.render

    def counted(*args: Any, **kwargs: Any) -> str:
        nonlocal renders
        renders += 1
        return render(*args, **kwargs)

    tok.template.render = counted  # type: ignore[method-assign]
    assert request_tokens("chat", body, tok)[0] is None
    assert renders == 1  # one budget, not two: no retry with bare tools


def test_the_bounds_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_tokenize_bytes"):
        config_from_dict({"kv_events": {"max_tokenize_bytes": -1}})
    with pytest.raises(ConfigError, match="max_render_s"):
        config_from_dict({"kv_events": {"max_render_s": 0}})


# ------------------------------------------------------------------ hostile worker
def test_a_worker_named_path_never_raises_and_is_quoted_bounded() -> None:
    for path in ["/" + "a" * 5000, "/x\n/INJECTED log line", "/a\x00b", 7, ["/"], "relative"]:
        why = _named_tokenizer({"tokenizer_path": path}, 0.1)
        assert isinstance(why, str) and "\n" not in why
        assert len(why) < len("no tokenizer ... ") + 200 + MAX_QUOTED


def test_a_worker_named_template_does_not_leak_its_file(model_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.jinja"
    secret.write_text("{% SECRET_WORD_FROM_THE_FILE %}\n", encoding="utf-8")
    why = _named_tokenizer({"tokenizer_path": str(model_dir), "chat_template": str(secret)}, 0.1)
    assert isinstance(why, str) and "SECRET" not in why and "ChatTemplateError" in why
    relative = _named_tokenizer(
        {"tokenizer_path": str(model_dir), "chat_template": "secret.jinja"}, 0.1
    )
    assert isinstance(relative, str) and "not a local file" in relative


def test_path_spellings_share_one_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(model_dir)
    spellings = [str(model_dir), f"{model_dir}/", f"{model_dir}/./", f"{model_dir}//", str(link)]
    loaded = [_named_tokenizer({"tokenizer_path": p}, 0.1) for p in spellings]
    assert all(isinstance(t, HFTokenizer) for t in loaded)
    assert len({id(t) for t in loaded}) == 1


@pytest.fixture
async def info_server() -> AsyncIterator[tuple[TestServer, dict[str, Any]]]:
    infos: dict[str, Any] = {}

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(infos[request.match_info["w"]])

    app = web.Application()
    app.router.add_get("/{w}/server_info", server_info)
    server = TestServer(app)  # typed as itself (aiohttp's __aenter__ gives BaseTestServer)
    async with server:
        yield server, infos


async def test_one_hostile_server_info_never_stops_discovery(
    info_server: tuple[TestServer, dict[str, Any]], model_dir: Path
) -> None:
    server, infos = info_server
    good = {"publisher": "zmq", "endpoint_port_base": 5557, "block_size": 16, "dp_size": 1}
    infos.update(
        long={"tokenizer_path": "/" + "a" * 5000, "kv_events": good},
        listed={"tokenizer_path": str(model_dir), "kv_events": ["zmq"]},
        ranks={"tokenizer_path": str(model_dir), "kv_events": {**good, "dp_size": 10**9}},
        port={"tokenizer_path": str(model_dir), "kv_events": {**good, "endpoint_port_base": "x"}},
        good={"tokenizer_path": str(model_dir), "kv_events": good},
    )
    workers = [FollowedWorker(w, str(server.make_url(f"/{w}"))) for w in infos]
    async with aiohttp.ClientSession() as session:
        mgr = KVEventsManager(KVEventsConfig(), TokenizerChoice(), lambda: workers, session)
        try:
            await mgr.discover()
            assert mgr.mode("good") == "exact"
            for wid in ("long", "listed", "ranks", "port"):
                assert mgr.mode(wid) == "approximate", wid
                assert "\n" not in mgr.reason(wid) and len(mgr.reason(wid)) < 400
            assert "unusable" in mgr.reason("ranks")
            assert sum(len(s.feeds) for s in mgr._states.values()) == 1
        finally:
            await mgr.close()
