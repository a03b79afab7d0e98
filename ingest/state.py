"""The inbound events' state machine outside the worker's statements: the scheduler's
sweeps (admit due events, expire leases, recover lost dispatches), the guarded
transition out of ``processing`` and the operators' reprocessing. The worker's lease and
completion are statements (``ingest.statements``); ``ingest.worker`` runs the handlers.

    enqueued ──lease──▶ processing ──finish──▶ processed | skipped | dead
       ▲                    │         └──retry──▶ pending ──admit──▶ enqueued
       └──lost dispatch─────┴──lease expired──▶ pending
"""

import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from deliveries.core.audit import audit
from ingest.conf import settings

from .models import InboundEvent, InboundState
from .statements import write_outbox


def inbound_schedule(now: datetime, page_size: int) -> tuple[Counter, bool]:
    """Admit due pending events, expire leases, recover lost dispatches."""
    counts: Counter = Counter()
    lease_cutoff = now
    stale_cutoff = now - timedelta(seconds=settings.SCHEDULER_STALE_ENQUEUED_SECONDS)
    with transaction.atomic():
        expired = list(
            InboundEvent.objects.filter(state=InboundState.PROCESSING, lease_until__lt=lease_cutoff)
            .select_for_update(skip_locked=True)
            .values_list("id", flat=True)[:page_size]
        )
        lost = list(
            InboundEvent.objects.filter(state=InboundState.ENQUEUED, enqueued_at__lt=stale_cutoff)
            .select_for_update(skip_locked=True)
            .values_list("id", flat=True)[:page_size]
        )
        InboundEvent.objects.filter(id__in=expired, state=InboundState.PROCESSING).update(
            state=InboundState.PENDING,
            next_attempt_at=now,
            lease_until=None,
            lease_token=None,
            last_error="lease expired",
        )
        InboundEvent.objects.filter(id__in=lost, state=InboundState.ENQUEUED).update(
            state=InboundState.PENDING, next_attempt_at=now
        )
        counts["lease_expired"], counts["transport_lost"] = len(expired), len(lost)
    with transaction.atomic():
        # Uses the partial index inbound_due.
        due = list(
            InboundEvent.objects.filter(state=InboundState.PENDING, next_attempt_at__lte=now)
            .select_for_update(skip_locked=True)
            .order_by("next_attempt_at")
            .values_list("id", flat=True)[:page_size]
        )
        if due:
            InboundEvent.objects.filter(id__in=due, state=InboundState.PENDING).update(
                state=InboundState.ENQUEUED,
                enqueued_at=now,
                dispatch_count=F("dispatch_count") + 1,
            )
            write_outbox(due, now)
        counts["enqueued"] = len(due)
    return counts, len(due) >= page_size


def finish(
    ids,
    token,
    *,
    state,
    delay: float = 0.0,
    error: str = "",
    count_attempt: bool = True,
    at: datetime | None = None,
) -> int:
    """The guarded transition out of ``processing``, for the lease holder only; back to
    ``pending``, the event is due after ``delay`` seconds, or ``at`` if given."""
    now = timezone.now()
    fields = {"state": state, "lease_until": None, "lease_token": None, "last_error": error}
    if state == InboundState.PENDING:
        fields["next_attempt_at"] = at or now + timedelta(seconds=delay)
        if not count_attempt:
            fields["attempt_count"] = F("attempt_count") - 1
    else:
        fields["processed_at"] = now
    return InboundEvent.objects.filter(
        id__in=ids, state=InboundState.PROCESSING, lease_token=token
    ).update(**fields)


def inbound_reprocess(
    *,
    event_ids: Sequence[uuid.UUID],
    actor=None,
    action: str = "inbound.reprocess",
    target: str = "inbound_event",
) -> int:
    """Process events again (staff), audited as ``action`` on ``target`` (the inbound
    emails' page audits its own); the handlers must be idempotent for it. Rejected and
    unfinished events are left as they are."""
    now = timezone.now()
    with transaction.atomic():
        n = InboundEvent.objects.filter(
            id__in=list(event_ids),
            state__in=[InboundState.PROCESSED, InboundState.SKIPPED, InboundState.DEAD],
        ).update(state=InboundState.PENDING, next_attempt_at=now, attempt_count=0)
        audit(
            actor=actor,
            action=action,
            target=target,
            count=n,
            ids=[str(i) for i in list(event_ids)[:100]],
        )
    return n
