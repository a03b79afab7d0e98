"""The workers' statements: the lease (enqueued → leased), the record of successes and
failures with every attempt row and the overview's tallies, and the lease test.
"""

import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import UTC

from django.db.models import F

from ..core.sql import Statement
from ..jobs import wakeup
from ..models import (
    LATENCY_BOUNDS_MS,
    LATENCY_COLUMNS,
    Attempt,
    AttemptMinute,
    Delivery,
    Endpoint,
    EndpointHour,
    Outcome,
)
from . import DEAD, ENQUEUED, LEASED, PENDING, SUCCEEDED

# The worker's statements (lease, success, failure) find a batch of rows by primary key.
# Their state test is written ``(d.state || '') = '...'`` so that the planner cannot
# answer it from the partial index delivery_in_flight: it otherwise reads every row in
# flight to find the batch's (its estimate of the rows in flight comes from the last
# ANALYZE), which with 5,000 in flight took 1.5-2.5 ms of each 200-row statement where
# the primary key lookups take 0.5 ms.
#
# Nor may the planner join the batch to the whole table: it prices 200 primary key
# lookups above a sequential scan and a hash join up to about 25,000 rows (dead versions
# included), so a custom plan (a connection's first runs, and every run behind a pooler,
# which prepares nothing) read the table: 3 ms of a 200-row LEASE at 20,000 rows, where
# the lookups take 0.4 ms. So each array reaches unnest through a scalar subquery,
# ``unnest((SELECT %(ids)b::uuid[]), ...)``: the planner no longer sees the array's
# length and estimates the batch at 10 rows, as in a generic plan, and a custom plan
# joins it by primary key too.
#
# One statement: lock the wanted rows still enqueued at the message's dispatch (primary
# key lookups), skip rows another worker holds, and move each by its endpoint: lease it,
# returning what sending needs, the event body included; for a disabled endpoint, finish
# it (dead, endpoint_disabled); for a paused one, hold it: back to pending, no attempt
# counted, to wait for the resume (the scan admitted it before the pause committed).
# Run in a transaction of the caller's. Params: {ids, dispatches, until, token, now};
# rows (id, event, endpoint, tenant, event type, body, attempt count, policy attempts,
# the state it is in now: leased, dead or pending, trace context).
LEASE = Statement(
    """
WITH wanted AS (
    SELECT * FROM unnest((SELECT %(ids)b::uuid[]), (SELECT %(dispatches)b::int[])) AS w(id, n)
),
locked AS (
    SELECT d.id, CASE WHEN NOT ep.enabled THEN 'dead'
        WHEN ep.paused_at IS NOT NULL THEN 'pending' ELSE 'leased' END AS next
    FROM deliveries_delivery d JOIN wanted ON wanted.id = d.id
    JOIN deliveries_endpoint ep ON ep.id = d.endpoint_id
    WHERE (d.state || '') = 'enqueued' AND d.dispatch_count = wanted.n
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE deliveries_delivery d SET
    state = locked.next,
    lease_until = CASE WHEN locked.next = 'leased' THEN %(until)s::timestamptz END,
    lease_token = CASE WHEN locked.next = 'leased' THEN %(token)s::uuid END,
    attempt_count = d.attempt_count + (locked.next = 'leased')::int,
    policy_attempts = d.policy_attempts + (locked.next = 'leased')::int,
    finished_at = CASE WHEN locked.next = 'dead' THEN %(now)s::timestamptz END,
    last_outcome = CASE WHEN locked.next = 'dead' THEN 'endpoint_disabled' ELSE d.last_outcome END,
    last_error = CASE WHEN locked.next = 'dead' THEN 'endpoint disabled' ELSE d.last_error END,
    updated_at = %(now)s
FROM locked, deliveries_event e
WHERE d.id = locked.id AND e.id = d.event_id
RETURNING d.id, d.event_id, d.endpoint_id, d.tenant_id, e.event_type, e.body,
    d.attempt_count, d.policy_attempts, d.state, e.trace_context
""",
    # The bodies as raw bytes: in text format bytea travels hex-encoded, twice its size,
    # encoded by the server and decoded here.
    binary=True,
)


@LEASE.elsewhere
def _(params):
    # SQLite: its IMMEDIATE transactions serialise writers.
    now = params["now"]
    wanted = dict(zip(params["ids"], params["dispatches"], strict=True))
    rows = [
        r
        for r in Delivery.objects.filter(id__in=wanted, state=ENQUEUED).values_list(
            "id", "dispatch_count", "endpoint__enabled", "endpoint__paused_at"
        )
        if wanted.get(r[0]) == r[1]
    ]
    disabled = [r[0] for r in rows if not r[2]]
    held = [r[0] for r in rows if r[2] and r[3] is not None]
    live = [r[0] for r in rows if r[2] and r[3] is None]
    Delivery.objects.filter(id__in=disabled, state=ENQUEUED).update(
        state=DEAD,
        finished_at=now,
        last_outcome=Outcome.ENDPOINT_DISABLED,
        last_error="endpoint disabled",
        updated_at=now,
    )
    Delivery.objects.filter(id__in=held, state=ENQUEUED).update(state=PENDING, updated_at=now)
    Delivery.objects.filter(id__in=live, state=ENQUEUED).update(
        state=LEASED,
        lease_until=params["until"],
        lease_token=params["token"],
        attempt_count=F("attempt_count") + 1,
        policy_attempts=F("policy_attempts") + 1,
        updated_at=now,
    )
    unsent = [(d, DEAD) for d in disabled] + [(d, PENDING) for d in held]
    return [
        (*r[:8], LEASED, r[8])
        for r in Delivery.objects.filter(id__in=live).values_list(
            "id",
            "event_id",
            "endpoint_id",
            "tenant_id",
            "event__event_type",
            "event__body",
            "attempt_count",
            "policy_attempts",
            "event__trace_context",
        )
    ] + [(d, None, None, None, "", b"", 0, 0, now_state, "") for d, now_state in unsent]


def held_leases(ids: Sequence[uuid.UUID], tokens: Sequence[uuid.UUID]) -> set[uuid.UUID]:
    """The deliveries among ``ids`` whose lease (``tokens``, pairwise) the recording
    worker still holds, locked until the transaction ends: the guard the PostgreSQL
    record statements write in their WHERE."""
    return {row[0] for row in HELD_LEASES({"ids": list(ids), "tokens": list(tokens)})}


# held_leases on PostgreSQL: by primary key, as the worker's statements find their rows
# (see LEASE). The ORM's ``state = 'leased'`` read every row in flight through
# delivery_in_flight: 0.9 ms for 200 ids with 5,000 leased. Params: {ids, tokens},
# pairwise; rows (id,) of the deliveries whose lease is held, locked.
HELD_LEASES = Statement("""
SELECT d.id FROM unnest((SELECT %(ids)b::uuid[]), (SELECT %(tokens)b::uuid[])) AS v(id, token)
JOIN deliveries_delivery d ON d.id = v.id
WHERE (d.state || '') = 'leased' AND d.lease_token = v.token
FOR UPDATE OF d
""")


@HELD_LEASES.elsewhere
def _(params):
    ids, tokens = params["ids"], params["tokens"]
    pairs = set(
        Delivery.objects.filter(id__in=ids, state=LEASED, lease_token__in=set(tokens))
        .select_for_update()
        .values_list("id", "lease_token")
    )
    return [(i,) for i, token in zip(ids, tokens, strict=True) if (i, token) in pairs]


# Successes of a batch in one statement; RETURNING names the rows whose lease was held.
# One success stops its endpoint's failure clock, in the same statement. Params: {now,
# ids, tokens, statuses}; rows (id,) of the deliveries that succeeded. The same CTEs
# begin RECORD, the worker's statement.
_SUCCEEDED_SQL = """done AS (
    UPDATE deliveries_delivery d SET state = 'succeeded', finished_at = %(now)s,
        last_outcome = 'success', last_status_code = v.status, last_error = '',
        lease_until = NULL, lease_token = NULL, last_attempt_at = %(now)s,
        updated_at = %(now)s
    FROM unnest((SELECT %(ids)b::uuid[]), (SELECT %(tokens)b::uuid[]),
        (SELECT %(statuses)b::int[])) AS v(id, token, status)
    WHERE d.id = v.id AND (d.state || '') = 'leased' AND d.lease_token = v.token
    RETURNING d.id, d.endpoint_id
), healed AS (
    UPDATE deliveries_endpoint SET failing_since = NULL
    WHERE id IN (SELECT endpoint_id FROM done) AND failing_since IS NOT NULL
)"""
SUCCEED = Statement(f"WITH {_SUCCEEDED_SQL}\nSELECT id FROM done")


@SUCCEED.elsewhere
def _(params):
    now = params["now"]
    held = held_leases(params["ids"], params["tokens"])
    by_status: dict[int, list[uuid.UUID]] = defaultdict(list)
    for delivery_id, status in zip(params["ids"], params["statuses"], strict=True):
        if delivery_id in held:
            by_status[status].append(delivery_id)
    for status, ids in by_status.items():
        Delivery.objects.filter(id__in=ids, state=LEASED).update(
            state=SUCCEEDED,
            finished_at=now,
            last_outcome=Outcome.SUCCESS,
            last_status_code=status,
            last_error="",
            lease_until=None,
            lease_token=None,
            last_attempt_at=now,
            updated_at=now,
        )
    Endpoint.objects.filter(
        id__in=Delivery.objects.filter(id__in=held).values("endpoint_id"),
        failing_since__isnull=False,
    ).update(failing_since=None)
    return [(i,) for i in held]


# Failures of a batch in one statement, each row with its own next state: pending at its
# next attempt time (a retry) or dead. The rows were locked by held_leases, lease held.
# Params: {now, and per row: ids, tokens, states, next (attempt at, or None), finished
# (or None), outcomes, statuses, errors}.
FAIL = Statement(
    """
UPDATE deliveries_delivery d SET state = v.state,
    next_attempt_at = coalesce(v.next_attempt_at, d.next_attempt_at),
    finished_at = coalesce(v.finished_at, d.finished_at),
    last_outcome = v.outcome, last_status_code = v.status, last_error = v.error,
    lease_until = NULL, lease_token = NULL, last_attempt_at = %(now)s, updated_at = %(now)s
FROM unnest((SELECT %(ids)b::uuid[]), (SELECT %(tokens)b::uuid[]),
    (SELECT %(states)b::text[]), (SELECT %(next)b::timestamptz[]),
    (SELECT %(finished)b::timestamptz[]), (SELECT %(outcomes)b::text[]),
    (SELECT %(statuses)b::int[]), (SELECT %(errors)b::text[]))
    AS v(id, token, state, next_attempt_at, finished_at, outcome, status, error)
WHERE d.id = v.id AND (d.state || '') = 'leased' AND d.lease_token = v.token
""",
    returns="nothing",
)


@FAIL.elsewhere
def _(params):
    # One UPDATE each: an endpoint that is down fails every delivery of the batch, but
    # SQLite has no unnest to do them in one.
    now = params["now"]
    for delivery_id, token, state, next_at, finished, outcome, status, error in zip(
        params["ids"],
        params["tokens"],
        params["states"],
        params["next"],
        params["finished"],
        params["outcomes"],
        params["statuses"],
        params["errors"],
        strict=True,
    ):
        fields = {
            "lease_until": None,
            "lease_token": None,
            "state": state,
            "last_attempt_at": now,
            "updated_at": now,
            "last_outcome": outcome,
            "last_status_code": status,
            "last_error": error,
        }
        if next_at is not None:
            fields["next_attempt_at"] = next_at
        if finished is not None:
            fields["finished_at"] = finished
        Delivery.objects.filter(id=delivery_id, state=LEASED, lease_token=token).update(**fields)


# The columns of an attempt row, in APPEND_ATTEMPTS's order.
ATTEMPT_COLUMNS = (
    "delivery_id",
    "endpoint_id",
    "number",
    "started_at",
    "duration_ms",
    "status_code",
    "outcome",
    "error_kind",
    "error",
    "ambiguous",
    "response_body",
    "response_truncated",
    "request_headers",
    "recorded",
    "worker",
)

# The attempt rows: COPY, the cheapest bulk insert. Params: the rows, in ATTEMPT_COLUMNS'
# order, request_headers as a psycopg ``Jsonb``.
APPEND_ATTEMPTS = Statement(
    f"COPY deliveries_attempt ({', '.join(ATTEMPT_COLUMNS)}) FROM STDIN",
    returns="nothing",
    copy_in=True,
)


@APPEND_ATTEMPTS.elsewhere
def _(params):
    rows = [dict(zip(ATTEMPT_COLUMNS, row, strict=True)) for row in params]
    for row in rows:
        row["request_headers"] = row["request_headers"].obj
    Attempt.objects.bulk_create([Attempt(**row) for row in rows])


# The attempts of a batch added to the overview's tallies (models.AttemptMinute and
# EndpointHour), in the recording transaction, in the statement that records the batch
# (RECORD) or one of their own (TALLY_ATTEMPTS): a few rows upserted, however many
# attempts. The writer is this connection (pg_backend_pid), so no two transactions add to
# one row at once and recording workers never wait on each other here; the rows are
# upserted in key order all the same. Both are INSERTs over a relation ``a`` (endpoint_id,
# outcome, started_at, duration_ms) of the calling statement, one row per attempt.
_LATENCY_SQL = (
    ",\n    ".join(
        f"count(*) FILTER (WHERE duration_ms > {low} AND duration_ms <= {high})"
        for low, high in zip((-1, *LATENCY_BOUNDS_MS[:-1]), LATENCY_BOUNDS_MS, strict=True)
    )
    + f",\n    count(*) FILTER (WHERE duration_ms > {LATENCY_BOUNDS_MS[-1]})"
)
_TALLY_MINUTES_SQL = """
INSERT INTO deliveries_attemptminute (minute, outcome, writer, attempts)
SELECT date_trunc('minute', started_at, 'UTC'), outcome, pg_backend_pid(), count(*)
FROM a GROUP BY 1, 2 ORDER BY 1, 2
ON CONFLICT (minute, outcome, writer)
DO UPDATE SET attempts = deliveries_attemptminute.attempts + excluded.attempts
"""
_TALLY_HOURS_SQL = f"""
INSERT INTO deliveries_endpointhour (hour, endpoint_id, outcome, writer, attempts, total_ms,
    {", ".join(LATENCY_COLUMNS)})
SELECT date_trunc('hour', started_at, 'UTC'), endpoint_id, outcome, pg_backend_pid(),
    count(*), sum(duration_ms),
    {_LATENCY_SQL}
FROM a GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
ON CONFLICT (hour, endpoint_id, outcome, writer) DO UPDATE SET
    attempts = deliveries_endpointhour.attempts + excluded.attempts,
    total_ms = deliveries_endpointhour.total_ms + excluded.total_ms,
    {", ".join(f"{c} = deliveries_endpointhour.{c} + excluded.{c}" for c in LATENCY_COLUMNS)}
"""
# Params: {endpoints, outcomes, started, durations}, one entry per attempt.
TALLY_ATTEMPTS = Statement(
    f"""
WITH a AS (
    SELECT * FROM unnest(%(endpoints)b::uuid[], %(outcomes)b::text[],
        %(started)b::timestamptz[], %(durations)b::float8[])
        AS a(endpoint_id, outcome, started_at, duration_ms)
), minutes AS ({_TALLY_MINUTES_SQL})
{_TALLY_HOURS_SQL}
""",
    returns="nothing",
)


def latency_column(duration_ms: float) -> str:
    """The EndpointHour column that counts an attempt of ``duration_ms``."""
    for bound, column in zip(LATENCY_BOUNDS_MS, LATENCY_COLUMNS, strict=False):
        if duration_ms <= bound:
            return column
    return LATENCY_COLUMNS[-1]


@TALLY_ATTEMPTS.elsewhere
def _(params):
    # SQLite: one writer at a time (IMMEDIATE transactions); the writer is 0.
    minutes: Counter = Counter()
    hours: dict[tuple, Counter] = defaultdict(Counter)
    for endpoint_id, outcome, started, duration in zip(
        params["endpoints"], params["outcomes"], params["started"], params["durations"],
        strict=True,
    ):  # fmt: skip
        utc = started.astimezone(UTC)
        minutes[(utc.replace(second=0, microsecond=0), outcome)] += 1
        hour = hours[(utc.replace(minute=0, second=0, microsecond=0), endpoint_id, outcome)]
        hour["attempts"] += 1
        hour["total_ms"] += duration
        hour[latency_column(duration)] += 1
    for (minute, outcome), n in sorted(minutes.items()):
        updated = AttemptMinute.objects.filter(minute=minute, outcome=outcome, writer=0).update(
            attempts=F("attempts") + n
        )
        if not updated:
            AttemptMinute.objects.create(minute=minute, outcome=outcome, writer=0, attempts=n)
    for (hour, endpoint_id, outcome), counts in sorted(hours.items(), key=lambda i: str(i[0])):
        key = {"hour": hour, "endpoint_id": endpoint_id, "outcome": outcome, "writer": 0}
        updated = EndpointHour.objects.filter(**key).update(
            **{c: F(c) + n for c, n in counts.items()}
        )
        if not updated:
            EndpointHour.objects.create(**key, **counts)


# A recorded batch's successes, every attempt row and the attempts' tallies, in one
# statement: SUCCEED's transition (and its endpoints' failure clocks stopped), the
# attempt rows (APPEND_ATTEMPTS' columns) and TALLY_ATTEMPTS' upserts, one round trip for
# what were three. An attempt is ``recorded`` when the params say its lease was held (the
# failures, moved by FAIL before this) or its delivery succeeded here. When a delivery
# left its lease (``freed``: failures moved, or a success here), the statement also wakes
# the scheduler (deliveries.jobs.wakeup.FREED: slots under the ceilings are free),
# delivered with the commit as PUBLISH's is; its row is (None,). Params: SUCCEED's {now,
# ids, tokens, statuses}, ``freed`` and one array per ATTEMPT_COLUMNS name, one entry per
# attempt; rows (id,) of the deliveries that succeeded, and (None,) for the wake-up.
_ATTEMPT_TYPES = {
    "delivery_id": "uuid",
    "endpoint_id": "uuid",
    "number": "int",
    "started_at": "timestamptz",
    "duration_ms": "float8",
    "status_code": "int",
    "outcome": "text",
    "error_kind": "text",
    "error": "text",
    "ambiguous": "bool",
    "response_body": "text",
    "response_truncated": "bool",
    "request_headers": "jsonb",
    "recorded": "bool",
    "worker": "text",
}
_ATTEMPT_VALUES = ", ".join(
    "a.recorded OR a.delivery_id IN (SELECT id FROM done)" if c == "recorded" else f"a.{c}"
    for c in ATTEMPT_COLUMNS
)
RECORD = Statement(f"""
WITH {_SUCCEEDED_SQL}, a AS (
    SELECT * FROM unnest({", ".join(f"%({c})b::{_ATTEMPT_TYPES[c]}[]" for c in ATTEMPT_COLUMNS)})
        AS a({", ".join(ATTEMPT_COLUMNS)})
), attempts AS (
    INSERT INTO deliveries_attempt ({", ".join(ATTEMPT_COLUMNS)})
    SELECT {_ATTEMPT_VALUES} FROM a
), minutes AS ({_TALLY_MINUTES_SQL}
), hours AS ({_TALLY_HOURS_SQL}
), freed AS (
    SELECT pg_notify('{wakeup.FREED}', '') FROM (SELECT 1) AS one
    WHERE %(freed)s OR EXISTS (SELECT 1 FROM done)
)
SELECT id FROM done
UNION ALL SELECT NULL FROM freed
""")


@RECORD.elsewhere
def _(params):
    done = (
        SUCCEED.portable({k: params[k] for k in ("now", "ids", "tokens", "statuses")})
        if params["ids"]
        else []
    )
    succeeded = {row[0] for row in done}
    columns = [params[c] for c in ATTEMPT_COLUMNS]
    rows = [dict(zip(ATTEMPT_COLUMNS, row, strict=True)) for row in zip(*columns, strict=True)]
    for row in rows:
        row["recorded"] = row["recorded"] or row["delivery_id"] in succeeded
    # No notifications here: the scheduler polls (deliveries.jobs.wakeup).
    APPEND_ATTEMPTS.portable([tuple(row[c] for c in ATTEMPT_COLUMNS) for row in rows])
    TALLY_ATTEMPTS.portable(
        {
            "endpoints": params["endpoint_id"],
            "outcomes": params["outcome"],
            "started": params["started_at"],
            "durations": params["duration_ms"],
        }
    )
    return done
