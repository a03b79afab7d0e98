"""Optional OpenTelemetry tracing across publish, relay and worker.

Off by default. It is on when ``OTEL_TRACING`` is true and the OpenTelemetry SDK is
installed (``requirements/otel.txt``), or when a test or the host application hands a
tracer provider to ``install``. Off, every call site costs one check of a module global
(``enabled()``): nothing is imported, no context is captured, no column is written.

One trace follows one event from publish to every delivery attempt, across the
outbox/queue hop, in W3C ``traceparent`` form:

- ``publish_event`` opens a ``webhooks.publish`` span (a child of the caller's span, if
  any) and stores its traceparent on the event (``Event.trace_context``).
- the relay (a broker outside the database, or one still run beside the database
  broker) opens a ``webhooks.relay`` span per delivery it publishes, a child of the
  event's, and carries that span's traceparent in the queue message (``tp``, message
  format version 2);
- the worker opens a ``webhooks.deliver`` span per attempt, a child of the message's
  traceparent, or of the event's for a message that carries none and for an outbox row
  the worker took directly (the database broker: no relay, no hop of its own).

The scheduler is a batch clock over many events and opens no spans.
"""

import logging
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from deliveries.core.conf import settings

logger = logging.getLogger("deliveries.tracing")

TRACER_NAME = "trusty-webhooks"

_tracer: Any = None  # an opentelemetry Tracer while tracing is on


def enabled() -> bool:
    return _tracer is not None


def install(provider: Any) -> None:
    """Trace with ``provider`` (an ``opentelemetry.sdk.trace.TracerProvider``)."""
    global _tracer
    _tracer = provider.get_tracer(TRACER_NAME)


def uninstall() -> None:
    global _tracer
    _tracer = None


def configure() -> None:
    """At start (``DeliveriesConfig.ready``): turn tracing on if ``OTEL_TRACING`` says so.

    A provider the host already set globally (``opentelemetry-instrument``, the
    application's own setup) is used as it is. Otherwise an SDK provider is made with
    the exporter ``OTEL_TRACES_EXPORTER`` names: ``otlp`` (needs the
    ``opentelemetry-exporter-otlp-proto-http`` package; endpoint from the standard
    ``OTEL_EXPORTER_OTLP_*`` variables) or ``console``."""
    if not settings.OTEL_TRACING:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        logger.warning(
            "OTEL_TRACING is on but the OpenTelemetry SDK is not installed; tracing is off",
            extra={"action": "tracing.unavailable"},
        )
        return
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(
            resource=Resource.create({"service.name": settings.OTEL_SERVICE_NAME})
        )
        provider.add_span_processor(BatchSpanProcessor(_exporter(ConsoleSpanExporter)))
        trace.set_tracer_provider(provider)
    install(provider)


def _exporter(console):
    name = settings.OTEL_TRACES_EXPORTER
    if name == "console":
        return console()
    if name != "otlp":
        raise ImproperlyConfigured(f"OTEL_TRACES_EXPORTER must be otlp or console, not {name!r}")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ImproperlyConfigured(
            "OTEL_TRACES_EXPORTER=otlp needs the opentelemetry-exporter-otlp-proto-http "
            "package (or set OTEL_TRACES_EXPORTER=console, or OTEL_TRACING=0)"
        ) from exc
    return OTLPSpanExporter()


def _parent(traceparent: str):
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(
        {"traceparent": traceparent} if traceparent else {}
    )


def _traceparent(span) -> str:
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return carrier.get("traceparent", "")


def start_span(name: str, *, parent: str = "", kind: str = "INTERNAL", **attributes: Any):
    """A span (call only when ``enabled()``): a child of the W3C ``parent`` if given, else
    of the current span. End it with ``span.end()``."""
    from opentelemetry.trace import SpanKind

    context = _parent(parent) if parent else None
    return _tracer.start_span(
        name,
        context=context,
        kind=SpanKind[kind],
        attributes={f"webhooks.{k}": v for k, v in attributes.items() if v is not None},
    )


def traceparent_of(span) -> str:
    return _traceparent(span)


def use_span(span):
    """Make ``span`` current for a ``with`` block, ending it at the end of the block (an
    exception is recorded on it)."""
    from opentelemetry.trace import use_span as otel_use_span

    return otel_use_span(span, end_on_exit=True)
