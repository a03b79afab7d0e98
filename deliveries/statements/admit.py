"""The scheduler's admission: its lock, the in-flight counts and ceilings it reads, the
scans of due rows, and ``ENQUEUE`` (pending → enqueued with each delivery's outbox row).
"""

from django.db.models import Count, F

from ..core.sql import Statement
from ..jobs import outbox
from ..models import (
    Delivery,
    Endpoint,
)
from . import DELIVERY_KIND, ENQUEUED, LEASED, PENDING

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
