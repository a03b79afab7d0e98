"""Enqueueing in the caller's transaction: one outbox row per dispatch of a job, written
in the transaction that marks the job enqueued, so that a rollback leaves neither and a
commit leaves both. With the database broker the committed row is the queue entry, which
the workers' take claims (``DatabaseBroker.take``); with another broker the relay
(deliveries.jobs.relay) publishes it.

A row's ``message_key`` is unique per job *and* dispatch: a retry gets a new row and
message while the job keeps its identity, and a second copy of one dispatch is refused
by the constraint. Both ways of writing rows spell the key from ``message_key_sql`` or
``message_key``, so the two cannot drift:

- ``outbox_write``: the ORM, for any database.
- ``outbox_insert_sql``: the INSERT of the rows a PostgreSQL statement selects, for a
  statement that moves the jobs to enqueued in the same round trip (a CTE).
"""

import re
import uuid
from collections.abc import Iterable
from datetime import datetime

from .models import Outbox

# Deliveries' keys predate other kinds and carry no kind prefix; every other kind's do.
UNPREFIXED_KIND = "delivery"
_KIND_NAME = re.compile(r"[a-z][a-z0-9_]*")


def message_key(kind: str, job_id: uuid.UUID, dispatch: int) -> str:
    """``<kind>:<job id in hex>:<dispatch>`` (``<hex>:<dispatch>`` for a delivery)."""
    prefix = "" if kind == UNPREFIXED_KIND else f"{kind}:"
    return f"{prefix}{job_id.hex}:{dispatch}"


def message_key_sql(kind: str, job_id: str, dispatch: str) -> str:
    """``message_key`` as a PostgreSQL expression over the columns (or expressions)
    ``job_id`` (a uuid) and ``dispatch``."""
    prefix = "" if kind == UNPREFIXED_KIND else f"'{_checked(kind)}:' || "
    return f"{prefix}replace({job_id}::text, '-', '') || ':' || {dispatch}"


def outbox_insert_sql(
    *,
    kind: str,
    source: str,
    job_id: str = "id",
    dispatch: str = "dispatch",
    priority: str = "priority",
    now: str = "%(now)s",
    where: str = "",
) -> str:
    """``INSERT INTO`` the outbox one row of ``kind`` for each row of ``source`` (a CTE
    or table of the calling statement), whose columns or expressions ``job_id``,
    ``dispatch`` and ``priority`` name the job; ``now`` is the creation time."""
    kind = _checked(kind)
    key = message_key_sql(kind, job_id, dispatch)
    return (
        "INSERT INTO deliveries_outbox (message_key, kind, ref_id, dispatch, priority, "
        f"created_at)\nSELECT {key}, '{kind}', {job_id}, {dispatch}, {priority}, {now}\n"
        f"FROM {source}" + (f" WHERE {where}" if where else "")
    )


def outbox_write(
    *, kind: str, jobs: Iterable[tuple[uuid.UUID, int, int]], now: datetime
) -> list[Outbox]:
    """The outbox rows of ``jobs`` (id, dispatch, priority) of ``kind``, in the caller's
    transaction."""
    return Outbox.objects.bulk_create(
        [
            Outbox(
                message_key=message_key(kind, job_id, dispatch),
                kind=kind,
                ref_id=job_id,
                dispatch=dispatch,
                priority=priority,
                created_at=now,
            )
            for job_id, dispatch, priority in jobs
        ]
    )


def _checked(kind: str) -> str:
    # Kind names are code, never input; the check keeps them fit to spell into SQL.
    if not _KIND_NAME.fullmatch(kind):
        raise ValueError(f"not a job kind name: {kind!r}")
    return kind
