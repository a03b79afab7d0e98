"""Recurring jobs: a ``RecurringJob`` row enqueues its job type on a cron schedule, the
cron evaluated in the row's time zone (``0 9 * * *`` in Europe/Berlin is 09:00 there all
year: 08:00 UTC in winter, 07:00 UTC in summer).

The scheduler is the one clock. Its sweep of the ``job`` kind (``background.
jobs_schedule``, run by ``run_scheduler``) takes the enabled rows whose ``next_tick_at``
has come (the partial index ``recurringjob_due``, ``FOR UPDATE SKIP LOCKED``), and for
each enqueues the latest tick that has passed, with the idempotency key
``recurring:<name>:<tick in UTC, ISO 8601>``, then moves ``next_tick_at`` on by a guarded
UPDATE, in one transaction. Two schedulers, or a sweep rerun after a crash between the
enqueue and its commit, therefore enqueue one job per tick: the second insert of a key
writes nothing (the constraint ``job_idempotency``). After downtime only the latest
missed tick is enqueued: a job that was due every minute for a day is run once, not
1,440 times.
"""

import logging
from datetime import UTC, datetime

from django.db import transaction

from ..cron import latest_tick, next_tick
from ..models import RecurringJob
from .enqueue import enqueue
from .registry import JOB_TYPES

logger = logging.getLogger("deliveries.jobs")


def tick_key(name: str, tick: datetime) -> str:
    return f"recurring:{name}:{tick.astimezone(UTC).isoformat()}"


def recurring_schedule(now: datetime, page_size: int) -> tuple[int, bool]:
    """Enqueue the due ticks of a page of recurring jobs; returns (ticks enqueued, whether
    the page was full). Part of the ``job`` kind's schedule."""
    due = RecurringJob.objects.filter(enabled=True, next_tick_at__lte=now)
    # Most sweeps find nothing due: one read, no transaction (on SQLite a transaction
    # takes the write lock, which the workers' statements would wait for).
    if not due.exists():
        return 0, False
    with transaction.atomic():
        due = list(due.select_for_update(skip_locked=True).order_by("next_tick_at")[:page_size])
        enqueued = sum(_schedule_one(row, now) for row in due)
    return enqueued, len(due) >= page_size


def _schedule_one(row: RecurringJob, now: datetime) -> int:
    try:
        tick = latest_tick(row.cron, row.time_zone, at=now)
        following = next_tick(row.cron, row.time_zone, after=now)
    except Exception as exc:  # changed outside the admin's validation: stop it, loudly
        logger.warning(
            "recurring job has a bad schedule",
            extra={"action": "recurring.bad_schedule", "recurring": row.name, "error": str(exc)},
        )
        RecurringJob.objects.filter(id=row.id).update(next_tick_at=None)
        return 0
    enqueued = 0
    already = row.last_scheduled_tick is not None and tick <= row.last_scheduled_tick
    if row.job_type not in JOB_TYPES:
        logger.warning(
            "recurring job of an unknown type skipped a tick",
            extra={
                "action": "recurring.unknown_type",
                "recurring": row.name,
                "job_type": row.job_type,
                "tick": tick.isoformat(),
            },
        )
    elif not already:
        job = enqueue(
            row.job_type,
            row.payload,
            run_at=tick,
            idempotency_key=tick_key(row.name, tick),
            tenant=row.tenant_id,
        )
        enqueued = 1
        logger.info(
            "recurring job enqueued",
            extra={
                "action": "recurring.enqueued",
                "recurring": row.name,
                "job_type": row.job_type,
                "job_id": str(job.id),
                "tenant_id": str(row.tenant_id) if row.tenant_id else "",
                "tick": tick.isoformat(),
            },
        )
    # Guarded on the tick this sweep read: a save in between (a new schedule) wins.
    RecurringJob.objects.filter(id=row.id, next_tick_at=row.next_tick_at).update(
        last_scheduled_tick=tick if enqueued else row.last_scheduled_tick,
        next_tick_at=following,
    )
    return enqueued
