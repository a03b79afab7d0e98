"""The host's background jobs' transitions outside the worker's statements: insert,
the sweeps' lease expiry and deadlines, the operators' replay and cancel. Each is a
guarded UPDATE on the expected state; the claim, record and renewal are statements
(``statements``)."""

from datetime import datetime

from django.db import connection, transaction
from django.db.models import Q
from psycopg.types.json import Jsonb

from ..models import Job, JobOutcome, JobRun, JobState
from .statements import INSERT_JOB

PENDING, RUNNING, DONE, DEAD = JobState.PENDING, JobState.RUNNING, JobState.DONE, JobState.DEAD
# The error class of a ``lost`` run (the sweep's): no exception was seen, the lease ran out.
LEASE_EXPIRED_CLASS = "deliveries.jobs.background.LeaseExpired"


def job_insert(fields: dict) -> tuple[Job, bool]:
    """Insert a job (the columns in ``fields``), in the caller's transaction; returns the
    row and whether it is new. With an idempotency key that exists: the existing job."""
    inserted = INSERT_JOB({**fields, "payload": Jsonb(fields["payload"])})
    if inserted is not None:
        row = Job(state=PENDING, attempts=0, **fields)
        row._state.adding, row._state.db = False, connection.alias  # a row, as if read
        return row, True
    return Job.objects.get(type=fields["type"], idempotency_key=fields["idempotency_key"]), False


# --- The sweeps (the "job" kind's schedule) --------------------------------------------


def expire_leases(now: datetime, limit: int) -> tuple[int, int]:
    """Running jobs whose lease ran out (their worker died, or hangs): back to pending,
    due now, or dead when that was their last attempt (the attempt was counted at the
    claim). Each gets a ``lost`` run. Returns (pending again, dead)."""
    with transaction.atomic():
        rows = list(
            Job.objects.filter(state=RUNNING, lease_until__lt=now)
            .select_for_update(skip_locked=True)
            .values_list("id", "lease_token", "attempts", "max_attempts", "started_at")[:limit]
        )
        if not rows:
            return 0, 0
        spent = [r[0] for r in rows if r[2] >= r[3]]
        again = [r[0] for r in rows if r[2] < r[3]]
        expired = Q(state=RUNNING, lease_until__lt=now)
        cleared = {"lease_token": None, "lease_until": None, "last_error": "lease expired"}
        n_again = Job.objects.filter(expired, id__in=again).update(
            state=PENDING, run_at=now, **cleared
        )
        n_dead = Job.objects.filter(expired, id__in=spent).update(
            state=DEAD,
            finished_at=now,
            dead_reason="lease expired on the last attempt",
            **cleared,
        )
        JobRun.objects.bulk_create(
            JobRun(
                job_id=job_id,
                attempt=attempts,
                started_at=started or now,
                duration_ms=((now - started).total_seconds() * 1000) if started else 0.0,
                outcome=JobOutcome.LOST,
                error="the lease expired before the run was recorded",
                error_class=LEASE_EXPIRED_CLASS,
            )
            for job_id, _, attempts, _, started in rows
        )
    return n_again, n_dead


def expire_deadlines(now: datetime, limit: int) -> int:
    """Pending jobs past their deadline (the partial index job_deadline): dead, with the
    reason "deadline passed", never run."""
    with transaction.atomic():
        ids = list(
            Job.objects.filter(state=PENDING, deadline__lte=now)
            .select_for_update(skip_locked=True)
            .values_list("id", flat=True)[:limit]
        )
        return Job.objects.filter(id__in=ids, state=PENDING, deadline__lte=now).update(
            state=DEAD, finished_at=now, dead_reason="deadline passed"
        )


# --- Operators: replay and cancel (deliveries.jobs.services) ---------------------------

CANCELLED_REASON = "cancelled by an operator"


def replay_jobs(job_ids, now: datetime) -> int:
    """Dead jobs (cancelled ones included) back to pending, due now, with a fresh budget:
    ``attempts`` from 0, the deadline and the dead reason cleared. Their runs stay."""
    return Job.objects.filter(id__in=list(job_ids), state=DEAD).update(
        state=PENDING,
        attempts=0,
        run_at=now,
        deadline=None,
        dead_reason="",
        finished_at=None,
        result=None,
        progress_done=None,
        progress_total=None,
        progress_updated_at=None,
    )


def cancel_jobs(job_ids, now: datetime) -> int:
    """Pending jobs dead with the reason ``cancelled by an operator``; a running job is
    left alone (its function cannot be recalled)."""
    return Job.objects.filter(id__in=list(job_ids), state=PENDING).update(
        state=DEAD, dead_reason=CANCELLED_REASON, finished_at=now
    )
