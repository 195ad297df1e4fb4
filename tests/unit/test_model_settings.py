"""Per-model settings (issue 19): the ``models:`` section (parsing, refusals naming the
key, tokenizers folded into ``kv_events``), the routing core's per-model policy sets, the
entry a request's model falls under, live tuning leaving per-model sets alone, and the
bounded ``model`` label of the ``gateway_model_*`` families."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from contextvars import copy_context
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import make_model_policy_sets, make_policy_set
from gateway.cli import main, parse_config
from gateway.config import ConfigError, ModelConfig, ModelPolicyConfig, config_from_dict
from gateway.exact.choice import load_cached, load_choice
from gateway.http.tuning import PolicyControl
from gateway.routing.cost_model import CostModel
from gateway.routing.decide import RoutingCore
from gateway.routing.decisions import DecisionRecord
from gateway.routing.models import ModelRoutes
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.request import ApiKind, RouteRequest
from gateway.telemetry.hub import MAX_MODEL_LABELS, OTHER, Telemetry
from gateway.telemetry.tuning import TuningTelemetry
from gateway.workers.registry import WorkerRegistry
from loadtests.harness.inprocess import SIM_TOKENIZER

MODELS: dict[str, Any] = {
    "llama": {"policy": {"name": "round_robin"}, "request_timeout_s": 5},
    "qwen": {
        "policy": {"name": "cache_aware", "cache_threshold": 0.5, "params": {}},
        "first_byte_timeout_s": 0,
        "tokenizer": SIM_TOKENIZER,
    },
    "mistral": {"request_timeout_s": 2.5},  # timeouts only: routed by the top-level policy
}


# --- configuration --------------------------------------------------------------------


def test_models_section_is_parsed_with_unset_keys_left_to_the_top_level() -> None:
    cfg = config_from_dict({"policy": {"name": "min_ttft"}, "models": MODELS})
    assert cfg.models["llama"] == ModelConfig(
        policy=ModelPolicyConfig(name="round_robin"), request_timeout_s=5.0
    )
    qwen = cfg.models["qwen"]
    assert qwen.policy is not None and qwen.policy.cache_threshold == 0.5
    assert qwen.policy.balance_abs_threshold == 64  # the section's default, not inherited
    assert qwen.first_byte_timeout_s == 0.0 and qwen.request_timeout_s is None
    assert cfg.models["mistral"].policy is None
    as_policy = qwen.policy.as_policy()
    assert (as_policy.name, as_policy.cache_threshold) == ("cache_aware", 0.5)
    assert as_policy.shadows == () and as_policy.ab_policy is None
    assert config_from_dict({}).models == {}  # no section: nothing per model


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        ({"policy": {"name": "fastest"}}, "models.qwen.policy.name"),
        ({"policy": {"cache_threshold": 2}}, "models.qwen.policy.cache_threshold"),
        ({"policy": {"balance_rel_threshold": 0.5}}, "models.qwen.policy.balance_rel_threshold"),
        ({"policy": {"shadows": ["random"]}}, "models.qwen.policy.shadows"),  # top-level only
        ({"policy": {"seed": 3}}, "models.qwen.policy.seed"),
        ({"policy": "round_robin"}, "models.qwen.policy"),
        ({"request_timeout_s": 0}, "models.qwen.request_timeout_s"),
        ({"request_timeout_s": "soon"}, "models.qwen.request_timeout_s"),
        ({"first_byte_timeout_s": -1}, "models.qwen.first_byte_timeout_s"),
        ({"tokenizer": "gpt2"}, "models.qwen.tokenizer"),
        ({"chat_template": "/no/such/template.jinja"}, "models.qwen.chat_template"),
        ({"timeout": 3}, "models.qwen.timeout"),
    ],
)
def test_a_bad_entry_is_refused_naming_its_key(entry: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"models": {"qwen": entry}})
    assert str(err.value).startswith(f"{key}:"), str(err.value)


def test_models_must_be_a_mapping_of_sections() -> None:
    for bad, key in ((["qwen"], "models"), ({"qwen": 3}, "models.qwen"), ({" ": {}}, "models. ")):
        with pytest.raises(ConfigError) as err:
            config_from_dict({"models": bad})
        assert str(err.value).startswith(f"{key}:"), str(err.value)


def test_bad_policy_params_are_refused_at_start_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "g.yaml"
    path.write_text("models:\n  qwen:\n    policy: {name: round_robin, params: {bogus: 1}}\n")
    with pytest.raises(ConfigError, match=r"^models\.qwen\.policy\.params:"):
        parse_config(["--config", str(path)])
    assert main(["--config", str(path)]) == 2
    assert "models.qwen.policy.params" in capsys.readouterr().err
    path.write_text("models:\n  qwen:\n    policy: {name: nope}\n")
    assert main(["--config", str(path)]) == 2
    assert "models.qwen.policy.name: unknown policy" in capsys.readouterr().err


def test_tokenizers_feed_kv_events_and_contradictions_are_refused(tmp_path: Path) -> None:
    cfg = config_from_dict({"models": MODELS})
    assert dict(cfg.kv_events.tokenizers) == {"qwen": SIM_TOKENIZER}
    assert cfg.models["qwen"].tokenizer == SIM_TOKENIZER  # as given
    # the same value in both places is one setting; a different one is refused
    same = {"kv_events": {"tokenizers": {"qwen": SIM_TOKENIZER}}, "models": MODELS}
    assert config_from_dict(same).kv_events == cfg.kv_events
    other = {"kv_events": {"tokenizers": {"qwen": "hf:/elsewhere"}}, "models": MODELS}
    with pytest.raises(ConfigError, match=r"^models\.qwen\.tokenizer: differs"):
        config_from_dict(other)
    # a per-model tokenizer alone satisfies kv_events.enabled: true
    strict = {"kv_events": {"enabled": True}, "models": {"qwen": {"tokenizer": SIM_TOKENIZER}}}
    assert config_from_dict(strict).kv_events.enabled == "true"
    # a chat template needs an hf: tokenizer for its model
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    python = {"qwen": {"tokenizer": SIM_TOKENIZER, "chat_template": str(template)}}
    with pytest.raises(ConfigError, match=r"^models\.qwen\.chat_template: applies to an hf"):
        config_from_dict({"models": python})
    with pytest.raises(ConfigError, match=r"^kv_events\.chat_templates\.qwen: applies"):
        config_from_dict({"kv_events": {"chat_templates": {"qwen": str(template)}}})


def test_a_models_chat_template_reaches_its_tokenizer(tmp_path: Path) -> None:
    from loadtests.engine.sglang_model import write_tokenizer

    write_tokenizer(tmp_path)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    spec = f"hf:{tmp_path}"
    cfg = config_from_dict(
        {"models": {"qwen": {"tokenizer": spec, "chat_template": str(template)}}}
    )
    assert dict(cfg.kv_events.chat_templates) == {"qwen": str(template)}
    choice = load_choice(cfg.kv_events)
    k = cfg.kv_events
    assert choice.per_model["qwen"] is load_cached(spec, str(template), k.max_render_s)
    assert choice.per_model["qwen"] is not load_cached(spec, "", k.max_render_s)


# --- the routing core and the entry a request falls under -----------------------------


def _request(model: str | None = None) -> RouteRequest:
    return RouteRequest(
        kind=ApiKind.CHAT, model=model, stream=False, include_usage=False, prompt_chars=64,
        prompt_tokens=16, block_hashes=[1], routing_key=None, rid=None, body=b"{}",
    )  # fmt: skip


def _registry(*served: tuple[str, frozenset[str]]) -> WorkerRegistry:
    registry = WorkerRegistry(0.5)
    for i, (model, names) in enumerate(served):
        worker, _ = registry.add(f"http://127.0.0.1:{18001 + i}", "sglang")
        worker.flags.clear()
        worker.metadata.model, worker.metadata.models = model, names
    return registry


def _core(config: dict[str, Any]) -> RoutingCore:
    cfg = config_from_dict(config)
    return RoutingCore(
        make_policy_set(cfg.policy),
        PrefixIndex(block_tokens=16.0, max_blocks_per_worker=1000),
        CostModel(),
        random.Random(0),
        model_policies=make_model_policy_sets(cfg),
    )


def test_each_entry_with_a_policy_has_its_own_set_and_the_rest_the_top_level_one() -> None:
    core = _core({"policy": {"name": "min_ttft"}, "models": MODELS})
    assert set(core.model_policies) == {"llama", "qwen"}  # mistral sets timeouts only
    assert core.policies_for("llama").live.name == "round_robin"
    assert core.policies_for("qwen").live.name == "cache_aware"
    assert core.policies_for("mistral") is core.policies
    assert core.policies_for(None) is core.policies
    workers = list(_registry(("llama", frozenset()), ("llama", frozenset())))
    now = 0.0
    assert core.choose(_request(), workers, now).policy.name == "min_ttft"
    picks = [core.choose(_request(), workers, now, model="llama") for _ in range(4)]
    assert {c.policy.name for c in picks} == {"round_robin"}
    assert [c.worker.id for c in picks[:2]] != [picks[0].worker.id] * 2  # it rotates
    # a live change swaps the top-level set only
    top = core.policies
    core.configure(make_policy_set(config_from_dict({"policy": {"name": "random"}}).policy))
    assert core.policies is not top
    assert core.policies_for("llama").live.name == "round_robin"
    assert core.policies_for("mistral").live.name == "random"


def test_a_request_falls_under_an_entry_by_any_name_of_its_workers() -> None:
    routes = ModelRoutes.from_config(
        config_from_dict({"server": {"request_timeout_s": 9}, "models": MODELS})
    )
    registry = _registry(
        ("llama", frozenset({"llama", "/models/llama-3"})),
        ("Qwen/Qwen3", frozenset({"Qwen/Qwen3", "qwen"})),
        ("gemma", frozenset({"gemma"})),
    )
    llama = routes.resolve("llama", registry)
    assert llama is not None and (llama.key, llama.request_timeout_s) == ("llama", 5.0)
    alias = routes.resolve("/models/llama-3", registry)  # another name of llama's workers
    assert alias is llama
    qwen = routes.resolve("Qwen/Qwen3", registry)  # the entry names the alias here
    assert qwen is not None and qwen.key == "qwen"
    assert (qwen.request_timeout_s, qwen.first_byte_timeout_s) == (9.0, 0.0)  # server's, own
    mistral = routes.resolve("mistral", registry)  # an entry no worker serves (yet)
    assert mistral is not None and mistral.request_timeout_s == 2.5
    assert mistral.first_byte_timeout_s is None  # the pool's own
    assert routes.resolve("gemma", registry) is None
    assert routes.resolve("unknown", registry) is None
    assert routes.resolve(None, registry) is None
    empty = ModelRoutes.from_config(config_from_dict({}))
    assert not empty and empty.resolve("llama", registry) is None


def test_live_tuning_changes_the_top_level_set_and_lists_the_per_model_ones() -> None:
    cfg = config_from_dict({"policy": {"name": "min_ttft"}, "models": MODELS})
    core = _core({"policy": {"name": "min_ttft"}, "models": MODELS})
    from prometheus_client import CollectorRegistry

    control = PolicyControl(
        cfg.policy, core, make_policy_set, TuningTelemetry(CollectorRegistry(), (0.1, 1.0))
    )
    control.update({"name": "least_load"}, "test")
    doc = control.describe()
    assert doc["running"]["policy"]["name"] == "least_load"
    assert {m: s["policy"]["name"] for m, s in doc["models"].items()} == {
        "llama": "round_robin",
        "qwen": "cache_aware",
    }
    assert core.policies_for("qwen").live.name == "cache_aware"


# --- the model label --------------------------------------------------------------------


def _record(worker: str = "w1") -> DecisionRecord:
    return DecisionRecord(
        time=0.0, request_id="r", policy="round_robin", worker=worker, reason="prefix_hit",
        candidates=(), prompt_tokens=100, matched_tokens=60,
    )  # fmt: skip


def _samples(t: Telemetry) -> dict[str, list[Any]]:
    text = t.render_prometheus().decode()
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text)}


def _own_context(test: Callable[[], None]) -> Callable[[], None]:
    """begin_request binds the request to the caller's context: run ``test`` in a copy."""

    @functools.wraps(test)
    def run() -> None:
        copy_context().run(test)

    return run


@_own_context
def test_model_label_values_are_served_models_then_other_and_bounded() -> None:
    t = Telemetry()
    assert t.model_label(None) == OTHER
    assert t.model_label("llama") == "llama"
    assert t.model_label("x" * 257) == OTHER  # no unbounded label value
    names = [f"m{i}" for i in range(2 * MAX_MODEL_LABELS)]
    labels = [t.model_label(n) for n in names]
    assert labels[: MAX_MODEL_LABELS - 1] == names[: MAX_MODEL_LABELS - 1]  # llama is one
    assert set(labels[MAX_MODEL_LABELS - 1 :]) == {OTHER}
    assert t.model_label("llama") == "llama"  # once labelled, always
    for i, name in enumerate([*names, "llama", None]):
        rt = t.begin_request(f"r{i}", "/v1/chat/completions")
        rt.model_label = t.model_label(name)
        rt.decided(_record())
        rt.finish(200, reported_cached_tokens=40, ttft_s=0.01)
    fams = _samples(t)
    values = {s.labels["model"] for s in fams["gateway_model_requests"]}
    assert len(values) == MAX_MODEL_LABELS + 1 and OTHER in values
    t.shutdown()


@_own_context
def test_model_families_count_requests_ttft_and_tokens() -> None:
    t = Telemetry()
    for i, (model, status, reported) in enumerate(
        [("llama", 200, 50), ("llama", 200, None), ("qwen", 502, None), (None, 404, None)]
    ):
        rt = t.begin_request(f"r{i}", "/v1/chat/completions")
        rt.model_label = t.model_label(model)
        if status != 404:
            rt.decided(_record())
        rt.finish(status, reported_cached_tokens=reported, ttft_s=0.02 if status == 200 else None)
    fams = _samples(t)

    def value(family: str, name: str, **labels: str) -> float:
        hits = [s.value for s in fams[family] if s.name == name and s.labels == labels]
        assert len(hits) == 1, (name, labels, fams[family])
        return float(hits[0])

    route = {"route": "/v1/chat/completions"}
    assert value("gateway_model_requests", "gateway_model_requests_total",
                 model="llama", status="200", **route) == 2  # fmt: skip
    assert value("gateway_model_requests", "gateway_model_requests_total",
                 model="qwen", status="502", **route) == 1  # fmt: skip
    assert value("gateway_model_requests", "gateway_model_requests_total",
                 model=OTHER, status="404", **route) == 1  # fmt: skip
    ttft = "gateway_model_time_to_first_token_seconds"
    assert value(ttft, f"{ttft}_count", model="llama") == 2
    assert not [s for s in fams[ttft] if s.labels.get("model") == "qwen"]
    prompt = "gateway_model_prompt_tokens"
    assert value(prompt, f"{prompt}_total", model="llama") == 200  # successes only
    cached = "gateway_model_cached_tokens"
    assert value(cached, f"{cached}_total", model="llama", kind="predicted") == 120
    assert value(cached, f"{cached}_total", model="llama", kind="reported") == 50
    rep = "gateway_model_reported_prompt_tokens"
    assert value(rep, f"{rep}_total", model="llama") == 100  # the one that reported
    # the per-worker families keep their label sets
    assert {tuple(sorted(s.labels)) for s in fams["gateway_requests"]} == {
        ("route", "status", "worker")
    }
    t.shutdown()
