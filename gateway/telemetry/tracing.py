"""Request tracing with the OpenTelemetry SDK: one SERVER span per gateway request.

Each :class:`Tracing` owns its span processor and exporter (never the global tracer
provider), so tests and several gateways in one process do not share state. The exporter
comes from config: ``none`` (default: nothing is built and no span object is ever
created), ``console`` (JSON on stdout), or ``otlp`` (needs ``opentelemetry-exporter-otlp``;
refused at start when it is not importable).

Sampling is parent-based: a caller's valid W3C ``traceparent`` decides (a caller that
did not sample gets no gateway span; its header still reaches the worker, as the proxy
forwards client headers). Otherwise the gateway draws against ``sampling_ratio``; an
unsampled request costs one random draw.

Cost: the SDK's ``Tracer.start_span`` → ``Span.end`` path (sampler, per-span locks,
attribute validation, processor callbacks) costs ≈ 30 µs per span on the project's
2-core machine and ≈ 130 µs in a loaded gateway (``loadtests/micro/telemetry.py``). A
request span here carries no events and is never read before it ends, so the gateway
keeps a :class:`SpanHandle` (ids and start time) while the request runs and builds the
SDK's ``ReadableSpan`` once, at the end, handing it to the configured span processor
(``SimpleSpanProcessor`` for an injected exporter, ``BatchSpanProcessor`` otherwise) and
so to any SDK exporter. ``ReadableSpan``'s docstring discourages direct construction:
the tests in ``tests/unit/test_telemetry_tracing.py`` run every exporter path, so an SDK
change that breaks this shows there.
"""

from __future__ import annotations

import importlib
import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState

ExporterName = Literal["none", "console", "otlp"]
EXPORTERS: tuple[str, ...] = ("none", "console", "otlp")
# Tried in order for exporter "otlp"; the first importable one wins.
_OTLP_MODULES = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
)


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Tracing settings; validated on construction (the message names the key)."""

    exporter: ExporterName = "none"
    sampling_ratio: float = 1.0
    service_name: str = "prefix-gateway"
    otlp_endpoint: str | None = None  # None: the exporter's default / OTEL_* env vars

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(
                f"tracing.exporter: expected one of {', '.join(EXPORTERS)}, got {self.exporter!r}"
            )
        if not 0.0 <= self.sampling_ratio <= 1.0:
            raise ValueError(f"tracing.sampling_ratio: expected 0..1, got {self.sampling_ratio!r}")


def _otlp_exporter(endpoint: str | None) -> SpanExporter:
    for name in _OTLP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        kwargs: dict[str, Any] = {} if endpoint is None else {"endpoint": endpoint}
        exporter: SpanExporter = module.OTLPSpanExporter(**kwargs)
        return exporter
    raise ValueError(
        "tracing.exporter: 'otlp' needs the opentelemetry-exporter-otlp package, "
        "which is not installed"
    )


_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def parse_traceparent(value: str) -> SpanContext | None:
    """A caller's W3C ``traceparent`` as a remote span context; ``None`` when malformed."""
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None or m.group(1) == "ff" or (m.group(1) == "00" and m.group(5)):
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(m[4], 16)))


class SpanHandle:
    """A request span while it runs: ids, parent and start time; nothing else is built."""

    __slots__ = ("parent", "span_id", "start_ns", "trace_id", "tracestate")

    def __init__(
        self, trace_id: int, span_id: int, parent: SpanContext | None, tracestate: str | None
    ) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent = parent
        self.tracestate = tracestate  # the caller's, forwarded unchanged
        self.start_ns = time.time_ns()

    @property
    def traceparent(self) -> str:
        """This span as a W3C ``traceparent`` (sampled)."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-01"


class Tracing:
    """Starts request spans, propagates them to workers, and exports them when they end.

    ``exporter`` overrides the configured one (tests pass an ``InMemorySpanExporter``);
    it is exported synchronously, whereas configured exporters are batched off-thread.
    """

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self.enabled = exporter is not None or config.exporter != "none"
        self._ratio = config.sampling_ratio
        self._rng = random.Random()
        self._processor: SpanProcessor | None = None
        if not self.enabled:
            return
        if exporter is not None:
            self._processor = SimpleSpanProcessor(exporter)
        elif config.exporter == "console":
            self._processor = BatchSpanProcessor(ConsoleSpanExporter())
        else:
            self._processor = BatchSpanProcessor(_otlp_exporter(config.otlp_endpoint))
        self._resource = Resource.create({"service.name": config.service_name})
        self._scope = InstrumentationScope("gateway")

    def start(self, headers: Mapping[str, str] | None) -> SpanHandle | None:
        """A span for this request, child of the caller's ``traceparent`` when valid;
        ``None`` when it is not sampled."""
        parent = None
        tracestate = None
        if headers is not None and "traceparent" in headers:
            parent = parse_traceparent(headers["traceparent"])
        if parent is not None:
            if not parent.trace_flags.sampled:
                return None
            tracestate = headers.get("tracestate") if headers is not None else None
            trace_id = parent.trace_id
        elif self._ratio < 1.0 and self._rng.random() >= self._ratio:
            return None
        else:
            trace_id = self._rng.getrandbits(128) or 1
        return SpanHandle(trace_id, self._rng.getrandbits(64) or 1, parent, tracestate)

    @staticmethod
    def inject(handle: SpanHandle) -> dict[str, str]:
        """Headers (``traceparent``, and the caller's ``tracestate``) for the worker."""
        if handle.tracestate:
            return {"traceparent": handle.traceparent, "tracestate": handle.tracestate}
        return {"traceparent": handle.traceparent}

    def end(self, handle: SpanHandle, name: str, attributes: dict[str, Any]) -> None:
        """Build the finished span and hand it to the exporter's processor."""
        if self._processor is None:
            return
        state = TraceState.from_header([handle.tracestate]) if handle.tracestate else None
        span = ReadableSpan(
            name=name,
            context=SpanContext(
                handle.trace_id, handle.span_id, False, trace_flags=_SAMPLED, trace_state=state
            ),
            parent=handle.parent,
            resource=self._resource,
            attributes=attributes,
            kind=SpanKind.SERVER,
            start_time=handle.start_ns,
            end_time=time.time_ns(),
            instrumentation_scope=self._scope,
        )
        self._processor.on_end(span)

    def shutdown(self) -> None:
        """Flush and stop the exporter. Idempotent."""
        if self._processor is not None:
            self._processor.shutdown()
            self._processor = None
