"""Locust load test: one user class per workload, streaming OpenAI chat requests.

    locust -f loadtests/locust/locustfile.py --headless -u 8 -r 8 -t 30s \\
        --host http://127.0.0.1:30000 --csv out [--workload NAME] [--workload-arg k=v] [--seed S]
    locust -f loadtests/locust/locustfile.py --host http://127.0.0.1:30000  # web UI: 127.0.0.1:8089

Each request is ``POST /v1/chat/completions`` with ``stream: true`` and
``stream_options.include_usage: true``. Reported per request:

* ``POST <workload>``: the full request (last byte), failures on non-200 or a stream
  without a usage chunk;
* ``TTFT <workload>``: time to the first streamed ``data:`` event, its own entry;
* ``CACHE <workload> cached %``: the request's ``cached_tokens / prompt_tokens`` in
  percent as the "response time" (so the UI shows its mean), cached tokens as the size.

At test stop the token-weighted cached fraction and the requests per worker (from the
gateway's ``x-gateway-worker`` header) are printed and, with ``--csv PREFIX``, written to
``PREFIX_prefix.csv``. The workload comes from ``--workload`` (default
generated-shared-prefix) with ``--workload-arg k=v`` (repeatable) and ``--seed``; naming
a user class on the command line picks its workload instead. Users are closed loop (a
user sends its next script when the previous one is done): a multi-turn session's turns
go in order from one user; other workloads hand out one request at a time, cycling.
The web UI binds to 127.0.0.1 unless ``--web-host`` says otherwise.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, ClassVar

import orjson
from locust import HttpUser, events, task
from locust.env import Environment

from loadtests.locust.stats import PrefixStats, ScriptQueue, parse_sse_usage
from loadtests.workloads import create_workload, workload_names

log = logging.getLogger("loadtests.locust")
STATS = PrefixStats()
_QUEUES: dict[str, ScriptQueue] = {}
DEFAULT_WORKLOAD = "generated-shared-prefix"


def _add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("prefix-gateway workload")
    group.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        choices=workload_names(),
        help="workload to send (ignored when user classes are named)",
    )
    group.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="K=V",
        help="workload parameter, repeatable (e.g. num_groups=8)",
    )
    group.add_argument("--seed", type=int, default=0, help="workload seed")
    group.add_argument("--model", default="default", help="the request's model field")
    parser.set_defaults(web_host="127.0.0.1")


def _fire(**kwargs: Any) -> None:
    """A custom Locust stats entry (``events.request``)."""
    events.request.fire(**kwargs)  # type: ignore[no-untyped-call]


def _queue(name: str, environment: Environment) -> ScriptQueue:
    queue = _QUEUES.get(name)
    if queue is None:
        opts = environment.parsed_options
        args = list(getattr(opts, "workload_arg", None) or [])
        seed = int(getattr(opts, "seed", 0) or 0)
        params: dict[str, Any] = {} if any(a.startswith("seed=") for a in args) else {"seed": seed}
        queue = ScriptQueue(create_workload(name, args, **params))
        _QUEUES[name] = queue
        log.info("workload %s: %d requests", name, len(queue.workload.requests))
    return queue


class WorkloadUser(HttpUser):
    """Sends a workload's requests, streamed; subclasses name the workload."""

    abstract = True
    workload: ClassVar[str] = DEFAULT_WORKLOAD

    @task
    def run_script(self) -> None:
        queue = _queue(self.workload, self.environment)
        model = str(getattr(self.environment.parsed_options, "model", "default"))
        for request in queue.take():
            self._send(request.body(model=model))

    def _send(self, body: dict[str, Any]) -> None:
        name = self.workload
        start = time.perf_counter()
        ttft_ms: float | None = None
        usage: dict[str, Any] | None = None
        size = 0
        with self.client.post(
            "/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"content-type": "application/json"},
            stream=True,
            catch_response=True,
            name=f"{name}",
        ) as response:
            worker = response.headers.get("x-gateway-worker")
            if response.status_code == 200:
                for line in response.iter_lines():
                    size += len(line)
                    is_event, found = parse_sse_usage(line)
                    if is_event and ttft_ms is None:
                        ttft_ms = (time.perf_counter() - start) * 1e3
                    if found is not None:
                        usage = found
            # Locust times a streamed request to its headers; report the last byte.
            response.request_meta["response_time"] = (time.perf_counter() - start) * 1e3
            response.request_meta["response_length"] = size
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}")
            elif usage is None:
                response.failure("stream ended without a usage chunk")
            else:
                response.success()
        if response.status_code != 200:
            return
        if ttft_ms is not None:
            _fire(
                request_type="TTFT",
                name=name,
                response_time=ttft_ms,
                response_length=0,
                exception=None,
                context={},
            )
        STATS.add(usage, worker)
        if usage:
            prompt = int(usage.get("prompt_tokens") or 0)
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            _fire(
                request_type="CACHE",
                name=f"{name} cached %",
                response_time=100.0 * cached / prompt if prompt else 0.0,
                response_length=cached,
                exception=None,
                context={},
            )


def _user_class(workload: str) -> type[WorkloadUser]:
    class_name = "".join(part.capitalize() for part in workload.split("-")) + "User"
    return type(class_name, (WorkloadUser,), {"workload": workload, "abstract": False})


USER_CLASSES = {name: _user_class(name) for name in workload_names()}
globals().update({cls.__name__: cls for cls in USER_CLASSES.values()})


def _pick_workload(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None or getattr(opts, "user_classes", None):
        return
    chosen = USER_CLASSES[getattr(opts, "workload", DEFAULT_WORKLOAD)]
    environment.user_classes = [chosen]


def _reset(environment: Environment, **_: Any) -> None:
    STATS.reset()


def _report(environment: Environment, **_: Any) -> None:
    names = ", ".join(sorted({cls.workload for cls in environment.user_classes}))  # type: ignore[attr-defined]
    print(STATS.summary(names), flush=True)
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        STATS.write_csv(Path(f"{prefix}_prefix.csv"), names)


events.init_command_line_parser.add_listener(_add_arguments)  # type: ignore[no-untyped-call]
events.init.add_listener(_pick_workload)  # type: ignore[no-untyped-call]
events.test_start.add_listener(_reset)  # type: ignore[no-untyped-call]
events.test_stop.add_listener(_report)  # type: ignore[no-untyped-call]
