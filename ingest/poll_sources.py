"""Poll sources: create one (with its django-q2 schedule), run one poll under the
source's lease (``ingest/leases.py``). Reading the provider's changed records (adapters,
cursor, walk) is ``ingest/changes.py``'s."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.utils import timezone

from deliveries.core.audit import audit
from deliveries.jobs.background import enqueue
from ingest.conf import settings

from .changes import Cursor, PollError, adapter_for, http_json_config, read_changes
from .leases import Lease, LeaseLost
from .models import PollSource, Source
from .receiving import inbound_store_many

logger = logging.getLogger("ingest")


def poll_schedule_name(slug: str) -> str:
    return f"poll:{slug}"


def poll_source_create(
    *,
    slug: str,
    config: dict[str, Any],
    auth_secret: str = "",
    tenant=None,
    every_minutes: int = 5,
    schedule: bool = True,
) -> PollSource:
    """A poll source, its inbound :class:`Source` (scheme ``poll``) and, unless
    ``schedule`` is False, a django-q2 schedule that polls it every ``every_minutes``."""
    http_json_config(config)  # refuses bad settings with a clear message
    with transaction.atomic():
        source = Source.objects.create(slug=slug, scheme="poll")
        poll = PollSource.objects.create(
            source=source,
            tenant=tenant,
            config=config,
            auth_secret=auth_secret,
            every_minutes=every_minutes,
        )
        if schedule:
            poll_schedule_ensure(poll)
    return poll


def poll_schedule_ensure(poll: PollSource):
    """The django-q2 ``Schedule`` row that polls ``poll`` (created or brought up to date);
    it calls ``ingest.schedules.poll_pass``, the same unit as ``poll SLUG --once``."""
    from django_q.models import Schedule

    slug = poll.source.slug
    schedule, _ = Schedule.objects.update_or_create(
        name=poll_schedule_name(slug),
        defaults={
            "func": "ingest.schedules.poll_pass",
            "kwargs": repr({"slug": slug}),
            "schedule_type": Schedule.MINUTES,
            "minutes": poll.every_minutes,
        },
    )
    return schedule


def poll_source_poll_now(*, poll: PollSource, actor=None):
    """Poll a source at once from the console: enqueue the ``ingest.poll`` job
    (ingest/jobs.py) that ``run_jobs`` runs, audited in the same transaction. Returns the
    job."""
    with transaction.atomic():
        job = enqueue("ingest.poll", {"slug": poll.source.slug}, tenant=poll.tenant_id)
        audit(
            actor=actor,
            action="poll_source.poll_now",
            target="poll_source",
            count=1,
            source=poll.source.slug,
            job=str(job.id),
        )
    return job


@dataclass
class PollResult:
    slug: str
    outcome: str  # polled | leased (another run holds the source) | failed | disabled
    counts: Counter = field(default_factory=Counter)
    cursor: Cursor = field(default_factory=Cursor)
    error: str = ""


def poll_source_run(*, slug: str, should_stop=lambda: False) -> PollResult:
    """One poll of ``slug``: read the records changed since the cursor, store each page
    as inbound events and advance the cursor in the same transaction. Overlapping runs
    of one source are safe: the second finds the lease held and does nothing."""
    poll = PollSource.objects.select_related("source").get(source__slug=slug)
    if not poll.enabled:
        return PollResult(slug, "disabled")
    lease = Lease(f"poll:{poll.id}", ttl=settings.POLL_LEASE_SECONDS)
    if not lease.acquire():
        logger.info("poll skipped: leased", extra={"action": "poll.leased", "source": slug})
        return PollResult(slug, "leased")
    # The cursor as the lease holder sees it: read before the lease, it could be the one
    # a run that has just released the lease started from, and the records it stored
    # since would be read again.
    poll.refresh_from_db(fields=["cursor_at", "cursor_ids"])
    result = PollResult(slug, "polled", cursor=Cursor(poll.cursor_at, frozenset(poll.cursor_ids)))
    started = timezone.now()
    adapter = adapter_for(poll)
    try:
        for page in read_changes(
            adapter,
            cursor=result.cursor,
            page_size=adapter.config["page_size"],
            max_pages=settings.POLL_MAX_PAGES,
            should_stop=should_stop,
        ):
            with transaction.atomic():
                lease.renew()
                stored, duplicates = inbound_store_many(
                    source=poll.source, events=[r.as_event() for r in page.fresh]
                )
                PollSource.objects.filter(id=poll.id).update(
                    cursor_at=page.cursor.at, cursor_ids=sorted(page.cursor.ids)
                )
            result.cursor = page.cursor
            result.counts.update(
                pages=1,
                records=len(page.page.records),
                stored=stored,
                duplicates=duplicates,
                skipped=page.skipped,
            )
    except (PollError, LeaseLost) as exc:
        result.outcome, result.error = "failed", str(exc)[:2000]
    finally:
        adapter.close()
        PollSource.objects.filter(id=poll.id).update(
            last_poll_at=started, last_poll_counts=dict(result.counts), last_error=result.error
        )
        lease.release()
    logger.info(
        "poll finished",
        extra={
            "action": "poll.finished",
            "source": slug,
            "outcome": result.outcome,
            "error": result.error[:200],
            **{k: v for k, v in result.counts.items()},
        },
    )
    return result
