"""Schemathesis against the gateway's OpenAPI document (``gateway.http.openapi``).

A gateway with one simulated worker runs on a background loop for the module; every
operation of ``/openapi.json`` gets a bounded number of generated cases, each checked for
no 5xx, a documented status, a documented content type and a conforming body. The total
number of cases tried is printed at the end (``pytest -s``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.specs.openapi.checks import (  # noqa: E402
    negative_data_rejection,
    positive_data_acceptance,
)

from gateway.http.openapi import build_spec  # noqa: E402
from loadtests.harness.inprocess import BackgroundGateway  # noqa: E402

if TYPE_CHECKING:
    from schemathesis import Case

SCHEMA = schemathesis.openapi.from_dict(build_spec())
# The pytest parametrization over SCHEMA's operations (schemathesis types parametrize() as
# a bare Callable; the decorated test keeps its signature).
parametrize_by_schema: Callable[[Callable[..., None]], Callable[..., None]] = SCHEMA.parametrize()
TRIED = {"cases": 0}


@pytest.fixture(scope="module")
def live() -> Iterator[BackgroundGateway]:
    # generated cases must not register workers (dead ones would turn later cases into
    # 502s): every host is outside this allow-list, so adds get 403
    with BackgroundGateway(server__worker_allowlist=["allowed.invalid"]) as gw:
        yield gw
    print(f"\nschemathesis: {TRIED['cases']} cases tried against the gateway")


@parametrize_by_schema
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_api_conforms(case: Case[Any], live: BackgroundGateway) -> None:
    TRIED["cases"] += 1
    response = case.call(base_url=live.url, timeout=30)
    assert response.status_code < 500, (case, response.status_code, response.text[:300])
    # Not checked: whether a body is accepted: the gateway validates only what routing
    # needs and the worker's own rules decide the rest, so schema-valid bodies may get
    # the worker's 400 and schema-invalid ones its 200. Every other check (no 5xx,
    # documented statuses, content types, headers, response bodies, 405 with Allow for
    # undeclared methods) runs.
    case.validate_response(
        response,
        excluded_checks=[negative_data_rejection, positive_data_acceptance],
    )
