"""An entity lock expires with its holder's lease (docs/jobs.md): the worker extends
both together, in one statement, so a database error cannot leave the lock to run out
before the lease it belongs to; a lock found taken over is logged."""

import logging
import threading
import time

import pytest
from django.db import OperationalError, connection

from deliveries.jobs.background import enqueue, job
from deliveries.jobs.background import worker as runner
from deliveries.jobs.background.worker import JobWorker
from deliveries.jobs.models import EntityLock, Job, JobState

pytestmark = pytest.mark.django_db(transaction=True)


@job("test.lock_renewal.long", lock=lambda key, **_: key, timeout=None)
def long_locked(key, seconds):
    time.sleep(seconds)


def test_a_failed_lock_renewal_never_leaves_the_lock_expiring_before_the_lease(
    settings, monkeypatch
):
    settings.JOBS_LEASE_MARGIN = 1.0  # no timeout: a lease of 2 s, renewed at 1 s left
    acquire = runner.entity_lock_acquire
    calls = []

    def flaky_acquire(**kwargs):
        # The claim's call, then the first renewal's (if the lock is renewed this way).
        calls.append(kwargs)
        if len(calls) == 2:
            raise OperationalError("server closed the connection unexpectedly")
        return acquire(**kwargs)

    monkeypatch.setattr(runner, "entity_lock_acquire", flaky_acquire)
    queued = enqueue("test.lock_renewal.long", {"key": "order:7", "seconds": 4.0})
    worker = JobWorker(concurrency=1)
    thread = threading.Thread(target=lambda: (worker.run(), connection.close()))
    thread.start()
    behind, leases = [], set()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            row = Job.objects.get(id=queued.id)
            if row.state == JobState.DONE:
                break
            if row.state != JobState.RUNNING:
                time.sleep(0.05)
                continue
            leases.add(row.lease_until)
            lock = EntityLock.objects.filter(key="order:7", owner=str(row.lease_token)).first()
            lag = (row.lease_until - lock.expires_at).total_seconds() if lock else 0.0
            if lag > 0.25:  # more than the moment between two statements of a renewal
                behind.append(lag)
            time.sleep(0.05)
    finally:
        worker.request_stop()
        thread.join()
    assert len(leases) >= 3, "the lease was not renewed"
    assert Job.objects.get(id=queued.id).state == JobState.DONE
    # The lock never ran behind the lease; a second holder could take it meanwhile.
    assert behind == [], f"the lock expired up to {max(behind):.2f} s before the lease"


def test_a_lock_taken_over_while_its_holder_runs_is_logged_and_left_to_its_owner(settings, caplog):
    settings.JOBS_LEASE_MARGIN = 1.0  # no timeout: a lease of 2 s, renewed at 1 s left
    queued = enqueue("test.lock_renewal.long", {"key": "order:8", "seconds": 3.0})
    worker = JobWorker(concurrency=1)
    thread = threading.Thread(target=lambda: (worker.run(), connection.close()))
    caplog.set_level(logging.WARNING, logger="deliveries.jobs")
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not EntityLock.objects.filter(key="order:8").exists():
            assert time.monotonic() < deadline, "the job never took its lock"
            time.sleep(0.05)
        # What a second holder does once the lock expired: the row is its own now.
        EntityLock.objects.filter(key="order:8").update(owner="another-job")
        while Job.objects.get(id=queued.id).state == JobState.RUNNING:
            assert time.monotonic() < deadline, "the job never finished"
            time.sleep(0.05)
    finally:
        worker.request_stop()
        thread.join()
    lost = [r for r in caplog.records if getattr(r, "action", "") == "job.lock_lost"]
    assert [(r.job_id, r.lock_key) for r in lost] == [(str(queued.id), "order:8")]
    assert Job.objects.get(id=queued.id).state == JobState.DONE
    # The renewal and the record leave the other owner's lock alone.
    assert list(EntityLock.objects.filter(key="order:8").values_list("owner", flat=True)) == [
        "another-job"
    ]
