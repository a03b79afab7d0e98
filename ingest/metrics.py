"""The inbound side's database gauges, registered with ``project.metrics``."""

from collections.abc import Iterable

from django.db.models import Count
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .models import InboundEvent, InboundState, VerificationFailure


def inbound_gauges(now: float) -> Iterable[Metric]:
    events = GaugeMetricFamily(
        "webhooks_inbound_events",
        "Inbound events waiting or being processed, by state: pending (index "
        "inbound_due), enqueued and processing (inbound_in_flight).",
        labels=["state"],
    )
    events.add_metric(["pending"], InboundEvent.objects.filter(state=InboundState.PENDING).count())
    in_flight = dict(
        InboundEvent.objects.filter(state__in=[InboundState.ENQUEUED, InboundState.PROCESSING])
        .values_list("state")
        .annotate(n=Count("id"))
        .order_by()
    )
    for state in (InboundState.ENQUEUED, InboundState.PROCESSING):
        events.add_metric([state], in_flight.get(state, 0))
    yield events

    # One row per (source, reason), kept by every web process: the fleet-wide count,
    # surviving restarts, unlike the per-process webhooks_inbound_refused_total.
    failures = CounterMetricFamily(
        "webhooks_inbound_verification_failures",
        "Refused inbound requests recorded in the database since the source existed, by "
        "source and reason (signature reasons, too_large, content_type, unparseable_*).",
        labels=["source", "reason"],
    )
    for slug, reason, count in VerificationFailure.objects.values_list(
        "source__slug", "reason", "count"
    ).order_by("source__slug", "reason"):
        failures.add_metric([slug, reason], count)
    yield failures
