"""Writing a job in the caller's transaction."""

from collections.abc import Mapping
from datetime import datetime

from django.utils import timezone

from deliveries.core.ids import uuid7

from .. import wakeup
from .registry import as_json, job_type
from .state import job_insert


def enqueue(
    type: str,
    payload: Mapping | None = None,
    *,
    run_at: datetime | None = None,
    deadline: datetime | None = None,
    idempotency_key: str | None = None,
    tenant=None,
    priority: int | None = None,
    queue: str | None = None,
):
    """Write one job in the caller's transaction and wake the workers at its commit;
    returns the ``Job`` row. A rollback leaves nothing; a commit makes it claimable
    however the process ends afterwards. With ``idempotency_key`` a second enqueue of the
    same type and key writes nothing and returns the first job (the constraint
    ``job_idempotency`` decides, also between concurrent callers). ``tenant``: a tenant
    (anything with a UUID ``id``) or its id, for the per-tenant fairness of the claim.

    The payload is stored as JSON with Django's encoder, and the function gets it back
    from there: a ``Decimal``, ``datetime`` or ``UUID`` arrives as its string, on the
    first run as on a retry."""
    return enqueue_job(
        type,
        payload,
        run_at=run_at,
        deadline=deadline,
        idempotency_key=idempotency_key,
        tenant=tenant,
        priority=priority,
        queue=queue,
    )[0]


def enqueue_job(
    type: str,
    payload: Mapping | None = None,
    *,
    run_at: datetime | None = None,
    deadline: datetime | None = None,
    idempotency_key: str | None = None,
    tenant=None,
    priority: int | None = None,
    queue: str | None = None,
):
    """``enqueue``, returning (the ``Job`` row, whether this call wrote it)."""
    spec = job_type(type)
    payload = as_json(dict(payload or {}))
    now = timezone.now()
    lock_key = spec.lock(**payload) if spec.lock is not None else ""
    fields = {
        "id": uuid7(),
        "type": type,
        "queue": queue or spec.queue,
        "priority": spec.priority if priority is None else priority,
        "tenant_id": getattr(tenant, "id", tenant),
        "payload": payload,
        "version": spec.version,
        "idempotency_key": idempotency_key,
        "run_at": run_at or now,
        "deadline": deadline,
        "max_attempts": spec.max_attempts,
        "lock_key": str(lock_key or "")[:300],
        "created_at": now,
    }
    row, created = job_insert(fields)
    if created:
        wakeup.notify(wakeup.JOBS)
    return row, created
