"""The relay: publishes committed outbox rows to the broker, page by page. It is the
bridge from the transaction that enqueued a job to the queue transport; with the
database broker the queue is a table beside the outbox and the bridge is one
transaction."""

from dataclasses import replace
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from deliveries import tracing
from deliveries.conf import settings

from . import broker, kinds
from .faults import crash_point
from .loop import Tick
from .models import Outbox
from .sql import bound_cursor


def relay_tick(*, page_size: int | None = None, b=None) -> Tick:
    """Publish one page of unpublished outbox rows to the broker.

    With the database broker (the default) the queue is a table beside the outbox: one
    transaction takes the page, marks it published and inserts its messages, so a relay
    that dies anywhere leaves the page as it found it, at once available to another relay.

    With any other broker the page is claimed for ``RELAY_CLAIM_SECONDS`` in a short
    transaction, published with no transaction open, then marked published. A relay that
    dies in between leaves the rows to be published again after the claim runs out: the
    broker may then carry two copies of a message, which the workers' lease guard turns
    into one attempt.
    """
    page_size = page_size or settings.RELAY_PAGE_SIZE
    b = b or broker.get_broker()
    now = timezone.now()
    tick = Tick()
    if isinstance(b, broker.DatabaseBroker):
        with transaction.atomic():
            rows = _outbox_page(now, page_size, "published_at", now)
            if rows:
                _publish_page(b, rows)
    else:
        until = now + timedelta(seconds=settings.RELAY_CLAIM_SECONDS)
        rows = _outbox_page(now, page_size, "claimed_until", until)
        if rows:
            _publish_page(b, rows)
            _mark_published([r[0] for r in rows], timezone.now())
    if not rows:
        tick.idle = not Outbox.objects.filter(published_at__isnull=True).exists()
        return tick
    tick.counts["published"] = len(rows)
    tick.busy = len(rows) >= page_size
    tick.soon = True
    return tick


def _publish_page(b, rows: list[tuple]) -> None:
    """Put a page of outbox rows (id, ref_id, dispatch, priority, kind) on the broker,
    between the relay's two crash points."""
    crash_point("relay.before_publish")
    messages = [broker.Message(r[1], r[2], r[3], r[4]) for r in rows]
    spans = _relay_spans(messages) if tracing.enabled() else {}
    if spans:
        messages = [
            replace(m, traceparent=tracing.traceparent_of(spans[m.job_id]))
            if m.job_id in spans
            else m
            for m in messages
        ]
    try:
        broker.publish(b, messages)
    finally:
        for span in spans.values():
            span.end()
    crash_point("relay.after_publish")


def _relay_spans(messages: list) -> dict:
    """One ``webhooks.relay`` span per job published whose kind keeps trace contexts,
    continuing the trace it was enqueued in (tracing on only: one query per kind)."""
    contexts: dict = {}
    for kind in {m.kind for m in messages}:
        job_kind = kinds.KINDS.get(kind)
        if job_kind is not None and job_kind.trace_contexts is not None:
            contexts.update(job_kind.trace_contexts([m.job_id for m in messages if m.kind == kind]))
    return {
        m.job_id: tracing.start_span(
            "webhooks.relay",
            parent=contexts[m.job_id],
            kind="PRODUCER",
            delivery_id=str(m.job_id),
            dispatch=m.dispatch,
        )
        for m in messages
        if m.job_id in contexts
    }


# One page of unpublished rows that no relay holds a claim on, oldest first, locked so
# that relays divide the work, with one column set: claimed_until (the claim of a relay
# publishing to a broker outside the database), or published_at (the database broker's
# page, marked inside the transaction that inserts its messages). The inner SELECT uses
# the partial index outbox_unpublished.
_OUTBOX_PAGE_SQL = """
UPDATE deliveries_outbox SET {column} = %(value)s
WHERE id IN (
    SELECT id FROM deliveries_outbox
    WHERE published_at IS NULL AND (claimed_until IS NULL OR claimed_until < %(now)s)
    ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED
)
RETURNING id, ref_id, dispatch, priority, kind
"""


def _outbox_page(now, page_size: int, column: str, value) -> list[tuple]:
    """(id, ref_id, dispatch, priority, kind) of the page, oldest first; ``column`` is
    ``claimed_until`` or ``published_at``."""
    if connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(
                _OUTBOX_PAGE_SQL.format(column=column),
                {"value": value, "now": now, "limit": page_size},
            )
            return sorted(cursor.fetchall())
    with transaction.atomic():
        rows = list(
            Outbox.objects.filter(published_at__isnull=True)
            .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
            .order_by("id")
            .values_list("id", "ref_id", "dispatch", "priority", "kind")[:page_size]
        )
        Outbox.objects.filter(id__in=[r[0] for r in rows]).update(**{column: value})
    return rows


_MARK_PUBLISHED_SQL = """
UPDATE deliveries_outbox SET published_at = %s
WHERE id = ANY(%b::bigint[]) AND published_at IS NULL
"""


def _mark_published(ids: list[int], now) -> None:
    """The ids travel as one array parameter on PostgreSQL (the ORM's IN list of a
    2,000-row page cost more Python than the rest of the relay's page)."""
    if connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(_MARK_PUBLISHED_SQL, [now, ids])
        return
    Outbox.objects.filter(id__in=ids, published_at__isnull=True).update(published_at=now)
