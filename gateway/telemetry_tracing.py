"""Request tracing with the OpenTelemetry SDK: one SERVER span per gateway request.

Each :class:`Tracing` owns its own ``TracerProvider`` (never the global one), so tests and
several gateways in one process do not share state. The exporter comes from config:
``none`` (default: no provider is built at all and no span object is ever created),
``console`` (JSON lines on stdout), or ``otlp`` (needs ``opentelemetry-exporter-otlp``;
refused at start when it is not importable).

Sampling is parent-based: an incoming W3C ``traceparent`` decides. Otherwise the
gateway draws against ``sampling_ratio`` *before* touching the SDK, so a request that is
not sampled costs one random draw: no span object, no ``traceparent`` sent (its worker
starts its own trace, if it traces at all). A sampled span costs tens of microseconds
(``loadtests/telemetry_bench.py``), hence attributes are set in one call at the end and
``traceparent`` is formatted here rather than by the SDK's propagator.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

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


class Tracing:
    """Starts request spans and propagates their context to workers.

    ``exporter`` overrides the configured one (tests pass an ``InMemorySpanExporter``);
    it is exported synchronously, whereas configured exporters are batched off-thread.
    """

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self.enabled = exporter is not None or config.exporter != "none"
        self._provider: TracerProvider | None = None
        self._propagator = TraceContextTextMapPropagator()
        self._ratio = config.sampling_ratio
        self._rng = random.Random()
        if not self.enabled:
            return
        provider = TracerProvider(
            sampler=ParentBased(ALWAYS_ON),  # roots are drawn in ``start``
            resource=Resource.create({"service.name": config.service_name}),
            shutdown_on_exit=False,
        )
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif config.exporter == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(config.otlp_endpoint)))
        self._provider = provider
        self._tracer = provider.get_tracer("gateway")

    def start(self, name: str, headers: Mapping[str, str] | None) -> Span | None:
        """A SERVER span, child of the caller's ``traceparent`` when it sent one; ``None``
        when this request is not sampled (and has no parent)."""
        parent = None
        if headers is not None and "traceparent" in headers:
            parent = self._propagator.extract(headers)
            if not trace.get_current_span(parent).get_span_context().is_valid:
                parent = None  # malformed: treated as absent
        if parent is None and self._ratio < 1.0 and self._rng.random() >= self._ratio:
            return None
        return self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER)

    def inject(self, span: Span) -> dict[str, str]:
        """Headers (``traceparent``, maybe ``tracestate``) that make a worker's span a child."""
        ctx = span.get_span_context()
        if ctx.trace_state:
            carrier: dict[str, str] = {}
            self._propagator.inject(carrier, context=trace.set_span_in_context(span))
            return carrier
        return {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}

    def shutdown(self) -> None:
        """Flush and stop the exporter. Idempotent."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
