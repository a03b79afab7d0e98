"""Polls and backfills started from the console, as background jobs on the job
machinery (deliveries.jobs.background): the console's request only enqueues the job, in
the transaction that audits it, and ``run_jobs`` runs the same programs as ``manage.py
poll SLUG --once`` and ``manage.py backfill SLUG --resume RUN``. Registered when the app
is ready (ingest/apps.py)."""

from deliveries.jobs.background import Fail, Retry, current_job, job
from ingest.conf import settings

from .backfill import BackfillError, backfill_run_execute
from .models import BackfillRun, BackfillState
from .poll_sources import poll_source_run


@job(
    "ingest.backfill",
    # A backfill runs as long as its window takes: no timeout, the lease is renewed.
    timeout=None,
    max_attempts=5,
    owner="inbound webhooks",
    # No entity lock of the job's: the run's own lease (backfill:<id>) is the one guard
    # against two runs at once, whoever starts them.
)
def backfill(run_id: str) -> None:
    """Run or resume a backfill from its checkpoint. A worker that dies leaves the
    checkpoint: the job's next attempt resumes from it."""
    run = BackfillRun.objects.filter(id=run_id).first()
    if run is None:
        raise Fail(f"no backfill run {run_id}")
    if run.state == BackfillState.COMPLETED:
        return
    running = current_job()
    try:
        segment = backfill_run_execute(
            run_id=run.id,
            on_page=lambda seg: running.progress(
                seg.processed_before + seg.counts["processed"], seg.total
            ),
        )
    except BackfillError as exc:
        # The run's own lease is held elsewhere (a `backfill --resume` in a shell, or a
        # dead worker's until it runs out): try again once it may have.
        raise Retry(after=settings.BACKFILL_LEASE_SECONDS, reason=str(exc)) from exc
    if segment.run.state == BackfillState.FAILED:
        raise Fail(f"the provider kept failing: {segment.run.error[:300]}")


@job("ingest.poll", timeout=None, max_attempts=1, owner="inbound webhooks")
def poll(slug: str) -> None:
    """One poll of a poll source (``poll SLUG --once``), under the source's lease."""
    result = poll_source_run(slug=slug)
    if result.outcome == "failed":
        raise Fail(result.error[:300] or "the poll failed")
