"""The statements of the outbound fast path, each defined once by name: its PostgreSQL
text and, directly below it, the same effect written with the ORM for SQLite
(``deliveries.core.sql.Statement``). A statement takes the same parameters and gives
back the same shape whichever spelling runs, so admission, the state machine, publishing
and the reads beside them never ask which database they are on.

Array parameters travel in binary format (``%(name)b::type[]``, see deliveries.core.sql).
Where a statement is PostgreSQL's own work with no SQLite meaning (an advisory lock), its
ORM spelling does nothing and says why: SQLite's IMMEDIATE transactions take the write
lock at BEGIN, which serialises what the lock serialises.
"""

import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import UTC

from django.db.models import Count, F, Min, Q

from .core.ids import UUID7_SQL
from .core.sql import Statement
from .jobs import outbox, wakeup
from .models import (
    LATENCY_BOUNDS_MS,
    LATENCY_COLUMNS,
    Attempt,
    AttemptMinute,
    Delivery,
    DeliveryState,
    EgressAllowance,
    Endpoint,
    EndpointHour,
    EndpointSecret,
    Event,
    Outcome,
)

# The job kind of a delivery: the outbox rows written here carry it.
DELIVERY_KIND = "delivery"

PENDING = DeliveryState.PENDING
ENQUEUED = DeliveryState.ENQUEUED
LEASED = DeliveryState.LEASED
SUCCEEDED = DeliveryState.SUCCEEDED
DEAD = DeliveryState.DEAD


# --- Admission ------------------------------------------------------------------------

# Serialises admission between schedulers so that the in-flight ceilings and the rate
# buckets are counted once. An admission page is a few milliseconds of work, so
# overlapping schedulers take turns page by page. Params: [ADMISSION_LOCK_ID].
ADMISSION_LOCK_ID = 0x77656268  # "webh"
TAKE_ADMISSION_LOCK = Statement("SELECT pg_advisory_xact_lock(%s)", returns="nothing", bound=False)


@TAKE_ADMISSION_LOCK.elsewhere
def _(params):
    pass  # SQLite: the IMMEDIATE transaction already holds the write lock


# Grouped by the uuids, cast once per group: grouping by the casts cast two ids of every
# row in flight (3 ms a pass with 5,000 in flight, against 1 ms). By the partial index
# delivery_in_flight. Rows (tenant, endpoint, rows enqueued or leased), ids as text.
IN_FLIGHT = Statement("""
SELECT tenant_id::text, endpoint_id::text, n FROM (
    SELECT tenant_id, endpoint_id, count(*) AS n FROM deliveries_delivery
    WHERE state IN ('enqueued', 'leased') GROUP BY tenant_id, endpoint_id
) AS in_flight
""")


@IN_FLIGHT.elsewhere
def _(params):
    return [
        (str(r["tenant_id"]), str(r["endpoint_id"]), r["n"])
        for r in Delivery.objects.filter(state__in=(ENQUEUED, LEASED))
        .values("tenant_id", "endpoint_id")
        .annotate(n=Count("id"))
        .order_by()
    ]


# Every admission pass asks twice, so on PostgreSQL it is one prepared statement (the
# ORM's compilation cost more than the query). Params: [endpoint ids as text]; rows (id,
# max_concurrency, rate_limit).
ENDPOINT_LIMITS = Statement("""
SELECT id, max_concurrency, rate_limit FROM deliveries_endpoint WHERE id = ANY(%b::uuid[])
""")


@ENDPOINT_LIMITS.elsewhere
def _(params):
    (ids,) = params
    return list(
        Endpoint.objects.filter(id__in=ids).values_list("id", "max_concurrency", "rate_limit")
    )


# The paused endpoints (Endpoint.paused_at), whose due rows admission leaves out of its
# scans as it leaves out a full endpoint's: they stay pending, neither admitted nor
# dead-lettered. By the partial index endpoint_paused, so an admission pass pays for the
# paused endpoints, not for the table. Rows (id,), as text.
PAUSED_ENDPOINTS = Statement("SELECT id::text FROM deliveries_endpoint WHERE paused_at IS NOT NULL")


@PAUSED_ENDPOINTS.elsewhere
def _(params):
    return [
        (str(i),)
        for i in Endpoint.objects.filter(paused_at__isnull=False).values_list("id", flat=True)
    ]


# Due rows, highest priority and oldest first, leaving out saturated tenants and
# endpoints. Uses the partial index delivery_due. No row locks: the admission lock
# serialises schedulers, and ENQUEUE re-checks the state, so a row that changed since
# (cancelled, say) is skipped. (Locking the scan would write the header of every scanned
# tuple, rows held back included.) Its cost follows the rows it reads past, so with
# tenants or endpoints left out it comes last (deliveries.admission._scan_due).
# Params: {now, tenants, endpoints (ids as text), limit}; rows (id, tenant, endpoint,
# priority), ids as text.
SCAN_DUE = Statement("""
SELECT id::text, tenant_id::text, endpoint_id::text, priority FROM deliveries_delivery
WHERE state = 'pending' AND next_attempt_at <= %(now)s
    AND tenant_id <> ALL(%(tenants)b::uuid[]) AND endpoint_id <> ALL(%(endpoints)b::uuid[])
ORDER BY priority DESC, next_attempt_at
LIMIT %(limit)s
""")


def _due(now):
    return Delivery.objects.filter(state=PENDING, next_attempt_at__lte=now).order_by(
        "-priority", "next_attempt_at"
    )


_SCANNED = ("id", "tenant_id", "endpoint_id", "priority")


@SCAN_DUE.elsewhere
def _(params):
    candidates = _due(params["now"])
    if params["tenants"]:
        candidates = candidates.exclude(tenant_id__in=params["tenants"])
    if params["endpoints"]:
        candidates = candidates.exclude(endpoint_id__in=params["endpoints"])
    return [
        (str(i), str(t), str(e), p)
        for i, t, e, p in candidates.values_list(*_SCANNED)[: params["limit"]]
    ]


# The same, leaving out saturated tenants and endpoints, over a bounded window of the due
# rows (delivery_due): the rows of the first ``window`` due rows that are not left out,
# and how many rows the window held. Most passes end here. Params: SCAN_DUE's and
# ``window``; rows (id, tenant, endpoint, priority, rows in the window), one row of four
# NULLs and the count when none is picked.
SCAN_DUE_WINDOW = Statement("""
WITH w AS MATERIALIZED (
    SELECT id, tenant_id, endpoint_id, priority, next_attempt_at FROM deliveries_delivery
    WHERE state = 'pending' AND next_attempt_at <= %(now)s
    ORDER BY priority DESC, next_attempt_at
    LIMIT %(window)s
), picked AS (
    SELECT * FROM w
    WHERE tenant_id <> ALL(%(tenants)b::uuid[]) AND endpoint_id <> ALL(%(endpoints)b::uuid[])
    ORDER BY priority DESC, next_attempt_at
    LIMIT %(limit)s
)
SELECT p.id::text, p.tenant_id::text, p.endpoint_id::text, p.priority, n.total
FROM (SELECT count(*) AS total FROM w) n LEFT JOIN picked p ON true
ORDER BY p.priority DESC, p.next_attempt_at
""")


@SCAN_DUE_WINDOW.elsewhere
def _(params):
    window = list(_due(params["now"]).values_list(*_SCANNED)[: params["window"]])
    tenants, endpoints = set(params["tenants"]), set(params["endpoints"])
    picked = [
        (str(i), str(t), str(e), p, len(window))
        for i, t, e, p in window
        if str(t) not in tenants and str(e) not in endpoints
    ][: params["limit"]]
    return picked or [(None, None, None, None, len(window))]


# When the window was all rows left out (one hot endpoint's backlog, say), the same
# answer by endpoint, so that no row of a saturated endpoint is read: a skip scan over
# delivery_due_endpoint lists the endpoints with pending rows (one index probe each, due
# or not: retries in backoff count), up to ``most`` + 1 of them ... Rows (endpoint,).
DUE_ENDPOINTS = Statement("""
WITH RECURSIVE endpoints AS (
    (SELECT endpoint_id, 1 AS n FROM deliveries_delivery WHERE state = 'pending'
     ORDER BY endpoint_id LIMIT 1)
    UNION ALL
    SELECT (SELECT d.endpoint_id FROM deliveries_delivery d
            WHERE d.state = 'pending' AND d.endpoint_id > e.endpoint_id
            ORDER BY d.endpoint_id LIMIT 1), e.n + 1
    FROM endpoints e WHERE e.endpoint_id IS NOT NULL AND e.n <= %(most)s
)
SELECT endpoint_id::text FROM endpoints WHERE endpoint_id IS NOT NULL
""")


@DUE_ENDPOINTS.elsewhere
def _(params):
    waiting = (
        Delivery.objects.filter(state=PENDING)
        .order_by("endpoint_id")
        .values_list("endpoint_id", flat=True)
        .distinct()
    )
    return [(str(e),) for e in waiting[: params["most"] + 1]]


# ... then each of them not left out, whose tenant is not left out either (a delivery's
# tenant is its endpoint's), gives its first due rows; the best of those are the answer.
# Params: SCAN_DUE's and ``candidates``; rows as SCAN_DUE's.
SCAN_DUE_OF_ENDPOINTS = Statement("""
SELECT r.id::text, r.tenant_id::text, r.endpoint_id::text, r.priority
FROM unnest(%(candidates)b::uuid[]) AS e(endpoint_id)
JOIN deliveries_endpoint ep ON ep.id = e.endpoint_id
CROSS JOIN LATERAL (
    SELECT d.id, d.tenant_id, d.endpoint_id, d.priority, d.next_attempt_at
    FROM deliveries_delivery d
    WHERE d.state = 'pending' AND d.endpoint_id = e.endpoint_id
        AND d.next_attempt_at <= %(now)s
    ORDER BY d.priority DESC, d.next_attempt_at
    LIMIT %(limit)s
) r
WHERE ep.tenant_id <> ALL(%(tenants)b::uuid[])
ORDER BY r.priority DESC, r.next_attempt_at
LIMIT %(limit)s
""")


@SCAN_DUE_OF_ENDPOINTS.elsewhere
def _(params):
    candidates = _due(params["now"]).filter(endpoint_id__in=params["candidates"])
    if params["tenants"]:
        candidates = candidates.exclude(tenant_id__in=params["tenants"])
    return [
        (str(i), str(t), str(e), p)
        for i, t, e, p in candidates.values_list(*_SCANNED)[: params["limit"]]
    ]


# pending → enqueued and one outbox row per delivery, in one statement. The rows are
# found by primary key; the state test is written so that the planner cannot read the
# partial indexes of pending rows instead (see LEASE): with 15,000 pending it read them
# all, filtering on the 200 ids, 8.9 ms against 0.3 ms. Params: {ids, now}; the count is
# of the outbox rows written, one per delivery enqueued.
ENQUEUE = Statement(
    """
WITH admitted AS (
    UPDATE deliveries_delivery SET state = 'enqueued', enqueued_at = %(now)s,
        dispatch_count = dispatch_count + 1, updated_at = %(now)s
    WHERE id = ANY(%(ids)b::uuid[]) AND (state || '') = 'pending' AND next_attempt_at <= %(now)s
    RETURNING id, dispatch_count, priority
)
"""
    + outbox.outbox_insert_sql(kind=DELIVERY_KIND, source="admitted", dispatch="dispatch_count"),
    returns="count",
)


@ENQUEUE.elsewhere
def _(params):
    ids, now = params["ids"], params["now"]
    Delivery.objects.filter(id__in=ids, state=PENDING, next_attempt_at__lte=now).update(
        state=ENQUEUED, enqueued_at=now, dispatch_count=F("dispatch_count") + 1, updated_at=now
    )
    rows = Delivery.objects.filter(id__in=ids).values_list("id", "dispatch_count", "priority")
    return len(outbox.outbox_write(kind=DELIVERY_KIND, jobs=rows, now=now))


# --- Workers: lease and record --------------------------------------------------------

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


# --- Publishing -----------------------------------------------------------------------

# The event and one pending delivery per subscribed, enabled endpoint, in one statement
# (the ORM takes three and builds a model per row); the delivery table's trigger lists
# them (models.DeliveryListing). The subscription test is
# Endpoint.subscribes_to's (deliveries.catalogue): no event types means every type, else
# the filter holds one of ``patterns``, the type's name and its prefixes' wildcards.
# Columns the statement leaves out take the models' defaults, which the ORM path writes
# explicitly; keep both in step
# (tests/deliveries/test_pipeline.py compares them). When deliveries were written and are
# due now, the statement also wakes the scheduler (deliveries.jobs.wakeup.DUE): pg_notify is
# delivered with the caller's commit, never on a rollback, and PostgreSQL folds the
# notifications of one transaction into one. (A NOTIFY statement of its own cost the
# publishing process 150 µs a publish, a third of the rest.) Params: the event's columns
# (EVENT_COLUMNS, ``id``), ``now`` (its creation time), ``due``, ``patterns``
# (catalogue.filter_patterns of the type) and ``only`` (endpoint ids, or None for the
# subscribed ones).
PUBLISH = Statement(
    """
WITH event AS (
    INSERT INTO deliveries_event (id, tenant_id, event_type, payload_version, entity_id,
        body, priority, idempotency_key, request_hash, trace_context, created_at)
    VALUES (%(id)s, %(tenant_id)s, %(event_type)s, %(payload_version)s, %(entity_id)s,
        %(body)s, %(priority)s, %(idempotency_key)s, %(request_hash)s, %(trace_context)s,
        %(now)s)
    RETURNING id
), delivery AS (
    INSERT INTO deliveries_delivery (id, event_id, endpoint_id, tenant_id, state, priority,
        next_attempt_at, attempt_count, policy_attempts, dispatch_count, lease_expiries,
        last_outcome, last_error, created_at, updated_at)
    SELECT {uuid7}, event.id, endpoint.id, endpoint.tenant_id, 'pending',
        %(priority)s, %(due)s, 0, 0, 0, 0, '', '', %(now)s, %(now)s
    FROM event, deliveries_endpoint AS endpoint
    WHERE endpoint.tenant_id = %(tenant_id)s AND endpoint.enabled
        AND CASE WHEN %(only)b::uuid[] IS NULL
            THEN endpoint.event_types = '[]'::jsonb OR endpoint.event_types ?| %(patterns)b::text[]
            ELSE endpoint.id = ANY(%(only)b::uuid[]) END
    RETURNING 1
)
SELECT pg_notify('{due}', '') FROM (SELECT 1 FROM delivery LIMIT 1) AS written
WHERE %(due)s <= %(now)s
""".replace("{uuid7}", UUID7_SQL).replace("{due}", wakeup.DUE),
    returns="nothing",
)

EVENT_COLUMNS = (
    "tenant_id",
    "event_type",
    "payload_version",
    "entity_id",
    "body",
    "priority",
    "idempotency_key",
    "request_hash",
    "trace_context",
)


@PUBLISH.elsewhere
def _(params):
    event = Event(
        id=params["id"], created_at=params["now"], **{c: params[c] for c in EVENT_COLUMNS}
    )
    # Saved exactly as given (raw, as loaddata saves), so that the row holds the
    # creation time the caller's Event holds, as the PostgreSQL statement writes it.
    event.save_base(raw=True, force_insert=True)
    endpoints = Endpoint.objects.filter(tenant_id=params["tenant_id"], enabled=True).only(
        "id", "event_types"
    )
    only = params["only"]
    if only is not None:
        endpoints = endpoints.filter(id__in=only)
    Delivery.objects.bulk_create(
        [
            Delivery(
                event_id=event.id,
                endpoint_id=endpoint.id,
                tenant_id=params["tenant_id"],
                priority=params["priority"],
                next_attempt_at=params["due"],
            )
            for endpoint in endpoints
            if only is not None or endpoint.subscribes_to(params["event_type"])
        ]
    )


# An Idempotency-Key in use: a transaction-scoped advisory lock, not waited for. Params:
# [tenant id as text, key]; the row is (taken,).
TAKE_IDEMPOTENCY_LOCK = Statement(
    "SELECT pg_try_advisory_xact_lock(hashtext(%s), hashtext(%s))", returns="row", bound=False
)


@TAKE_IDEMPOTENCY_LOCK.elsewhere
def _(params):
    # SQLite: the IMMEDIATE transaction holds the write lock, so a second request with
    # the key waits for the first and then finds its event.
    return (True,)


# Signing secrets of endpoints, newest first, leaving out expired ones. Workers ask for
# every batch they lease, so on PostgreSQL it is one prepared statement (the ORM's
# compilation cost more than the query). "secret" is the legacy plain-text column
# (EndpointSecret.legacy_plaintext). Params: [endpoint ids, now]; rows (id, endpoint,
# secret_encrypted, legacy plain text).
ACTIVE_SECRETS = Statement("""
SELECT id, endpoint_id, secret_encrypted, secret FROM deliveries_endpointsecret
WHERE endpoint_id = ANY(%b::uuid[]) AND (expires_at IS NULL OR expires_at > %s)
ORDER BY created_at DESC
""")


@ACTIVE_SECRETS.elsewhere
def _(params):
    endpoint_ids, now = params
    return list(
        EndpointSecret.objects.filter(endpoint_id__in=endpoint_ids)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("-created_at")
        .values_list("id", "endpoint_id", "secret_encrypted", "legacy_plaintext")
    )


# --- Reads ----------------------------------------------------------------------------

# The egress allowances of tenants, by the tenant index; the tenant ids travel as one
# array parameter: the ORM's IN list of a 200-target batch cost 3.5 ms. Params: [tenant
# ids]; rows (tenant, endpoint or None, network).
TENANT_ALLOWANCES = Statement("""
SELECT tenant_id, endpoint_id, network FROM deliveries_egressallowance
WHERE tenant_id = ANY(%b::uuid[])
""")


@TENANT_ALLOWANCES.elsewhere
def _(params):
    (tenant_ids,) = params
    return list(
        EgressAllowance.objects.filter(tenant_id__in=tenant_ids).values_list(
            "tenant_id", "endpoint_id", "network"
        )
    )


# The oldest due pending delivery, by a skip scan over the partial index delivery_due
# (-priority, next_attempt_at): one index probe per distinct priority instead of reading
# every pending row, however deep the backlog. The row is (next_attempt_at or None,).
OLDEST_DUE = Statement(
    """
WITH RECURSIVE p AS (
    (SELECT priority FROM deliveries_delivery WHERE state = 'pending'
     ORDER BY priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT d.priority FROM deliveries_delivery d
            WHERE d.state = 'pending' AND d.priority < p.priority
            ORDER BY d.priority DESC LIMIT 1)
    FROM p WHERE p.priority IS NOT NULL
)
SELECT min((SELECT d.next_attempt_at FROM deliveries_delivery d
            WHERE d.state = 'pending' AND d.priority = p.priority
            ORDER BY d.next_attempt_at LIMIT 1))
FROM p WHERE p.priority IS NOT NULL
""",
    returns="row",
    bound=False,
)


@OLDEST_DUE.elsewhere
def _(params):
    return (Delivery.objects.filter(state=PENDING).aggregate(m=Min("next_attempt_at"))["m"],)


# The event types published, by a skip scan of the event table's type index: one index
# probe per type, however many events (the admin's event-type filter at millions of
# rows). Params: {most}; rows (event type,), at most ``most``, in name order.
EVENT_TYPES_SEEN = Statement("""
WITH RECURSIVE types AS (
    (SELECT event_type, 1 AS n FROM deliveries_event ORDER BY event_type LIMIT 1)
    UNION ALL
    SELECT (SELECT e.event_type FROM deliveries_event e WHERE e.event_type > t.event_type
            ORDER BY e.event_type LIMIT 1), t.n + 1
    FROM types t WHERE t.event_type IS NOT NULL AND t.n < %(most)s
)
SELECT event_type FROM types WHERE event_type IS NOT NULL
""")


@EVENT_TYPES_SEEN.elsewhere
def _(params):
    seen = Event.objects.order_by("event_type").values_list("event_type", flat=True).distinct()
    return [(t,) for t in seen[: params["most"]]]
