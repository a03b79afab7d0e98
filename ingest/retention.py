"""The inbound pruner, registered with ``deliveries.retention``: finished inbound events
(and their handler runs) after RETENTION_INBOUND_DAYS, but never before
INBOUND_DEDUPE_WINDOW, because the row is the (source, event_id) identity that makes a
provider's late retry a duplicate instead of a second processing."""

from datetime import datetime, timedelta

from django.db.models import QuerySet

from deliveries.core.retention import Pruner
from ingest.conf import settings

from .models import InboundEvent, InboundState, Source

FINISHED = (
    InboundState.PROCESSED,
    InboundState.SKIPPED,
    InboundState.DEAD,
    InboundState.REJECTED,
)


def inbound_cutoff(now: datetime) -> datetime:
    keep = max(settings.RETENTION_INBOUND_DAYS * 86400, settings.INBOUND_DEDUPE_WINDOW)
    return now - timedelta(seconds=keep)


def _inbound_events(now: datetime) -> list[QuerySet]:
    cutoff = inbound_cutoff(now)
    # One slice per source: a range scan of inbound_source_received (source, -received_at).
    return [
        InboundEvent.objects.filter(
            source_id=source_id, state__in=FINISHED, received_at__lt=cutoff
        ).order_by("received_at")
        for source_id in Source.objects.order_by("id").values_list("id", flat=True)
    ]


inbound_pruner = Pruner("inbound_events", _inbound_events)
