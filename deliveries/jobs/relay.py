"""The relay: publishes committed outbox rows to the broker, page by page. It is the
bridge from the transaction that enqueued a job to a queue transport outside the
database (Redis). The database broker needs none: its workers claim the outbox rows
themselves (``DatabaseBroker.take``). A relay run with it anyway keeps working: it moves
pages into the broker's queue table in one transaction each, and the workers' take reads
that table too."""

from dataclasses import replace
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from deliveries.core import tracing
from deliveries.core.conf import settings

from . import brokers as broker
from . import kinds
from .faults import crash_point
from .loop import Tick
from .models import Outbox
from .statements import CLAIM_OUTBOX_PAGE, MARK_PUBLISHED, PUBLISH_OUTBOX_PAGE


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
    if broker.takes_outbox(b):
        with transaction.atomic():
            rows = _page(PUBLISH_OUTBOX_PAGE, now, page_size, now)
            if rows:
                _publish_page(b, rows)
    else:
        until = now + timedelta(seconds=settings.RELAY_CLAIM_SECONDS)
        rows = _page(CLAIM_OUTBOX_PAGE, now, page_size, until)
        if rows:
            _publish_page(b, rows)
            MARK_PUBLISHED([timezone.now(), [r[0] for r in rows]])
    if not rows:
        tick.idle = not Outbox.objects.filter(published_at__isnull=True).exists()
        return tick
    tick.counts["published"] = len(rows)
    tick.busy = len(rows) >= page_size
    tick.soon = True
    return tick


def _page(statement, now, page_size: int, value) -> list[tuple]:
    """(id, ref_id, dispatch, priority, kind) of the page, oldest first (RETURNING has no
    order); ``value`` is what ``statement`` sets: the claim's end, or the time."""
    return sorted(statement({"value": value, "now": now, "limit": page_size}))


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
