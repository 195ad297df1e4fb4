"""deploy/: the Grafana dashboard and the Prometheus alerting rules name only what the
gateway exports.

Every PromQL expression in ``deploy/prometheus/alerts.yaml`` and ``deploy/grafana/gateway.json``
(panel targets, and the selector inside each template variable's ``label_values()``) is
parsed with ``promql-parser`` (Python bindings of GreptimeTeam's PromQL parser, in Rust);
Grafana's interval macros are replaced by durations first, and any other ``$`` outside a
quoted label value fails the parse. Each vector selector's metric name must be a series
name of a live ``/metrics`` scrape: an in-process gateway in front of two simulated workers,
after traffic that causes upstream errors, a retry and an ejection, with a Redis URL that
answers nowhere (so the shared-state series are exported, degraded). Series names follow
each family's type (counters ``_total``; histograms ``_bucket``, ``_sum``, ``_count``), so a
family with no sample yet still counts. Label matchers must name labels the scraped series
carry, or ``instance``/``job`` (added by Prometheus), for series with samples in the scrape.
A metric or label renamed in the gateway, or a typo in a rule or panel, fails here.

With ``promtool`` (``make test`` unpacks it from Debian's ``prometheus`` package): the rule
file passes ``promtool check rules``, and each rule's expression, read from the file, is
evaluated on synthetic series by ``promtool test rules``: exactly the expected series alert.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtests.harness.inprocess import run_gateway, sim_faults
from loadtests.harness.ports import free_port
from simulator.fleet import SimConfig, SimulatedFleet

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gateway.json"
TARGET_LABELS = frozenset({"instance", "job"})  # added by Prometheus to every scraped series
# Grafana's built-in interval macros, as durations PromQL accepts.
GRAFANA_MACROS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>\w+)\s*\)\s*$")


# -- what the gateway exports ------------------------------------------------------------


@dataclass(frozen=True)
class Exported:
    """Series names of a scrape (by family type) and the label names seen per series."""

    names: frozenset[str]
    labels: dict[str, frozenset[str]]


def exported_from(text: str) -> Exported:
    """The series names and their label names in a Prometheus text exposition."""
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("", "_sum", "_count"),
        }.get(fam.type, ("",))
        names.update(fam.name + s for s in suffixes)
        for sample in fam.samples:
            names.add(sample.name)
            labels.setdefault(sample.name, set()).update(sample.labels)
    return Exported(frozenset(names), {k: frozenset(v) for k, v in labels.items()})


async def _scrape() -> str:
    """``/metrics`` of a gateway in front of two simulated workers, after traffic."""
    system = "You are a support assistant for a cloud provider. Answer briefly. " * 4
    async with (
        await SimulatedFleet.start(2, SimConfig(speed=50.0)) as fleet,
        run_gateway(
            fleet.urls,
            redis__url=f"redis://127.0.0.1:{free_port()}/0",  # nobody listens: degraded
            outlier__consecutive_5xx=1,
            policy__shadows=["cache_aware"],  # round_robin's index matched: routing capture
        ) as gw,
        aiohttp.ClientSession() as session,
    ):
        await sim_faults(session, fleet.urls[1], error_rate=1.0)  # 5xx: error, retry, eject
        for i in range(8):
            body = {"model": "sim-model", "max_tokens": 4, "stream": i % 2 == 0,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"question {i}"}]}  # fmt: skip
            async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
        async with session.get(gw.url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


@pytest.fixture(scope="module")
def exported() -> Exported:
    return exported_from(asyncio.run(_scrape()))


# -- what deploy/ uses ---------------------------------------------------------------------


@dataclass(frozen=True)
class Selector:
    name: str | None  # None: a selector without a metric name
    matchers: tuple[str, ...]  # label names matched on


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of ``expr`` (ranges included); ValueError if it does not parse."""
    found: list[Selector] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            labels = tuple(m.name for m in node.matchers.matchers)
            name = node.name
            if name is None:  # {__name__="x"}
                name = next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            found.append(Selector(name, tuple(n for n in labels if n != "__name__")))

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return found


def grafana_promql(expr: str) -> str:
    """A panel's expression with Grafana's interval macros replaced by durations."""
    for macro, duration in GRAFANA_MACROS.items():
        expr = expr.replace(macro, duration)
    return expr


def _targets(node: Any) -> list[tuple[str, str]]:
    """(panel title and refId, expr) of every target under ``node`` (rows' panels too)."""
    if isinstance(node, list):
        return [t for item in node for t in _targets(item)]
    if not isinstance(node, dict):
        return []
    out = [
        (f"{node.get('title', '?')} {t.get('refId', '?')}", t["expr"])
        for t in node.get("targets", [])
        if "expr" in t
    ]
    for key, value in node.items():
        if key != "targets":
            out.extend(_targets(value))
    return out


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and template variable of the dashboard."""
    doc = json.loads(DASHBOARD.read_text())
    out = [(f"grafana panel {w}", grafana_promql(e)) for w, e in _targets(doc)]
    for var in doc["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query)
        assert m, f"variable {var['name']}: only label_values(selector, label) is checked"
        out.append((f"grafana variable {var['name']}", m["selector"]))
    return out


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def all_expressions() -> list[tuple[str, str]]:
    alerts = [(f"alert {r['alert']}", str(r["expr"])) for r in alert_rules()]
    return alerts + dashboard_expressions()


EXPRESSIONS = all_expressions()


# -- the checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[w for w, _ in EXPRESSIONS])
def test_expression_names_only_exported_metrics(where: str, expr: str, exported: Exported) -> None:
    found = selectors(expr)
    assert found, f"{where}: no metric in {expr!r}"
    for sel in found:
        assert sel.name is not None, f"{where}: a selector without a metric name in {expr!r}"
        assert sel.name in exported.names, f"{where}: {sel.name} is not exported ({expr!r})"
        seen = exported.labels.get(sel.name)
        if seen is not None:  # the scrape has samples of it: its labels are known
            unknown = set(sel.matchers) - seen - TARGET_LABELS
            assert not unknown, f"{where}: {sel.name} has no label {sorted(unknown)}"


def test_the_scrape_covers_what_the_files_use(exported: Exported) -> None:
    """Non-vacuous: the files use many exported names, and label checks ran on most."""
    used = {s.name for _, e in EXPRESSIONS for s in selectors(e)}
    assert len(used) >= 25, sorted(used, key=str)  # a nameless selector: None
    unlabelled = {n for n in used if n not in exported.labels}
    # Families with no sample in this scrape (slot waits need slot-bound workers).
    assert unlabelled <= {"gateway_slot_wait_seconds_bucket"}, unlabelled


def test_checker_rejects_unknown_names_and_labels(exported: Exported) -> None:
    """The check above fails on a renamed metric, a wrong label or a stray variable."""
    [sel] = selectors('rate(gateway_request_total{worker="w"}[5m])')  # "requests" misspelt
    assert sel.name not in exported.names
    [sel] = selectors('gateway_index_mode{state="degraded"}')
    assert "state" not in exported.labels["gateway_index_mode"]
    [sel] = selectors('{__name__="gateway_worker_healthy"}')
    assert sel.name == "gateway_worker_healthy" and sel.matchers == ()
    with pytest.raises(ValueError):
        selectors("rate(gateway_requests_total[$__unknown])")
    assert "gateway_requests_total" in exported.names  # counters by their series name
    assert "gateway_time_to_first_token_seconds" not in exported.names  # histograms: suffixed


def test_alert_rules_are_complete() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), names
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    used = {r["alert"]: {s.name for s in selectors(str(r["expr"]))} for r in rules}
    topics = {  # the list: each has a rule on the metric that shows it
        "hit rate captured vs available": "gateway_worker_reported_cached_tokens_total",
        "TTFT": "gateway_time_to_first_token_seconds_bucket",
        "ejections": "gateway_worker_ejections_total",
        "degraded shared state": "gateway_shared_state_degraded",
        "degraded exact mode": "gateway_index_mode",
        "admission rejections": "gateway_admission_rejections_total",
        "worker health": "gateway_worker_healthy",
    }
    for topic, metric in topics.items():
        assert any(metric in names_ for names_ in used.values()), topic


def test_dashboard_is_well_formed_and_covers_the_topics() -> None:
    doc = json.loads(DASHBOARD.read_text())
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    assert doc["uid"] and doc["title"]
    for p in panels:
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
    used = {s.name for _, e in dashboard_expressions() for s in selectors(e)}
    for metric in (
        "gateway_worker_reported_cached_tokens_total",  # captured
        "gateway_worker_reported_prompt_tokens_total",
        "gateway_worker_predicted_cached_tokens_total",  # available
        "gateway_worker_prompt_tokens_total",
        "gateway_time_to_first_token_seconds_bucket",
        "gateway_worker_ejections_total",
        "gateway_shared_state_degraded",
        "gateway_index_mode",
        "gateway_admission_rejections_total",
        "gateway_worker_healthy",
        "gateway_worker_health_flag",
    ):
        assert metric in used, metric


# `make test` unpacks promtool from Debian's prometheus package into .cache/promtool
# (unpacked, never installed: no Prometheus service can start from it).
_UNPACKED = Path(__file__).resolve().parents[2] / ".cache/promtool/usr/bin/promtool"
PROMTOOL = shutil.which("promtool") or (str(_UNPACKED) if _UNPACKED.exists() else None)
NO_PROMTOOL = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool absent (make promtool-deps unpacks it)"
)


@NO_PROMTOOL
def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


# Which series each rule's expression selects, on synthetic series (1-minute samples):
# (alert, input series -> values in promtool's expanding notation, minute of evaluation,
# the (instance, worker) pairs expected to alert; "" where the expression has no worker).
ALERT_CASES: list[tuple[str, dict[str, str], int, set[tuple[str, str]]]] = [
    ("GatewayNoHealthyWorker", {
        'gateway_worker_healthy{instance="gw1",worker="a"}': "0x5",
        'gateway_worker_healthy{instance="gw1",worker="b"}': "0x5",
        'gateway_worker_healthy{instance="gw2",worker="a"}': "1x5",
        'gateway_worker_healthy{instance="gw2",worker="b"}': "0x5",
    }, 5, {("gw1", "")}),
    ("GatewayWorkerUnhealthy", {  # a is drained on purpose, b is sick, c is fine
        'gateway_worker_healthy{instance="gw1",worker="a"}': "0x5",
        'gateway_worker_health_flag{instance="gw1",worker="a",flag="draining"}': "1x5",
        'gateway_worker_healthy{instance="gw1",worker="b"}': "0x5",
        'gateway_worker_health_flag{instance="gw1",worker="b",flag="draining"}': "0x5",
        'gateway_worker_healthy{instance="gw1",worker="c"}': "1x5",
        'gateway_worker_health_flag{instance="gw1",worker="c",flag="draining"}': "0x5",
    }, 5, {("gw1", "b")}),
    ("GatewayWorkerEjectionsRepeated", {  # a: 4 ejections in 15 min, b: 1
        'gateway_worker_ejections_total{instance="gw1",worker="a"}': "0 1 2 3 4x15",
        'gateway_worker_ejections_total{instance="gw1",worker="b"}': "0 1x18",
    }, 15, {("gw1", "a")}),
    ("GatewayUpstreamErrorsHigh", {  # gw1: 10 of 100 attempts fail, gw2: 1 of 100
        'gateway_upstream_errors_total{instance="gw1",worker="a",kind="http_5xx"}': "0+10x10",
        'gateway_routing_decisions_total{instance="gw1",policy="p",reason="r"}': "0+100x10",
        'gateway_upstream_errors_total{instance="gw2",worker="a",kind="connect"}': "0+1x10",
        'gateway_routing_decisions_total{instance="gw2",policy="p",reason="r"}': "0+100x10",
    }, 10, {("gw1", "")}),
    ("GatewaySharedStateDegraded", {
        'gateway_shared_state_degraded{instance="gw1"}': "1x5",
        'gateway_shared_state_degraded{instance="gw2"}': "0x5",
    }, 5, {("gw1", "")}),
    ("GatewayExactModeDegraded", {
        'gateway_index_mode{instance="gw1",worker="a",mode="degraded"}': "1x5",
        'gateway_index_mode{instance="gw1",worker="a",mode="exact"}': "0x5",
        'gateway_index_mode{instance="gw1",worker="b",mode="degraded"}': "0x5",
        'gateway_index_mode{instance="gw1",worker="b",mode="exact"}': "1x5",
    }, 5, {("gw1", "a")}),
    ("GatewayAdmissionRejecting", {  # gw1: 10 of 100 refused, gw2: none
        'gateway_admission_rejections_total{instance="gw1",reason="queue_full"}': "0+10x10",
        'gateway_requests_total{instance="gw1",worker="none",route="/r",status="429"}': "0+10x10",
        'gateway_requests_total{instance="gw1",worker="a",route="/r",status="200"}': "0+90x10",
        'gateway_admission_rejections_total{instance="gw2",reason="queue_full"}': "0x10",
        'gateway_requests_total{instance="gw2",worker="a",route="/r",status="200"}': "0+90x10",
    }, 10, {("gw1", "")}),
    ("GatewayTimeToFirstTokenHigh", {  # gw1: every TTFT in (1, 2.5] s; gw2: all under 1 s
        'gateway_time_to_first_token_seconds_bucket{instance="gw1",worker="a",le="1.0"}': "0x10",
        'gateway_time_to_first_token_seconds_bucket{instance="gw1",worker="a",le="2.5"}':
            "0+60x10",
        'gateway_time_to_first_token_seconds_bucket{instance="gw1",worker="a",le="+Inf"}':
            "0+60x10",
        'gateway_time_to_first_token_seconds_bucket{instance="gw2",worker="a",le="1.0"}':
            "0+60x10",
        'gateway_time_to_first_token_seconds_bucket{instance="gw2",worker="a",le="2.5"}':
            "0+60x10",
        'gateway_time_to_first_token_seconds_bucket{instance="gw2",worker="a",le="+Inf"}':
            "0+60x10",
    }, 10, {("gw1", "")}),
    ("GatewayCapturedHitRateBelowAvailable", {
        # gw1: captured 10 %, available 80 %: fires. gw2: captured 70 % of the half of its
        # prompts with a report (streams without usage), available 80 %: silent (over all
        # prompts it would read 35 %). gw3: no worker ever reported: no series, silent.
        **{
            f'gateway_worker_{name}_total{{instance="{gw}",worker="a"}}': f"0+{per_min}x20"
            for gw, figures in {
                "gw1": {"reported_cached_tokens": 10, "reported_prompt_tokens": 100},
                "gw2": {"reported_cached_tokens": 35, "reported_prompt_tokens": 50},
                "gw3": {},
            }.items()
            for name, per_min in {
                **figures, "predicted_cached_tokens": 80, "prompt_tokens": 100,
            }.items()
        },
    }, 20, {("gw1", "")}),
]  # fmt: skip


def test_every_alert_has_a_case() -> None:
    assert {a for a, *_ in ALERT_CASES} == {r["alert"] for r in alert_rules()}


@NO_PROMTOOL
def test_alert_expressions_select_the_right_series(tmp_path: Path) -> None:
    """promtool evaluates each rule's own expression (read from alerts.yaml) on synthetic
    series: exactly the expected (instance, worker) pairs come out."""
    exprs = {r["alert"]: str(r["expr"]) for r in alert_rules()}
    tests = []
    for alert, series, minute, expected in ALERT_CASES:
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": k, "values": v} for k, v in series.items()],
                "promql_expr_test": [
                    {
                        "expr": f"count by (instance, worker) ({exprs[alert]})",
                        "eval_time": f"{minute}m",
                        "exp_samples": [
                            {
                                "labels": "{"
                                + ",".join(
                                    f'{k}="{v}"' for k, v in (("instance", gw), ("worker", w)) if v
                                )
                                + "}",
                                "value": 1,
                            }
                            for gw, w in sorted(expected)
                        ],
                    }
                ],
            }
        )
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump({"evaluation_interval": "1m", "tests": tests}))
    done = subprocess.run(
        [str(PROMTOOL), "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
