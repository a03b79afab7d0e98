"""OpenTelemetry tracing (optional): one trace from publish through the outbox and the
queue to every delivery attempt, seen through the SDK's in-memory exporter; and nothing
at all when tracing is off."""

import json

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deliveries import services
from deliveries.core import tracing
from deliveries.jobs.brokers import Message
from deliveries.jobs.models import QueueMessage
from deliveries.jobs.relay import relay_tick
from deliveries.models import Delivery, Event
from deliveries.scheduler import scheduler_tick
from tests.conftest import drain, make_due, run_workers
from tests.receiver import fail_first

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.uninstall()
    provider.shutdown()


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_one_trace_spans_the_publish_the_relay_and_every_attempt(tenant, receiver, exporter):
    receiver.behaviours["/flaky"] = fail_first(1, status=503)
    services.endpoint_create(tenant=tenant, url=receiver.url("/flaky"))
    event = services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"n": 1})
    delivery = Delivery.objects.get(event=event)

    drain()  # first attempt: 503, a retry is scheduled
    make_due()
    drain()  # second attempt: 200

    spans = exporter.get_finished_spans()
    [publish] = by_name(spans, "webhooks.publish")
    relays = by_name(spans, "webhooks.relay")
    delivers = by_name(spans, "webhooks.deliver")
    assert len(relays) == 2 and len(delivers) == 2  # one per dispatch, one per attempt
    trace_id = publish.context.trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}
    # publish → relay → deliver, across the outbox and the queue.
    for relay in relays:
        assert relay.parent.span_id == publish.context.span_id
    relay_ids = {r.context.span_id for r in relays}
    assert {d.parent.span_id for d in delivers} == relay_ids
    assert publish.attributes["webhooks.event_id"] == str(event.id)
    assert [d.attributes["webhooks.outcome"] for d in delivers] == ["retry", "success"]
    assert [d.attributes["http.response.status_code"] for d in delivers] == [503, 200]
    assert {d.attributes["webhooks.delivery_id"] for d in delivers} == {str(delivery.id)}
    # The trace stays inside the service: receivers get no traceparent.
    assert all("traceparent" not in r.headers for r in receiver.received)
    assert Event.objects.get().trace_context.startswith(f"00-{trace_id:032x}-")


def test_a_message_without_a_traceparent_continues_the_events_trace(tenant, receiver, exporter):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    tracing.uninstall()  # a relay running with tracing off
    relay_tick()
    assert "tp" not in json.loads(QueueMessage.objects.get().payload)
    tracing.install(_provider(exporter))

    run_workers()

    [publish] = by_name(exporter.get_finished_spans(), "webhooks.publish")
    [deliver] = by_name(exporter.get_finished_spans(), "webhooks.deliver")
    assert deliver.context.trace_id == publish.context.trace_id
    assert deliver.parent.span_id == publish.context.span_id


def _provider(exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def test_tracing_off_captures_nothing(tenant, receiver):
    assert not tracing.enabled()
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    relay_tick()
    message = Message.decode(QueueMessage.objects.get().payload)
    assert message.traceparent == ""
    assert Event.objects.get().trace_context == ""
    run_workers()
    assert Delivery.objects.get().state == "succeeded"


def test_configure_is_off_by_default_and_refuses_an_unknown_exporter(settings):
    from django.core.exceptions import ImproperlyConfigured

    settings.OTEL_TRACING = False
    tracing.configure()
    assert not tracing.enabled()
    settings.OTEL_TRACING = True
    settings.OTEL_TRACES_EXPORTER = "carrier-pigeon"
    with pytest.raises(ImproperlyConfigured, match="otlp or console"):
        tracing.configure()
    assert not tracing.enabled()
