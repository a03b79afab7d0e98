"""The statements of the inbound fast path, each defined once by name: its PostgreSQL
text and, directly below it, the same effect written with the ORM for SQLite
(``deliveries.core.sql.Statement``). A statement takes the same parameters and gives
back the same shape whichever spelling runs, so ``ingest.receiving`` and
``ingest.worker`` never ask which database they are on to store, lease or record an
event.

Array parameters travel in binary format (``%(name)b::type[]``, see deliveries.core.sql).
``write_outbox`` is the ORM's way to enqueue stored events: the ORM spellings below and
the scheduler's admission share it, where the PostgreSQL statements write their outbox
rows in the same round trip.
"""

import uuid
from collections.abc import Sequence
from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import BinaryField, Case, F, Q, When
from django.db.models.functions import Length
from django.db.models.lookups import LessThanOrEqual

from deliveries.core.ids import UUID7_SQL, uuid7
from deliveries.core.sql import Statement
from deliveries.jobs.locks import RELEASE_SQL, entity_lock_release
from deliveries.jobs.outbox import outbox_insert_sql, outbox_write

from .models import EntityVersion, HandlerRun, InboundEvent, InboundState, Source

# The job kind of an inbound event's processing: the outbox rows written here carry it.
KIND = "inbound"


def write_outbox(ids: Sequence[uuid.UUID], now: datetime) -> None:
    """The outbox rows of the events ``ids`` at their current dispatch, in the caller's
    transaction."""
    dispatches = dict(InboundEvent.objects.filter(id__in=ids).values_list("id", "dispatch_count"))
    outbox_write(kind=KIND, jobs=[(i, dispatches[i], 0) for i in ids], now=now)


# --- Receiving ------------------------------------------------------------------------


# The event and its processing job in one statement: insert-or-nothing on
# UNIQUE(source, event_id) and on the partial UNIQUE(source, body_sha256) (no conflict
# target: either key makes a copy; a concurrent copy waits for the first and then
# inserts nothing), and the outbox row only for an event actually inserted. The params
# are the event's columns, ``headers`` as a psycopg ``Jsonb``, with ``now`` and
# ``with_job``; the row is (1,) for an event inserted, (0,) for a copy. The receive view
# runs it in autocommit, usually as a request's first use of a persistent connection
# with no health check before it (the source came from the cache): a connection the
# server dropped is retried once on a fresh one (``reconnects``), which is safe because
# it is idempotent (had the first try committed, the second finds a copy).
INSERT_EVENT = Statement(
    """
WITH new AS (
    INSERT INTO ingest_inboundevent (id, source_id, event_id, body_sha256, event_type,
        entity_id, occurred_at, body, headers, state, received_at, duplicates,
        next_attempt_at, attempt_count, dispatch_count, enqueued_at, last_error, sequenced)
    VALUES (%(id)s, %(source_id)s, %(event_id)s, %(body_sha256)s, %(event_type)s,
        %(entity_id)s, %(occurred_at)s, %(body)s, %(headers)s, %(state)s, %(received_at)s,
        0, %(next_attempt_at)s, 0, %(dispatch_count)s, %(enqueued_at)s, %(last_error)s,
        %(sequenced)s)
    ON CONFLICT DO NOTHING
    RETURNING id
), job AS (
    {outbox}
)
SELECT count(*) FROM new
""".replace(
        "{outbox}",
        outbox_insert_sql(
            kind=KIND, source="new", dispatch="1", priority="0", where="%(with_job)s"
        ),
    ),
    returns="row",
    reconnects=True,
)


@INSERT_EVENT.elsewhere
def _(params):
    fields = {k: v for k, v in params.items() if k not in ("now", "with_job")}
    fields["headers"] = params["headers"].obj
    return (int(_store_event(fields, params["now"], with_job=params["with_job"])),)


def _store_event(fields: dict, now: datetime, *, with_job: bool) -> bool:
    # Either unique key refuses a copy: its savepoint leaves nothing of it behind.
    try:
        with transaction.atomic():
            InboundEvent.objects.create(**fields)
            if with_job:
                write_outbox([fields["id"]], now)
    except IntegrityError:
        return False
    return True


# INSERT_EVENT for a page of events: one statement, arrays bound server-side. The
# duplicate count comes from the rows that existed before the statement (a data-modifying
# CTE does not see the rows its siblings insert). The row is (ids inserted, duplicates).
INSERT_EVENTS = Statement(
    """
WITH rows AS (
    SELECT {uuid7} AS id, r.* FROM unnest(%(event_ids)b::text[], %(types)b::text[],
        %(entities)b::text[], %(occurred)b::timestamptz[], %(bodies)b::bytea[])
        AS r(event_id, event_type, entity_id, occurred_at, body)
), new AS (
    INSERT INTO ingest_inboundevent (id, source_id, event_id, event_type, entity_id,
        occurred_at, body, headers, state, received_at, duplicates, next_attempt_at,
        attempt_count, dispatch_count, enqueued_at, last_error)
    SELECT id, %(source_id)s, event_id, event_type, entity_id, occurred_at, body, '{}',
        'enqueued', %(now)s, 0, %(now)s, 0, 1, %(now)s, ''
    FROM rows
    ON CONFLICT (source_id, event_id) DO NOTHING
    RETURNING id
), job AS (
    {outbox}
), dup AS (
    UPDATE ingest_inboundevent e
    SET duplicates = e.duplicates + 1, last_duplicate_at = %(now)s
    FROM rows WHERE e.source_id = %(source_id)s AND e.event_id = rows.event_id
    RETURNING 1
)
SELECT (SELECT coalesce(array_agg(id), '{}') FROM new), (SELECT count(*) FROM dup)
""".replace("{uuid7}", UUID7_SQL).replace(
        "{outbox}", outbox_insert_sql(kind=KIND, source="new", dispatch="1", priority="0")
    ),
    returns="row",
)


@INSERT_EVENTS.elsewhere
def _(params):
    # One event at a time, each as INSERT_EVENT stores it; a copy counts on the stored row.
    now, source_id = params["now"], params["source_id"]
    new, duplicates = [], 0
    for event_id, event_type, entity_id, occurred_at, body in zip(
        params["event_ids"],
        params["types"],
        params["entities"],
        params["occurred"],
        params["bodies"],
        strict=True,
    ):
        fields = {
            "id": uuid7(),
            "source_id": source_id,
            "event_id": event_id,
            "body_sha256": None,
            "event_type": event_type,
            "entity_id": entity_id,
            "occurred_at": occurred_at,
            "body": body,
            "headers": {},
            "state": InboundState.ENQUEUED,
            "received_at": now,
            "next_attempt_at": now,
            "last_error": "",
            "dispatch_count": 1,
            "enqueued_at": now,
        }
        if _store_event(fields, now, with_job=True):
            new.append(fields["id"])
            continue
        stored = InboundEvent.objects.filter(source_id=source_id)
        found = stored.filter(event_id=event_id).values_list("id", flat=True).first()
        stored.filter(id=found).update(duplicates=F("duplicates") + 1, last_duplicate_at=now)
        duplicates += 1
    return new, duplicates


# --- Processing -----------------------------------------------------------------------


# The sources of a batch's events, what processing reads of them: rows of (id, slug,
# scheme, options). A statement rather than the ORM's in_bulk, which costs the worker
# about 0.3 ms of CPU a batch building the query and the model instances.
SOURCES = Statement(
    "SELECT id, slug, scheme, options FROM ingest_source WHERE id = ANY(%(ids)b::bigint[])"
)


@SOURCES.elsewhere
def _(params):
    return list(
        Source.objects.filter(id__in=params["ids"]).values_list("id", "slug", "scheme", "options")
    )


# Bodies up to this size come with the lease; a larger one (a message of several MiB: a
# mail source takes up to 25) is NULL there and read when its event is applied, so a
# batch holds at most one large body at a time, not a batch's worth (200 x 25 MiB).
# Webhook sources take 1 MiB by default: their bodies still come in the one statement.
LEASE_INLINE_BODY_BYTES = 1024 * 1024

# What LEASE and TAKE_SEQUENCED return of a leased event ``e``, in _LEASED's order.
LEASED_SQL = """e.id, e.source_id, e.event_id, e.event_type, e.entity_id, e.occurred_at,
    CASE WHEN octet_length(e.body) <= %(inline_body_bytes)s THEN e.body END,
    e.headers, e.attempt_count, e.received_at, e.sequenced"""

# enqueued → processing for the events the messages name (their dispatch only), in one
# statement that returns what processing reads (the body: up to LEASE_INLINE_BODY_BYTES,
# else NULL). Rows another worker is leasing are skipped, not waited for. Run in a
# transaction of the caller's.
#
# Each event is found by a primary-key probe, whatever the statistics say: the lateral
# subquery with its row lock cannot be flattened into a join, and the UPDATE gets the
# locked ids as one array. As a join of the ids with the table, a plan made while the
# statistics (or their absence, on a table never analyzed) put few rows in 'enqueued'
# reads every enqueued event through inbound_in_flight for each batch: a backlog costs
# each batch its whole size.
LEASE = Statement(
    """
UPDATE ingest_inboundevent e SET state = 'processing', lease_token = %(token)s,
    lease_until = %(until)s, attempt_count = e.attempt_count + 1
WHERE e.id = ANY(ARRAY(
    SELECT locked.id
    FROM unnest(%(ids)b::uuid[], %(dispatches)b::int[]) AS m(id, dispatch),
    LATERAL (
        SELECT id FROM ingest_inboundevent
        WHERE id = m.id AND dispatch_count = m.dispatch AND state = 'enqueued'
        FOR UPDATE SKIP LOCKED
    ) AS locked
))
RETURNING {leased}
""".replace("{leased}", LEASED_SQL),
    binary=True,  # the bodies as raw bytes, not hex text twice their size
)


# What LEASE returns of an event, in its order.
_LEASED = (
    "id",
    "source_id",
    "event_id",
    "event_type",
    "entity_id",
    "occurred_at",
    "inline_body",
    "headers",
    "attempt_count",
    "received_at",
    "sequenced",
)


def inline_body(limit: int) -> Case:
    """LEASE's body column for the ORM: the body up to ``limit`` bytes, else NULL."""
    return Case(
        When(LessThanOrEqual(Length("body"), limit), then=F("body")), output_field=BinaryField()
    )


@LEASE.elsewhere
def _(params):
    # The caller's transaction keeps the rows read here until the update.
    wanted = dict(zip(params["ids"], params["dispatches"], strict=True))
    read = (
        InboundEvent.objects.filter(id__in=params["ids"], state=InboundState.ENQUEUED)
        .select_for_update(skip_locked=True)
        .annotate(inline_body=inline_body(params["inline_body_bytes"]))
        .values_list(*_LEASED, "dispatch_count")
    )
    rows = [row for *row, dispatch in read if wanted[row[0]] == dispatch]
    leased = InboundEvent.objects.filter(
        id__in=[row[0] for row in rows], state=InboundState.ENQUEUED
    )
    return _leased_rows(leased, rows, params)


def _leased_rows(leased, rows: list, params: dict) -> list[tuple]:
    """The ORM's lease of ``leased`` (read as ``rows``, in _LEASED's order): processing
    under the params' token, each row with the attempt the lease starts."""
    leased.update(
        state=InboundState.PROCESSING,
        lease_token=params["token"],
        lease_until=params["until"],
        attempt_count=F("attempt_count") + 1,
    )
    attempt = _LEASED.index("attempt_count")
    return [(*row[:attempt], row[attempt] + 1, *row[attempt + 1 :]) for row in rows]


# The sequenced events (emails with an entity) of the entities ``sources``/``entities``
# (pairs), for a worker that leased some of them: leases (as LEASE does, for the
# ``token``) those that are due, enqueued or pending and due, at most ``limit`` in their
# order, waiting for another transaction that is leasing one of them and then leaving it
# out; and names, per entity, the first of its unfinished events that is not this
# worker's (leased elsewhere, waiting for its retry or its settle window, or beyond the
# limit): the events of the worker's behind it must wait. Rows of (taken, *_LEASED,
# state, next_attempt_at); a waiting event's event_id, event_type, body and headers are
# NULL. The waiting rows are read as of the statement's start: one that has just
# finished may still be named (the wait is short, never wrong). Run in a transaction of
# the caller's. Uses inbound_sequenced.
TAKE_SEQUENCED = Statement(
    """
WITH entities AS (
    SELECT * FROM unnest(%(sources)b::bigint[], %(entities)b::text[]) AS g(source_id, entity_id)
), due AS (
    SELECT e.id FROM ingest_inboundevent e
    JOIN entities g ON e.source_id = g.source_id AND e.entity_id = g.entity_id
    WHERE e.sequenced AND e.state IN ('pending', 'enqueued')
        AND (e.state = 'enqueued' OR e.next_attempt_at <= %(now)s)
    ORDER BY e.occurred_at, e.received_at, e.id
    LIMIT %(limit)s
    FOR UPDATE OF e
), taken AS (
    UPDATE ingest_inboundevent e SET state = 'processing', lease_token = %(token)s,
        lease_until = %(until)s, attempt_count = e.attempt_count + 1
    FROM due WHERE e.id = due.id
    RETURNING {leased}, e.state, e.next_attempt_at
), waiting AS (
    SELECT DISTINCT ON (e.source_id, e.entity_id) e.id, e.source_id, NULL::text,
        NULL::text, e.entity_id, e.occurred_at, NULL::bytea, NULL::jsonb, e.attempt_count,
        e.received_at, e.sequenced, e.state, e.next_attempt_at
    FROM ingest_inboundevent e
    JOIN entities g ON e.source_id = g.source_id AND e.entity_id = g.entity_id
    WHERE e.sequenced AND e.state IN ('pending', 'enqueued', 'processing')
        AND e.lease_token IS DISTINCT FROM %(token)s
        AND e.id NOT IN (SELECT id FROM taken)
    ORDER BY e.source_id, e.entity_id, e.occurred_at, e.received_at, e.id
)
SELECT true, * FROM taken
UNION ALL
SELECT false, * FROM waiting
""".replace("{leased}", LEASED_SQL),
    binary=True,
)


@TAKE_SEQUENCED.elsewhere
def _(params):
    # The caller's transaction (IMMEDIATE on SQLite: the write lock from its start) keeps
    # the rows read here as they are until the update.
    entities = Q(pk__in=[])
    for source_id, entity_id in zip(params["sources"], params["entities"], strict=True):
        entities |= Q(source_id=source_id, entity_id=entity_id)
    siblings = InboundEvent.objects.filter(entities, sequenced=True).order_by(
        "occurred_at", "received_at", "id"
    )
    is_due = Q(state=InboundState.ENQUEUED) | Q(
        state=InboundState.PENDING, next_attempt_at__lte=params["now"]
    )
    due = list(siblings.filter(is_due).values_list("id", flat=True)[: params["limit"]])
    read = list(
        siblings.filter(id__in=due)
        .annotate(inline_body=inline_body(params["inline_body_bytes"]))
        .values_list(*_LEASED, "next_attempt_at")
    )
    rows = [row[:-1] for row in read]
    taken = _leased_rows(InboundEvent.objects.filter(is_due, id__in=due), rows, params)
    waiting: dict = {}
    unfinished = siblings.filter(
        state__in=[InboundState.PENDING, InboundState.ENQUEUED, InboundState.PROCESSING]
    ).exclude(lease_token=params["token"])
    for i, source_id, entity_id, occurred_at, *rest in unfinished.values_list(
        "id", "source_id", "entity_id", "occurred_at", "attempt_count", "received_at",
        "sequenced", "state", "next_attempt_at",
    ):  # fmt: skip
        # As the PostgreSQL text reads them: no event id, type, body or headers.
        waiting.setdefault(
            (source_id, entity_id),
            (False, i, source_id, None, None, entity_id, occurred_at, None, None, *rest),
        )
    due_at = {row[0]: row[-1] for row in read}
    return [(True, *row, InboundState.PROCESSING, due_at[row[0]]) for row in taken] + list(
        waiting.values()
    )


# The applied version of each key, its row locked to the end of the transaction (the
# entity locks already keep other workers off these keys): rows of (key, applied at), in
# key order, the order the rows are locked in. One primary-key probe per key, whatever
# the table's size or statistics: the lateral subquery with its row lock cannot be
# flattened into a join, so no plan scans the table. As "key = ANY(keys)", the plan a
# worker's connection prepares while the table is small is a sequential scan, and it is
# kept as the table grows: each batch then compares its 200 keys with every row.
LOCK_VERSIONS = Statement("""
WITH keys AS MATERIALIZED (
    SELECT DISTINCT key FROM unnest(%(keys)b::text[]) AS key ORDER BY key
)
SELECT v.key, v.applied_at FROM keys, LATERAL (
    SELECT key, applied_at FROM ingest_entityversion WHERE key = keys.key FOR UPDATE
) AS v
""")


@LOCK_VERSIONS.elsewhere
def _(params):
    return list(
        EntityVersion.objects.select_for_update()
        .filter(key__in=params["keys"])
        .order_by("key")
        .values_list("key", "applied_at")
    )


def _advance_version(params):
    # COMPLETE's versions as the ORM writes them: the entity's version moves to this
    # event unless a newer one was applied already, the row locked to the end of the
    # transaction.
    applied = (
        EntityVersion.objects.select_for_update()
        .filter(key=params["key"])
        .values_list("applied_at", flat=True)
        .first()
    )
    if applied is not None and params["applied_at"] < applied:
        return
    EntityVersion.objects.update_or_create(
        key=params["key"],
        defaults={"applied_at": params["applied_at"], "event_id": params["event_id"]},
    )


# A successful run's bookkeeping in one statement, for one event or a batch: the guarded
# transitions out of processing (for the lease holder only), every handler run, each
# entity's version moved to its latest applied event, and the entity locks given back.
# The caller rolls the whole transaction back unless every event's transition happened:
# the row is (events moved out of processing,).
COMPLETE = Statement(
    """
WITH done AS (
    UPDATE ingest_inboundevent e SET state = d.state, lease_until = NULL, lease_token = NULL,
        last_error = '', processed_at = %(now)s
    FROM unnest(%(ids)b::uuid[], %(states)b::text[]) AS d(id, state)
    WHERE e.id = d.id AND e.state = 'processing' AND e.lease_token = %(token)s
    RETURNING e.id
), runs AS (
    INSERT INTO ingest_handlerrun (event_id, handler, attempt, started_at, duration_ms,
        outcome, error)
    SELECT r.*, '' FROM unnest(%(run_events)b::uuid[], %(run_handlers)b::text[],
        %(run_attempts)b::int[], %(run_started)b::timestamptz[], %(run_durations)b::float8[],
        %(run_outcomes)b::text[]) AS r
), versions AS (
    INSERT INTO ingest_entityversion (key, applied_at, event_id)
    SELECT * FROM unnest(%(version_keys)b::text[], %(version_times)b::timestamptz[],
        %(version_events)b::uuid[])
    ON CONFLICT (key) DO UPDATE SET applied_at = EXCLUDED.applied_at,
        event_id = EXCLUDED.event_id
    WHERE ingest_entityversion.applied_at <= EXCLUDED.applied_at
), unlock AS ({release})
SELECT count(*) FROM done
""".replace("{release}", RELEASE_SQL.strip()),
    returns="row",
)


@COMPLETE.elsewhere
def _(params):
    # The runs, the guarded transitions, then, if every lease held, versions and locks.
    HandlerRun.objects.bulk_create(
        [
            HandlerRun(
                event_id=event_id,
                handler=handler,
                attempt=attempt,
                started_at=started_at,
                duration_ms=duration_ms,
                outcome=outcome,
                error="",
            )
            for event_id, handler, attempt, started_at, duration_ms, outcome in zip(
                params["run_events"],
                params["run_handlers"],
                params["run_attempts"],
                params["run_started"],
                params["run_durations"],
                params["run_outcomes"],
                strict=True,
            )
        ]
    )
    done = 0
    for state in dict.fromkeys(params["states"]):
        ids = [i for i, s in zip(params["ids"], params["states"], strict=True) if s == state]
        done += InboundEvent.objects.filter(
            id__in=ids, state=InboundState.PROCESSING, lease_token=params["token"]
        ).update(
            state=state,
            lease_until=None,
            lease_token=None,
            last_error="",
            processed_at=params["now"],
        )
    if done < len(params["ids"]):
        return (done,)  # a lease was lost: the caller rolls back, nothing more to write
    for key, applied_at, event_id in zip(
        params["version_keys"], params["version_times"], params["version_events"], strict=True
    ):
        _advance_version({"key": key, "applied_at": applied_at, "event_id": event_id})
    for key in params["lock_keys"]:
        entity_lock_release(key=key, owner=params["owner"])
    return (done,)
