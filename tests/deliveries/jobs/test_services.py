"""The operators' services on background jobs (deliveries.jobs.services): guarded
transitions, each with its audit row in the same transaction."""

from datetime import timedelta

import pytest
from django.utils import timezone

from deliveries.core import audit
from deliveries.jobs import services
from deliveries.jobs.background import enqueue
from deliveries.jobs.background.state import CANCELLED_REASON
from deliveries.jobs.models import Job, JobState
from deliveries.models import AuditEntry
from tests.deliveries.jobs import sample_jobs  # noqa: F401  (registers the test types)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


def job_in(state: str, **fields) -> Job:
    job = enqueue("test.noop", {"n": 1})
    Job.objects.filter(id=job.id).update(state=state, **fields)
    return Job.objects.get(id=job.id)


def test_a_replay_returns_dead_jobs_to_pending_with_a_fresh_budget_and_is_audited():
    past = timezone.now() - timedelta(hours=1)
    dead = job_in(
        "dead",
        attempts=5,
        dead_reason="deadline passed",
        deadline=past,
        finished_at=past,
        progress_done=3,
        progress_total=9,
    )
    done = job_in("done", attempts=1)
    n = services.job_replay(job_ids=[dead.id, done.id], actor=None)
    assert n == 1
    dead.refresh_from_db()
    assert (dead.state, dead.attempts, dead.dead_reason, dead.deadline) == ("pending", 0, "", None)
    assert dead.finished_at is None and dead.progress_done is None
    assert dead.run_at >= past
    assert Job.objects.get(id=done.id).state == JobState.DONE  # not dead: left alone
    [entry] = AuditEntry.objects.filter(action="job.replay")
    assert (entry.target, entry.count, entry.details["via"]) == ("job", 1, "admin")
    assert set(entry.details["ids"]) == {str(dead.id), str(done.id)}


def test_a_cancel_ends_pending_jobs_only_and_is_audited():
    pending = job_in("pending")
    running = job_in("running", lease_token=pending.id, lease_until=timezone.now())
    n = services.job_cancel(job_ids=[pending.id, running.id])
    assert n == 1
    pending.refresh_from_db()
    assert (pending.state, pending.dead_reason) == ("dead", CANCELLED_REASON)
    assert pending.finished_at is not None
    assert Job.objects.get(id=running.id).state == JobState.RUNNING
    assert AuditEntry.objects.get(action="job.cancel").count == 1
    # A cancelled job is dead: a replay brings it back.
    assert services.job_replay(job_ids=[pending.id]) == 1


def test_without_its_audit_row_no_job_changes():
    pending = job_in("pending")

    def refuse(**entry):
        raise RuntimeError("the audit table is unavailable")

    saved = list(audit._writer)
    audit.register_audit(refuse)
    try:
        with pytest.raises(RuntimeError):
            services.job_cancel(job_ids=[pending.id])
    finally:
        audit._writer[:] = saved
    assert Job.objects.get(id=pending.id).state == JobState.PENDING
