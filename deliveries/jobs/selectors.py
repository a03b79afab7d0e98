"""Reads of background jobs for the operator's console and the REST API."""

from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from .models import Job, JobRun, JobState


@dataclass(frozen=True)
class JobProgress:
    done: int | None
    total: int | None
    # Items a second over the current run so far; None before any progress.
    rate: float | None
    # Seconds left at that rate, while the job runs with a known total; None otherwise.
    eta_seconds: float | None


def job_progress(job: Job, *, now: datetime | None = None) -> JobProgress:
    """What ``current_job().progress(done, total)`` last reported, with the rate and the
    time left computed as for a backfill run: the rate is done over the run's active
    time (its start to the last report), and, while it runs with a total, the ETA is
    that time scaled by the share left, ``active * (1 - f) / f``."""
    done, total = job.progress_done, job.progress_total
    if done is None or job.started_at is None:
        return JobProgress(done, total, None, None)
    running = job.state == JobState.RUNNING
    until = job.progress_updated_at or now or timezone.now()
    active = max((until - job.started_at).total_seconds(), 0.0)
    rate = done / active if active > 0 else None
    eta = None
    fraction = done / total if total else None
    if running and fraction is not None and 0 < fraction < 1 and active > 0:
        eta = active * (1 - fraction) / fraction
    return JobProgress(done, total, rate, eta)


def job_with_runs(job_id) -> tuple[Job, list[JobRun]] | None:
    """A job and its runs, oldest first (a Django task's result), or None."""
    job = Job.objects.filter(id=job_id).first()
    if job is None:
        return None
    return job, list(job.runs.order_by("started_at", "id"))
