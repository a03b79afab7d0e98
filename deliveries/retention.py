"""The outbound product's pruners, registered with the pruner of the floor
(``deliveries.core.retention``, which says how a prune runs): terminal deliveries and
their attempts, published outbox rows, events (each kept for its Idempotency-Key's
window, IDEMPOTENCY_KEY_RETENTION, whatever RETENTION_DELIVERIES_DAYS says), loop runs,
resolved incidents, the overview's tallies and expired portal links."""

from datetime import datetime, timedelta

from django.db.models import Exists, OuterRef, Q, QuerySet

from deliveries.core.conf import settings
from deliveries.core.retention import Pruner, days, register

from .jobs.models import LoopRun, Outbox
from .models import (
    AttemptMinute,
    Delivery,
    DeliveryState,
    EndpointHour,
    Event,
    OperationalEvent,
    PortalLink,
)

TERMINAL = (DeliveryState.SUCCEEDED, DeliveryState.DEAD)


# --- The outbound pruners (order matters: deliveries before the events they reference) --


def _deliveries(now: datetime) -> list[QuerySet]:
    cutoff = now - days(settings.RETENTION_DELIVERIES_DAYS)
    # One slice per terminal state, each a range scan of listing_created, oldest first
    # (the delivery row has no index on its creation time). finished_at is checked too:
    # a replayed delivery keeps its old created_at but finished again recently.
    return [
        Delivery.objects.filter(
            state=state, listing__created_at__lt=cutoff, finished_at__lt=cutoff
        ).order_by("listing__created_at")
        for state in TERMINAL
    ]


def _outbox(now: datetime) -> list[QuerySet]:
    cutoff = now - days(settings.RETENTION_DELIVERIES_DAYS)
    # Published rows only: an unpublished row is work the relay still owes. Primary-key
    # order is insertion order, so the oldest come first.
    return [Outbox.objects.filter(published_at__isnull=False, created_at__lt=cutoff).order_by("id")]


def _events(now: datetime) -> list[QuerySet]:
    cutoff = now - days(settings.RETENTION_DELIVERIES_DAYS)
    key_cutoff = now - timedelta(seconds=settings.IDEMPOTENCY_KEY_RETENTION)
    # An event goes once no delivery of it is left (they are pruned first, and a live
    # one keeps it); one with an Idempotency-Key not before the key's window ends.
    return [
        Event.objects.filter(created_at__lt=cutoff)
        .filter(Q(idempotency_key__isnull=True) | Q(created_at__lt=key_cutoff))
        .filter(~Exists(Delivery.objects.filter(event_id=OuterRef("id"))))
        .order_by("created_at")
    ]


def _loop_runs(now: datetime) -> list[QuerySet]:
    cutoff = now - days(settings.RETENTION_OPERATIONS_DAYS)
    return [LoopRun.objects.filter(finished_at__lt=cutoff).order_by("started_at")]


def _operational_events(now: datetime) -> list[QuerySet]:
    cutoff = now - days(settings.RETENTION_OPERATIONS_DAYS)
    return [OperationalEvent.objects.filter(resolved_at__lt=cutoff).order_by("first_seen_at")]


def _tallies(now: datetime) -> list[QuerySet]:
    # By the tallies' keys, which lead with the minute and the hour. The overview reads
    # the last 24 hours; a month is kept for a look back.
    cutoff = now - days(settings.RETENTION_OPERATIONS_DAYS)
    return [
        AttemptMinute.objects.filter(minute__lt=cutoff).order_by("minute"),
        EndpointHour.objects.filter(hour__lt=cutoff).order_by("hour"),
    ]


register(Pruner("deliveries", _deliveries))
register(Pruner("outbox", _outbox))
register(Pruner("events", _events))
register(Pruner("loop_runs", _loop_runs))


def _portal_links(now: datetime) -> list[QuerySet]:
    # A day past its expiry a link is of no use, not even to explain a refusal.
    return [PortalLink.objects.filter(expires_at__lt=now - days(1)).order_by("expires_at")]


register(Pruner("operational_events", _operational_events))
register(Pruner("tallies", _tallies))
register(Pruner("portal_links", _portal_links))
