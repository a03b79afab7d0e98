"""Backfill: read a window of a poll source's history, as its own program.

Not the scheduled poll with a wide range: a backfill has a fixed window, its own run row
(window, checkpoint, counts, rate, who started it, state), a token-bucket rate limit, a
checkpoint written in the transaction that stores each page, and it resumes from that
checkpoint after Ctrl-C, a crash or ``kill -9``. It never moves the poll source's cursor;
records it shares with polling are deduplicated on the event id like any copy.
"""

from __future__ import annotations

import getpass
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from deliveries.core.audit import audit
from deliveries.jobs.background import enqueue
from deliveries.jobs.loop import Heartbeat
from ingest.conf import settings

from .changes import Cursor, Page, PollAdapter, PollError, TokenBucket, adapter_for, read_changes
from .leases import Lease, LeaseLost
from .models import BackfillRun, BackfillState, InboundEvent, PollSource
from .receiving import inbound_store_many

logger = logging.getLogger("ingest")

RESUMABLE = (BackfillState.RUNNING, BackfillState.INTERRUPTED, BackfillState.FAILED)


def _beat(run_id) -> None:
    BackfillRun.objects.filter(id=run_id, state=BackfillState.RUNNING).update(
        heartbeat_at=timezone.now()
    )


class BackfillError(Exception):
    """A backfill that cannot start or go on; the message says why."""


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def backfill_run_create(
    *,
    slug: str,
    since: datetime,
    until: datetime | None = None,
    rate: float,
    page_size: int | None = None,
    started_by: str = "",
) -> BackfillRun:
    poll = _poll_source(slug)
    now = timezone.now()
    until = until or now
    page_size = page_size or adapter_for(poll).config["page_size"]
    backfill_options_check(since=since, until=until, rate=rate, page_size=page_size)
    return BackfillRun.objects.create(
        source=poll,
        since=since,
        until=until,
        rate=rate,
        page_size=page_size,
        started_by=started_by or who(),
        created_at=now,
    )


def backfill_options_check(
    *, since: datetime, until: datetime, rate: float, page_size: int | None
) -> None:
    """The rules a backfill's window and pace obey (the command's, the console's)."""
    if not since < until:
        raise BackfillError(
            f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})"
        )
    if not rate > 0:
        raise BackfillError("--rate must be positive")
    if page_size is not None and not 1 <= page_size <= 100_000:
        raise BackfillError("--page-size must be from 1 to 100000")


def backfill_run_start(*, run_id, actor=None):
    """Start (or resume) a run from the console: enqueue the ``ingest.backfill`` job
    (ingest/jobs.py) that ``run_jobs`` runs, audited in the same transaction; nothing
    runs in the caller's request. Starting a run again before it moved (the same
    heartbeat and resume count) gives back the job already enqueued. Returns the job."""

    with transaction.atomic():
        run = (
            BackfillRun.objects.select_related("source")
            .select_for_update(of=("self",))
            .get(id=run_id)
        )
        if run.state == BackfillState.COMPLETED:
            raise BackfillError(f"backfill {run.id} is already completed")
        moved = run.heartbeat_at.isoformat() if run.heartbeat_at else "never"
        job = enqueue(
            "ingest.backfill",
            {"run_id": str(run.id)},
            idempotency_key=f"backfill:{run.id}:{moved}:{run.resumes}",
            tenant=run.source.tenant_id,
        )
        audit(
            actor=actor,
            action="backfill.start",
            target="backfill_run",
            count=1,
            run=str(run.id),
            job=str(job.id),
        )
    return job


def _poll_source(slug: str) -> PollSource:
    try:
        return PollSource.objects.select_related("source").get(source__slug=slug)
    except PollSource.DoesNotExist:
        raise BackfillError(f"no poll source {slug!r}") from None


class _Paced(PollAdapter):
    """The adapter behind the token bucket, retrying what is worth retrying (no answer,
    429, 5xx) with a growing pause; every attempt takes a token and counts a request."""

    def __init__(
        self, inner: PollAdapter, bucket: TokenBucket, counts: Counter, *, sleep=time.sleep
    ):
        self.inner, self.bucket, self.counts, self._sleep = inner, bucket, counts, sleep
        self.config = getattr(inner, "config", {})

    def list_changed(self, **kwargs) -> Page:
        for attempt in range(settings.BACKFILL_RETRIES + 1):
            self.bucket.take()
            self.counts["requests"] += 1
            try:
                return self.inner.list_changed(**kwargs)
            except PollError as exc:
                retryable = exc.status is None or exc.status == 429 or exc.status >= 500
                if not retryable or attempt == settings.BACKFILL_RETRIES:
                    raise
                logger.warning(
                    "backfill request failed, retrying",
                    extra={
                        "action": "backfill.retry",
                        "error": str(exc)[:200],
                        "attempt": attempt + 1,
                    },
                )
                self._sleep(min(2**attempt, 30))
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.inner.close()


@dataclass
class Segment:
    """This process's share of a run, for the progress bar and the summary. The run's
    figures from before it started are kept apart (``*_before``): the progress is those
    plus ``counts``, whatever the run row says meanwhile (it is reloaded at the end,
    already holding this segment's counts)."""

    run: BackfillRun
    started: float  # time.monotonic()
    counts: Counter
    active_before: float
    checkpoint: datetime | None = None
    processed_before: int = 0
    requests_before: int = 0
    # Records in the window if the provider says: the run's, or the first page's.
    total: int | None = None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


def backfill_run_execute(
    *,
    run_id,
    should_stop: Callable[[], bool] = lambda: False,
    on_page: Callable[[Segment], None] | None = None,
) -> Segment:
    """Run (or resume) a backfill from its checkpoint until its window is read, it is
    stopped (state ``interrupted``) or the provider keeps failing (``failed``)."""
    try:
        run = BackfillRun.objects.select_related("source__source").get(id=run_id)
    except (BackfillRun.DoesNotExist, ValueError, TypeError):
        raise BackfillError(f"no backfill run {run_id}") from None
    if run.state == BackfillState.COMPLETED:
        raise BackfillError(f"backfill {run.id} is already completed")
    lease = Lease(f"backfill:{run.id}", ttl=settings.BACKFILL_LEASE_SECONDS)
    if not lease.acquire():
        raise BackfillError(f"backfill {run.id} is running elsewhere ({lease.holder()})")
    now = timezone.now()
    resumed = run.heartbeat_at is not None
    BackfillRun.objects.filter(id=run.id, state__in=RESUMABLE).update(
        state=BackfillState.RUNNING,
        heartbeat_at=now,
        resumes=F("resumes") + int(resumed),
        error="",
        finished_at=None,
    )
    run.refresh_from_db()
    segment = Segment(
        run,
        time.monotonic(),
        Counter(),
        run.active_seconds,
        run.checkpoint_at,
        processed_before=run.processed,
        requests_before=run.requests,
        total=run.total,
    )
    adapter = _Paced(adapter_for(run.source), TokenBucket(run.rate), segment.counts)
    cursor = Cursor(run.checkpoint_at or run.since, frozenset(run.checkpoint_ids))
    logger.info(
        "backfill started",
        extra={"action": "backfill.started", "backfill_id": str(run.id), "resumed": resumed},
    )
    state, error = BackfillState.COMPLETED, ""
    requests_recorded = 0
    # Each page writes the heartbeat; this keeps it fresh while a page is slow or the
    # rate limit waits.
    heartbeat = Heartbeat(lambda: _beat(run.id), name="backfill-heartbeat").start()
    try:
        for page in read_changes(
            adapter,
            cursor=cursor,
            page_size=run.page_size,
            until=run.until,
            should_stop=should_stop,
        ):
            requests = segment.counts["requests"] - requests_recorded
            with transaction.atomic():
                lease.renew()
                stored, duplicates = inbound_store_many(
                    source=run.source.source, events=[r.as_event() for r in page.fresh]
                )
                fields = {
                    "checkpoint_at": page.cursor.at,
                    "checkpoint_ids": sorted(page.cursor.ids),
                    "pages": F("pages") + 1,
                    "requests": F("requests") + requests,
                    "processed": F("processed") + len(page.fresh),
                    "stored": F("stored") + stored,
                    "duplicates": F("duplicates") + duplicates,
                    "active_seconds": segment.active_before + segment.elapsed,
                    "heartbeat_at": timezone.now(),
                }
                if page.page.total is not None and run.total is None and not run.checkpoint_at:
                    fields["total"] = segment.total = page.page.total
                BackfillRun.objects.filter(id=run.id).update(**fields)
            requests_recorded += requests
            segment.checkpoint = page.cursor.at
            segment.counts.update(
                pages=1, processed=len(page.fresh), stored=stored, duplicates=duplicates
            )
            if on_page is not None:
                on_page(segment)
        if should_stop():
            state = BackfillState.INTERRUPTED
    except (PollError, LeaseLost) as exc:
        state, error = BackfillState.FAILED, str(exc)[:2000]
    except BaseException:
        # KeyboardInterrupt mid-request and the like: the checkpoint holds; resumable.
        state, error = BackfillState.INTERRUPTED, "interrupted"
        raise
    finally:
        heartbeat.stop()
        adapter.close()
        BackfillRun.objects.filter(id=run.id, state=BackfillState.RUNNING).update(
            state=state,
            error=error,
            requests=F("requests") + segment.counts["requests"] - requests_recorded,
            active_seconds=segment.active_before + segment.elapsed,
            heartbeat_at=timezone.now(),
            finished_at=timezone.now() if state == BackfillState.COMPLETED else None,
        )
        lease.release()
        segment.run.refresh_from_db()
        logger.info(
            "backfill stopped",
            extra={
                "action": "backfill.stopped",
                "backfill_id": str(run.id),
                "state": state,
                "error": error[:200],
                **dict(segment.counts),
            },
        )
    return segment


def backfill_dry_run(
    *,
    slug: str,
    since: datetime,
    until: datetime | None,
    rate: float,
    page_size: int | None,
    should_stop: Callable[[], bool] = lambda: False,
    on_page: Callable[[Counter], None] | None = None,
) -> Counter:
    """Read the window at the given rate and count what a backfill would store, storing
    nothing and recording no run."""
    poll = _poll_source(slug)
    until = until or timezone.now()
    if not since < until:
        raise BackfillError("--since must be before --until")
    counts: Counter = Counter()
    inner = adapter_for(poll)
    adapter = _Paced(inner, TokenBucket(rate), counts)
    try:
        for page in read_changes(
            adapter,
            cursor=Cursor(since),
            page_size=page_size or inner.config["page_size"],
            until=until,
            should_stop=should_stop,
        ):
            ids = [r.event_id for r in page.fresh]
            present = InboundEvent.objects.filter(source=poll.source, event_id__in=ids).count()
            counts.update(pages=1, processed=len(ids), present=present, new=len(ids) - present)
            if on_page is not None:
                on_page(counts)
    finally:
        adapter.close()
    return counts
