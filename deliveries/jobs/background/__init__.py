"""The host's own background jobs, on the job machinery: a function registered with
``@job`` and enqueued with ``enqueue`` gets what a webhook delivery gets, a durable row
written in the caller's transaction, one identity on every run, retries by the shared
policy, leases that a dead worker's jobs come back from, entity locks, and a dead state
that is recorded and alerted, never a silent drop.

    from deliveries.jobs.background import job, enqueue, Retry, Fail, current_job

    @job("billing.sync_invoice", lock=lambda invoice_id, **_: f"invoice:{invoice_id}")
    def sync_invoice(invoice_id):
        billing_api.push(invoice_id, idempotency_key=str(current_job().id))

    enqueue("billing.sync_invoice", {"invoice_id": 42})

``run_jobs`` claims and runs them (``worker``); the ``job`` kind's schedule, run by
``run_scheduler``, returns expired leases and ends jobs past their deadline
(``sweeps``). The state machine is ``state`` with ``statements``; ``registry`` holds
the types a process knows, ``running`` the job being run, ``recurring`` the recurring
jobs' clock. Guide: docs/jobs.md.
"""

from .enqueue import enqueue, enqueue_job
from .registry import (
    JOB_TYPES,
    KIND,
    Fail,
    JobType,
    LeaseExpired,
    Retry,
    UnknownJobType,
    Unreadable,
    job,
    job_type,
)
from .running import RunningJob, current_job

__all__ = [
    "JOB_TYPES",
    "KIND",
    "Fail",
    "JobType",
    "LeaseExpired",
    "Retry",
    "RunningJob",
    "UnknownJobType",
    "Unreadable",
    "current_job",
    "enqueue",
    "enqueue_job",
    "job",
    "job_type",
]
