"""OpenTelemetry for every service: one span per request, its context carried in gRPC metadata.

Off by default. `OTEL_TRACES_EXPORTER` turns it on: "console" (spans as JSON on stdout, no extra
package) or "otlp" (needs opentelemetry-exporter-otlp; the endpoint and protocol come from the usual
OTEL_EXPORTER_OTLP_* variables). Without a provider installed, the API's no-op tracer is used and
`inject_metadata()` returns nothing, so the hot path pays almost nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from opentelemetry import context, propagate, trace

from pagedserve.logging import get_logger

log = get_logger(__name__)

_installed = False


def setup_tracing(service_name: str) -> bool:
    """Install a TracerProvider with the exporter OTEL_TRACES_EXPORTER names; whether one was installed."""
    global _installed
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if _installed or exporter_name in ("", "none"):
        return _installed
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    exporter = None
    for name in (n.strip() for n in exporter_name.split(",")):
        if name == "console":
            exporter = ConsoleSpanExporter()
        elif name == "otlp":
            exporter = _otlp_exporter()
        else:
            log.warning("unknown OTEL_TRACES_EXPORTER, tracing stays off", exporter=name)
        if exporter is not None:
            break
    if exporter is None:
        return False
    service = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _installed = True
    log.info("tracing on", exporter=exporter_name, service=service)
    return True


def _otlp_exporter():
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    try:
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER=otlp needs opentelemetry-exporter-otlp; tracing stays off")
        return None
    return OTLPSpanExporter()


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_metadata(ctx: context.Context | None = None) -> tuple[tuple[str, str], ...]:
    """The trace context (default: the current one) as gRPC metadata; empty when no span is active."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return tuple(carrier.items())


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> context.Context:
    """The trace context a caller sent in gRPC metadata (from `context.invocation_metadata()`)."""
    carrier = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        if isinstance(value, str):
            carrier[key.lower()] = value
    return propagate.extract(carrier)
