"""The delivery state machine: the one module that changes ``Delivery.state``.

    pending ──admit──▶ enqueued ──lease──▶ leased ──record──▶ succeeded | dead
       ▲                  │                  │        └──retry──▶ pending
       └──lost dispatch───┘                  └──lease expired──▶ pending | dead

Every transition is a guarded UPDATE: it filters on the state it expects (and, for a
leased row, on the lease token of the worker that holds it). A transition that matches
zero rows lost a race and does nothing. Claims take rows with ``SELECT … FOR UPDATE SKIP
LOCKED`` on PostgreSQL, so concurrent schedulers and workers divide the work instead of
queueing behind each other; on SQLite the same code runs inside IMMEDIATE transactions,
which serialise writers, so the guard still holds.

No function here makes a network call: callers commit the claim, do their I/O, and come
back with the result in a new short transaction.
"""

import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Count, F, Q

from deliveries.conf import settings

from . import signals
from .jobs import outbox, wakeup
from .jobs.sql import bound_cursor
from .models import Attempt, Delivery, DeliveryState, Endpoint, EndpointThrottle, Outcome
from .policy import Classification, RetryPolicy

PENDING = DeliveryState.PENDING
ENQUEUED = DeliveryState.ENQUEUED
LEASED = DeliveryState.LEASED
SUCCEEDED = DeliveryState.SUCCEEDED
DEAD = DeliveryState.DEAD
IN_FLIGHT = (ENQUEUED, LEASED)
TERMINAL = (SUCCEEDED, DEAD)

# Serialises admission between schedulers so that the in-flight ceilings and the rate
# buckets are counted once. An admission page is a few milliseconds of work, so
# overlapping schedulers take turns page by page.
_ADMISSION_LOCK_ID = 0x77656268  # "webh"


DELIVERY_KIND = "delivery"


# --- Scheduler: admission (pending → enqueued) -----------------------------------------


@dataclass(frozen=True)
class Limits:
    max_in_flight: int
    tenant_max_in_flight: int
    endpoint_max_concurrency: int

    @classmethod
    def from_settings(cls) -> "Limits":
        return cls(
            max_in_flight=settings.DELIVERY_MAX_IN_FLIGHT,
            tenant_max_in_flight=settings.DELIVERY_TENANT_MAX_IN_FLIGHT,
            endpoint_max_concurrency=settings.DELIVERY_ENDPOINT_MAX_CONCURRENCY,
        )


@dataclass
class AdmissionResult:
    admitted: int = 0
    # Due rows left pending this page because a ceiling was reached.
    held_back: int = 0
    # The global in-flight ceiling is reached: nothing was scanned.
    saturated: bool = False
    # Rows in flight (enqueued or leased) in all when the pass began.
    in_flight: int = 0
    # The pass took the last slot under the global ceiling (saturated included): the
    # next pass can admit only what the workers free meanwhile.
    filled: bool = False


def _take_admission_lock() -> None:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_ADMISSION_LOCK_ID])


def admit_due(*, now: datetime, page_size: int, limits: Limits) -> AdmissionResult:
    """Move one page of due pending deliveries to ``enqueued`` and write their outbox
    rows, in one transaction.

    Ceilings, all counted over rows in flight (enqueued or leased): the global
    ``max_in_flight``; per tenant, so one noisy tenant cannot fill the queue and starve
    the others; per endpoint (its ``max_concurrency``), which bounds concurrent requests
    to it; and the endpoint's start-rate bucket. Saturated tenants and endpoints are left
    out of the scan itself, so their backlog cannot hide other tenants' due rows: the
    per-tenant ceiling is what guarantees a share to every tenant. Among the rows one
    scan reads (twice the free slots, up to ADMISSION_CHUNK), tenants are served
    round-robin.
    """
    result = AdmissionResult()
    with transaction.atomic():
        _take_admission_lock()
        # Keys are text throughout (ids as PostgreSQL prints them): thousands of rows
        # pass through here per second, and building UUID objects for them would cost
        # more than the choosing.
        by_tenant: Counter = Counter()
        by_endpoint: Counter = Counter()
        for tenant_id, endpoint_id, n in _in_flight():
            by_tenant[tenant_id] += n
            by_endpoint[endpoint_id] += n
        result.in_flight = sum(by_tenant.values())
        room = limits.max_in_flight - result.in_flight
        free = min(page_size, room)
        if free <= 0:
            result.saturated = result.filled = True
            return result
        full_tenants = {t for t, n in by_tenant.items() if n >= limits.tenant_max_in_flight}
        slots = _Slots(limits, by_tenant, by_endpoint, _endpoint_limits(by_endpoint))
        full_endpoints = {
            e for e, n in by_endpoint.items() if n >= slots.ceiling(slots.endpoints.get(e))
        }
        # Chunks of due rows, each scanned past the free slots so that tenants share
        # it round-robin. A row held back fills its tenant or endpoint (ceiling reached,
        # or no start token left): those leave the next chunk's scan, so rows they
        # cannot take are read once per pass, not once per chunk. Rows admitted leave it
        # too (they are no longer pending).
        while free > 0:
            chunk = min(2 * free, ADMISSION_CHUNK)
            rows = _scan_due(now, list(full_tenants), list(full_endpoints), chunk)
            slots.load_endpoints({r[2] for r in rows}, now)
            chosen = slots.choose(rows, free)
            result.held_back += len(rows) - len(chosen)
            if chosen:
                result.admitted += _enqueue(chosen, now)
                free -= len(chosen)
            if len(rows) < chunk:
                break
            full_tenants |= {r[1] for r in rows if slots.tenant_full(r[1])}
            full_endpoints |= {r[2] for r in rows if slots.endpoint_full(r[2])}
        result.filled = free <= 0 and room <= page_size
        _save_buckets(slots.buckets)
        if result.admitted:
            # Once a pass, not once a chunk: PostgreSQL folds them anyway, and each was a
            # round trip (8 a pass of 2,000 rows, 3 ms of it).
            wakeup.notify(wakeup.OUTBOX)
    return result


# Rows one admission scan reads at most (it reads twice the free slots, up to this).
ADMISSION_CHUNK = 256


class _Slots:
    """The ceilings of one admission pass, counting what it admits."""

    def __init__(
        self, limits: Limits, by_tenant: Counter, by_endpoint: Counter, endpoints: dict
    ) -> None:
        self.limits = limits
        self.by_tenant = by_tenant
        self.by_endpoint = by_endpoint
        # _endpoint_limits rows, starting with the endpoints in flight (read once a pass,
        # for the full endpoints and for admission alike).
        self.endpoints: dict[str, dict] = dict(endpoints)
        self.buckets: dict[str, _Bucket] = {}
        self._bucketed: set[str] = set()

    def load_endpoints(self, ids: set[str], now: datetime) -> None:
        """The limits and start-rate buckets of the endpoints of scanned rows, each read
        once a pass."""
        missing = ids - self.endpoints.keys()
        if missing:
            self.endpoints.update(_endpoint_limits(missing))
        unbucketed = ids - self._bucketed
        if not unbucketed:
            return
        self._bucketed |= unbucketed
        rows = [self.endpoints[e] for e in unbucketed if e in self.endpoints]
        self.buckets.update({str(k): b for k, b in _rate_buckets(rows, now).items()})

    def tenant_full(self, tenant_id: str) -> bool:
        return self.by_tenant[tenant_id] >= self.limits.tenant_max_in_flight

    def ceiling(self, endpoint: dict | None) -> int:
        """An endpoint's concurrency ceiling (its _endpoint_limits row): its own, else the
        default (also for an endpoint deleted since its rows were read)."""
        return (endpoint or {}).get("max_concurrency") or self.limits.endpoint_max_concurrency

    def endpoint_full(self, endpoint_id: str) -> bool:
        ceiling = self.ceiling(self.endpoints[endpoint_id])
        bucket = self.buckets.get(endpoint_id)
        return self.by_endpoint[endpoint_id] >= ceiling or (
            bucket is not None and bucket.tokens < 1
        )

    def choose(self, rows: list[tuple], free: int) -> list[str]:
        """Up to ``free`` of ``rows``: tenants served round-robin, each tenant's rows in
        priority and age order; the chosen ones count against the ceilings."""
        chosen: list[str] = []
        queues: dict = defaultdict(deque)
        for row in rows:
            queues[row[1]].append(row)
        while queues and len(chosen) < free:
            for tenant_id in list(queues):
                delivery_id, _, endpoint_id, _ = queues[tenant_id].popleft()
                if not queues[tenant_id]:
                    del queues[tenant_id]
                if self.tenant_full(tenant_id) or self.endpoint_full(endpoint_id):
                    continue
                self.by_tenant[tenant_id] += 1
                self.by_endpoint[endpoint_id] += 1
                bucket = self.buckets.get(endpoint_id)
                if bucket is not None:
                    bucket.tokens -= 1
                    bucket.spent = True
                chosen.append(delivery_id)
                if len(chosen) >= free:
                    break
        return chosen


_ENDPOINT_LIMITS_SQL = """
SELECT id, max_concurrency, rate_limit FROM deliveries_endpoint WHERE id = ANY(%b::uuid[])
"""


def _endpoint_limits(ids: Iterable[str]) -> dict[str, dict]:
    """{id as text: {"id", "max_concurrency", "rate_limit"}} of these endpoints. Every
    admission pass asks twice, so on PostgreSQL it is one prepared statement (the ORM's
    compilation cost more than the query)."""
    if connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(_ENDPOINT_LIMITS_SQL, [list(ids)])
            rows = [
                {"id": i, "max_concurrency": c, "rate_limit": r} for i, c, r in cursor.fetchall()
            ]
    else:
        rows = Endpoint.objects.filter(id__in=list(ids)).values(
            "id", "max_concurrency", "rate_limit"
        )
    return {str(row["id"]): row for row in rows}


# Grouped by the uuids, cast once per group: grouping by the casts cast two ids of every
# row in flight (3 ms a pass with 5,000 in flight, against 1 ms).
_IN_FLIGHT_SQL = """
SELECT tenant_id::text, endpoint_id::text, n FROM (
    SELECT tenant_id, endpoint_id, count(*) AS n FROM deliveries_delivery
    WHERE state IN ('enqueued', 'leased') GROUP BY tenant_id, endpoint_id
) AS in_flight
"""

# Due rows, highest priority and oldest first, leaving out saturated tenants and
# endpoints. Uses the partial index delivery_due. No row locks: the admission lock
# serialises schedulers, and the UPDATE in _enqueue re-checks the state, so a row that
# changed since (cancelled, say) is skipped. (Locking the scan would write the header of
# every scanned tuple, rows held back included.) Its cost follows the rows it reads past,
# so with tenants or endpoints left out it comes last (_scan_due).
_SCAN_DUE_SQL = """
SELECT id::text, tenant_id::text, endpoint_id::text, priority FROM deliveries_delivery
WHERE state = 'pending' AND next_attempt_at <= %(now)s
    AND tenant_id <> ALL(%(tenants)b::uuid[]) AND endpoint_id <> ALL(%(endpoints)b::uuid[])
ORDER BY priority DESC, next_attempt_at
LIMIT %(limit)s
"""

# The same, leaving out saturated tenants and endpoints, over a bounded window of the due
# rows (delivery_due): the rows of the first ``window`` due rows that are not left out,
# and how many rows the window held. Most passes end here.
_SCAN_DUE_WINDOW_SQL = """
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
"""

# When the window was all rows left out (one hot endpoint's backlog, say), the same
# answer by endpoint, so that no row of a saturated endpoint is read: a skip scan over
# delivery_due_endpoint lists the endpoints with pending rows (one index probe each, due
# or not: retries in backoff count), up to ``most`` + 1 of them ...
_DUE_ENDPOINTS_SQL = """
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
"""

# ... then each of them not left out, whose tenant is not left out either (a delivery's
# tenant is its endpoint's), gives its first due rows; the best of those are the answer.
_SCAN_DUE_OF_ENDPOINTS_SQL = """
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
"""

# With more endpoints than that waiting, _SCAN_DUE_SQL reads past the rows left out: its
# cost follows those rows, where the scan by endpoint follows the endpoints with pending
# rows (about 4 µs each). Each way is the cheaper one in its case; none is in both.

# The window is this many times the rows asked for.
SCAN_WINDOW = 4
# The scan by endpoint is used while at most this many endpoints have pending rows.
SCAN_BY_ENDPOINT_MAX = 500


def _in_flight() -> list[tuple[str, str, int]]:
    """(tenant, endpoint, rows enqueued or leased), by the partial index delivery_in_flight."""
    if connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(_IN_FLIGHT_SQL)
            return cursor.fetchall()
    return [
        (str(r["tenant_id"]), str(r["endpoint_id"]), r["n"])
        for r in Delivery.objects.filter(state__in=IN_FLIGHT)
        .values("tenant_id", "endpoint_id")
        .annotate(n=Count("id"))
        .order_by()
    ]


def _scan_due(now, tenants: list[str], endpoints: list[str], limit: int) -> list[tuple]:
    """Up to ``limit`` due rows (id, tenant, endpoint, priority), highest priority and
    oldest first, of tenants and endpoints not in ``tenants`` and ``endpoints``."""
    if connection.vendor == "postgresql":
        params = {"now": now, "tenants": tenants, "endpoints": endpoints, "limit": limit}
        with bound_cursor() as cursor:
            if not tenants and not endpoints:
                cursor.execute(_SCAN_DUE_SQL, params)
                return cursor.fetchall()
            window = SCAN_WINDOW * limit
            cursor.execute(_SCAN_DUE_WINDOW_SQL, {**params, "window": window})
            found = cursor.fetchall()
            rows = [r[:4] for r in found if r[0] is not None]
            if len(rows) == limit or found[0][4] < window:
                return rows  # enough, or the window held every due row
            cursor.execute(_DUE_ENDPOINTS_SQL, {"most": SCAN_BY_ENDPOINT_MAX})
            waiting = [r[0] for r in cursor.fetchall()]
            if len(waiting) > SCAN_BY_ENDPOINT_MAX:
                cursor.execute(_SCAN_DUE_SQL, params)
                return cursor.fetchall()
            left_out = set(endpoints)
            candidates = [e for e in waiting if e not in left_out]
            if not candidates:
                return []
            cursor.execute(_SCAN_DUE_OF_ENDPOINTS_SQL, {**params, "candidates": candidates})
            return cursor.fetchall()
    candidates = Delivery.objects.filter(state=PENDING, next_attempt_at__lte=now)
    if tenants:
        candidates = candidates.exclude(tenant_id__in=tenants)
    if endpoints:
        candidates = candidates.exclude(endpoint_id__in=endpoints)
    return [
        (str(i), str(t), str(e), p)
        for i, t, e, p in candidates.order_by("-priority", "next_attempt_at").values_list(
            "id", "tenant_id", "endpoint_id", "priority"
        )[:limit]
    ]


# pending → enqueued and one outbox row per delivery, in one statement. The rows are
# found by primary key; the state test is written so that the planner cannot read the
# partial indexes of pending rows instead (see _LEASE_SQL): with 15,000 pending it read
# them all, filtering on the 200 ids, 8.9 ms against 0.3 ms.
_ENQUEUE_SQL = """
WITH admitted AS (
    UPDATE deliveries_delivery SET state = 'enqueued', enqueued_at = %(now)s,
        dispatch_count = dispatch_count + 1, updated_at = %(now)s
    WHERE id = ANY(%(ids)b::uuid[]) AND (state || '') = 'pending' AND next_attempt_at <= %(now)s
    RETURNING id, dispatch_count, priority
)
""" + outbox.outbox_insert_sql(kind=DELIVERY_KIND, source="admitted", dispatch="dispatch_count")


def _enqueue(ids: list[str], now: datetime) -> int:
    if connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(_ENQUEUE_SQL, {"ids": ids, "now": now})
            return cursor.rowcount
    Delivery.objects.filter(id__in=ids, state=PENDING, next_attempt_at__lte=now).update(
        state=ENQUEUED, enqueued_at=now, dispatch_count=F("dispatch_count") + 1, updated_at=now
    )
    rows = Delivery.objects.filter(id__in=ids).values_list("id", "dispatch_count", "priority")
    return len(outbox.outbox_write(kind=DELIVERY_KIND, jobs=rows, now=now))


@dataclass
class _Bucket:
    endpoint_id: uuid.UUID
    tokens: float
    refilled_at: datetime
    # Whether this pass took a token: an untouched bucket needs no write, because its
    # stored row refills to the same tokens at any later time (both cap at the rate).
    spent: bool = False


def _rate_buckets(endpoints: Iterable[dict], now: datetime) -> dict[uuid.UUID, _Bucket]:
    """Refilled token buckets for the endpoints that have a start-rate ceiling. The
    bucket holds at most one second of tokens, so a burst is at most ``rate`` starts."""
    limited = {e["id"]: e["rate_limit"] for e in endpoints if e["rate_limit"]}
    if not limited:
        return {}
    stored = {
        endpoint_id: (tokens, refilled_at)
        for endpoint_id, tokens, refilled_at in EndpointThrottle.objects.select_for_update()
        .filter(endpoint_id__in=limited)
        .values_list("endpoint_id", "tokens", "refilled_at")
    }
    buckets = {}
    for endpoint_id, rate in limited.items():
        if endpoint_id not in stored:
            tokens = rate
        else:
            left, refilled_at = stored[endpoint_id]
            elapsed = max(0.0, (now - refilled_at).total_seconds())
            tokens = min(rate, left + elapsed * rate)
        buckets[endpoint_id] = _Bucket(endpoint_id, max(tokens, 0.0), now)
    return buckets


def _save_buckets(buckets: dict[uuid.UUID, _Bucket]) -> None:
    """The buckets this pass spent from, in one upsert (one statement per endpoint cost
    the scheduler more than the admission itself with hundreds of limited endpoints)."""
    spent = [b for b in buckets.values() if b.spent]
    if spent:
        EndpointThrottle.objects.bulk_create(
            [
                EndpointThrottle(
                    endpoint_id=b.endpoint_id, tokens=b.tokens, refilled_at=b.refilled_at
                )
                for b in spent
            ],
            update_conflicts=True,
            unique_fields=["endpoint"],
            update_fields=["tokens", "refilled_at"],
        )


# --- Scheduler: recovery sweeps --------------------------------------------------------


def expire_leases(*, now: datetime, limit: int, policy: RetryPolicy) -> int:
    """Return deliveries whose lease ran out (their worker died or hung) to ``pending``.

    The lost attempt counts against the retry schedule (it may have reached the
    receiver), so a delivery that kills its worker every time ends ``dead`` instead of
    looping; its next try waits for the backoff step like any failed attempt."""
    with transaction.atomic():
        rows = list(
            Delivery.objects.filter(state=LEASED, lease_until__lt=now)
            .select_for_update(skip_locked=True)
            .values_list("id", "policy_attempts")[:limit]
        )
        retry, dead = [], []
        for delivery_id, policy_attempts in rows:
            delay = policy.next_delay(max(policy_attempts, 1))
            if delay is None:
                dead.append(delivery_id)
            else:
                retry.append((delivery_id, delay))
        common = {
            "lease_until": None,
            "lease_token": None,
            "lease_expiries": F("lease_expiries") + 1,
            "last_outcome": Outcome.LEASE_EXPIRED,
            "updated_at": now,
        }
        for delivery_id, delay in retry:
            Delivery.objects.filter(id=delivery_id, state=LEASED).update(
                state=PENDING, next_attempt_at=now + timedelta(seconds=delay), **common
            )
        if dead:
            Delivery.objects.filter(id__in=dead, state=LEASED).update(
                state=DEAD, finished_at=now, last_error="lease expired, retries spent", **common
            )
            signals.send_after_commit(signals.delivery_dead, Delivery, dead)
    return len(rows)


def recover_lost_dispatches(*, now: datetime, older_than: float, limit: int) -> int:
    """Return deliveries that sat ``enqueued`` for longer than ``older_than`` seconds
    without a worker taking them to ``pending``, due now.

    This is the recovery clock for a transport that lost a message (a broker without
    acknowledgements, a purged queue). It must be longer than the broker's visibility
    timeout, which owns ordinary redelivery. The next dispatch writes a new outbox row;
    a late copy of the old message then finds the dispatch number changed and is dropped.
    """
    cutoff = now - timedelta(seconds=older_than)
    with transaction.atomic():
        ids = list(
            Delivery.objects.filter(state=ENQUEUED, enqueued_at__lt=cutoff)
            .select_for_update(skip_locked=True)
            .values_list("id", flat=True)[:limit]
        )
        if ids:
            Delivery.objects.filter(id__in=ids, state=ENQUEUED).update(
                state=PENDING,
                next_attempt_at=now,
                last_outcome=Outcome.TRANSPORT_LOST,
                updated_at=now,
            )
    return len(ids)


# --- Workers: lease (enqueued → leased) ------------------------------------------------


@dataclass(frozen=True)
class Leased:
    """What a worker needs to send one delivery; it holds the lease until ``lease_until``."""

    id: uuid.UUID
    event_id: uuid.UUID
    endpoint_id: uuid.UUID
    tenant_id: uuid.UUID
    event_type: str
    body: bytes
    attempt_number: int
    policy_attempts: int
    lease_token: uuid.UUID
    # The event's W3C traceparent ("" unless tracing was on at publish).
    trace_context: str = ""


def lease(
    messages: Sequence[tuple[uuid.UUID, int]], *, now: datetime, lease_seconds: float
) -> tuple[list[Leased], int]:
    """Lease the deliveries named by broker messages ``(delivery_id, dispatch)``.

    A message whose delivery is no longer ``enqueued`` at that dispatch (already leased
    by another worker, terminal, or re-dispatched) is skipped: it lost a race or is a
    stale copy. Deliveries for a disabled endpoint go straight to ``dead`` without an
    attempt. Returns the leases taken and how many messages were skipped.

    The attempt counters are incremented here, before the request, so that a worker that
    dies mid-send still leaves a count of the attempt that may have reached the receiver.
    """
    if not messages:
        return [], 0
    token = uuid.uuid4()
    until = now + timedelta(seconds=lease_seconds)
    if connection.vendor == "postgresql":
        rows = _lease_postgres(messages, now=now, until=until, token=token)
    else:
        rows = _lease_portable(messages, now=now, until=until, token=token)
    signals.send_after_commit(signals.delivery_dead, Delivery, [r[0] for r in rows if not r[8]])
    leased = [
        Leased(
            id=r[0],
            event_id=r[1],
            endpoint_id=r[2],
            tenant_id=r[3],
            event_type=r[4],
            body=bytes(r[5]),
            attempt_number=r[6],
            policy_attempts=r[7],
            lease_token=token,
            trace_context=r[9] or "",
        )
        for r in rows
        if r[8]
    ]
    return leased, len(messages) - len(rows)


# The worker's statements (lease, success) find a batch of rows by primary key. Their
# state test is written ``(d.state || '') = '...'`` so that the planner cannot answer it
# from the partial index delivery_in_flight: it otherwise reads every row in flight to
# find the batch's (its estimate of the rows in flight comes from the last ANALYZE),
# which with 5,000 in flight took 1.5-2.5 ms of each 200-row statement where the
# primary key lookups take 0.5 ms.
#
# One statement: lock the wanted rows still enqueued at the message's dispatch (primary
# key lookups), skip rows another worker holds, and lease them (or, for a disabled
# endpoint, finish them) returning what sending needs, the event body included.
_LEASE_SQL = """
WITH wanted AS (SELECT * FROM unnest(%(ids)b::uuid[], %(dispatches)b::int[]) AS w(id, n)),
locked AS (
    SELECT d.id FROM deliveries_delivery d JOIN wanted ON wanted.id = d.id
    WHERE (d.state || '') = 'enqueued' AND d.dispatch_count = wanted.n
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE deliveries_delivery d SET
    state = CASE WHEN ep.enabled THEN 'leased' ELSE 'dead' END,
    lease_until = CASE WHEN ep.enabled THEN %(until)s::timestamptz END,
    lease_token = CASE WHEN ep.enabled THEN %(token)s::uuid END,
    attempt_count = d.attempt_count + ep.enabled::int,
    policy_attempts = d.policy_attempts + ep.enabled::int,
    finished_at = CASE WHEN ep.enabled THEN NULL ELSE %(now)s::timestamptz END,
    last_outcome = CASE WHEN ep.enabled THEN d.last_outcome ELSE 'endpoint_disabled' END,
    last_error = CASE WHEN ep.enabled THEN d.last_error ELSE 'endpoint disabled' END,
    updated_at = %(now)s
FROM locked, deliveries_event e, deliveries_endpoint ep
WHERE d.id = locked.id AND e.id = d.event_id AND ep.id = d.endpoint_id
RETURNING d.id, d.event_id, d.endpoint_id, d.tenant_id, e.event_type, e.body,
    d.attempt_count, d.policy_attempts, ep.enabled, e.trace_context
"""


def _lease_postgres(messages, *, now, until, token) -> list[tuple]:
    # No savepoint: the worker leases inside its take's transaction, all or nothing.
    with transaction.atomic(savepoint=False), bound_cursor() as cursor:
        cursor.execute(
            _LEASE_SQL,
            {
                "ids": [m[0] for m in messages],
                "dispatches": [m[1] for m in messages],
                "until": until,
                "token": token,
                "now": now,
            },
            # The bodies as raw bytes: in text format bytea travels hex-encoded, twice its
            # size, encoded by the server and decoded here.
            binary=True,
        )
        return cursor.fetchall()


def _lease_portable(messages, *, now, until, token) -> list[tuple]:
    """The same transition for SQLite (its IMMEDIATE transactions serialise writers)."""
    wanted = dict(messages)
    with transaction.atomic(savepoint=False):
        rows = [
            r
            for r in Delivery.objects.filter(id__in=wanted, state=ENQUEUED).values_list(
                "id", "dispatch_count", "endpoint__enabled"
            )
            if wanted.get(r[0]) == r[1]
        ]
        live = [r[0] for r in rows if r[2]]
        disabled = [r[0] for r in rows if not r[2]]
        Delivery.objects.filter(id__in=disabled, state=ENQUEUED).update(
            state=DEAD,
            finished_at=now,
            last_outcome=Outcome.ENDPOINT_DISABLED,
            last_error="endpoint disabled",
            updated_at=now,
        )
        Delivery.objects.filter(id__in=live, state=ENQUEUED).update(
            state=LEASED,
            lease_until=until,
            lease_token=token,
            attempt_count=F("attempt_count") + 1,
            policy_attempts=F("policy_attempts") + 1,
            updated_at=now,
        )
        return [
            (*r[:8], True, r[8])
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
        ] + [(d, None, None, None, "", b"", 0, 0, False, "") for d in disabled]


# --- Workers: release (leased → pending) -----------------------------------------------


def release(leases: Iterable[Leased], *, now: datetime) -> int:
    """Give back leases a stopping worker still holds: ``leased → pending``, due now,
    without counting the attempt.

    ``lease`` counted the attempt in advance (so that a worker that dies mid-send leaves a
    count); a worker shutting down on purpose takes that count back, so that the retry
    budget is spent only on attempts that produced an outcome. A request cut off mid-way
    may have reached the receiver: the next copy carries the same ``webhook-id``, which is
    what the receiver deduplicates on. Guarded by the lease token like ``record``: a lease
    that already ran out (and maybe went to another worker) is left alone.
    """
    by_token: dict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
    for item in leases:
        by_token[item.lease_token].append(item.id)
    released = 0
    with transaction.atomic():
        for token, ids in by_token.items():
            released += Delivery.objects.filter(id__in=ids, state=LEASED, lease_token=token).update(
                state=PENDING,
                next_attempt_at=now,
                attempt_count=F("attempt_count") - 1,
                policy_attempts=F("policy_attempts") - 1,
                updated_at=now,
                **_DONE,
            )
        if released:
            wakeup.notify(wakeup.DUE)
    return released


# --- Workers: record (leased → succeeded | pending | dead) -----------------------------


@dataclass
class AttemptResult:
    """The outcome of one HTTP attempt, as the worker observed it."""

    leased: Leased
    classification: Classification
    started_at: datetime
    duration_ms: float
    status_code: int | None = None
    error_kind: str = ""
    error: str = ""
    response_body: str = ""
    response_truncated: bool = False
    request_headers: dict = field(default_factory=dict)
    retry_after: float | None = None
    worker: str = ""


@dataclass
class RecordSummary:
    succeeded: int = 0
    retrying: int = 0
    dead: int = 0
    # Attempts whose lease had been lost: recorded as evidence, no state change.
    stale: int = 0
    disabled_endpoints: list[uuid.UUID] = field(default_factory=list)


def record(
    results: Sequence[AttemptResult], *, now: datetime, policy: RetryPolicy
) -> RecordSummary:
    """Append the attempts and apply their transitions, in one transaction.

    Only the lease holder moves a delivery: every UPDATE is guarded by the state and the
    lease token, and a result whose lease expired (and maybe went to another worker) is
    kept as an attempt with ``recorded=False`` and changes nothing.
    """
    summary = RecordSummary()
    if not results:
        return summary
    successes = [r for r in results if r.classification.outcome == Outcome.SUCCESS]
    failures = [r for r in results if r.classification.outcome != Outcome.SUCCESS]
    with transaction.atomic():
        held = _finish_successes(successes, now) if successes else set()
        summary.succeeded = len(held)
        signals.send_after_commit(signals.delivery_succeeded, Delivery, held)
        failure_held, failing, gone = _finish_failures(failures, now, policy, summary)
        held |= failure_held
        summary.stale = len(results) - len(held)
        _append_attempts(results, held)
        succeeded_endpoints = {r.leased.endpoint_id for r in successes if r.leased.id in held}
        summary.disabled_endpoints = _update_endpoint_health(
            now=now, failed=failing - succeeded_endpoints, gone=gone
        )
        if held:  # slots under the ceilings freed: the scheduler may admit more
            wakeup.notify(wakeup.FREED)
    return summary


_DONE = {"lease_until": None, "lease_token": None}

# Successes of a batch in one statement; RETURNING names the rows whose lease was held.
# One success stops its endpoint's failure clock, in the same statement.
_SUCCEED_SQL = """
WITH done AS (
    UPDATE deliveries_delivery d SET state = 'succeeded', finished_at = %(now)s,
        last_outcome = 'success', last_status_code = v.status, last_error = '',
        lease_until = NULL, lease_token = NULL, last_attempt_at = %(now)s,
        updated_at = %(now)s
    FROM unnest(%(ids)b::uuid[], %(tokens)b::uuid[], %(statuses)b::int[])
        AS v(id, token, status)
    WHERE d.id = v.id AND (d.state || '') = 'leased' AND d.lease_token = v.token
    RETURNING d.id, d.endpoint_id
), healed AS (
    UPDATE deliveries_endpoint SET failing_since = NULL
    WHERE id IN (SELECT endpoint_id FROM done) AND failing_since IS NOT NULL
)
SELECT id FROM done
"""


def _finish_successes(successes: Sequence[AttemptResult], now: datetime) -> set[uuid.UUID]:
    """``leased → succeeded`` for the successes whose lease is still held (returned), and
    their endpoints' failure clocks reset (_update_endpoint_health starts them)."""
    if connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(
                _SUCCEED_SQL,
                {
                    "now": now,
                    "ids": [r.leased.id for r in successes],
                    "tokens": [r.leased.lease_token for r in successes],
                    "statuses": [r.status_code for r in successes],
                },
            )
            return {row[0] for row in cursor.fetchall()}
    held = _held(successes)
    by_status: dict[int, list[uuid.UUID]] = defaultdict(list)
    for r in successes:
        if r.leased.id in held:
            by_status[r.status_code].append(r.leased.id)
    for status, ids in by_status.items():
        Delivery.objects.filter(id__in=ids, state=LEASED).update(
            state=SUCCEEDED,
            finished_at=now,
            last_outcome=Outcome.SUCCESS,
            last_status_code=status,
            last_error="",
            last_attempt_at=now,
            updated_at=now,
            **_DONE,
        )
    Endpoint.objects.filter(
        id__in={r.leased.endpoint_id for r in successes if r.leased.id in held},
        failing_since__isnull=False,
    ).update(failing_since=None)
    return held


def _held(results: Sequence[AttemptResult]) -> set[uuid.UUID]:
    """The deliveries among ``results`` whose lease the recording worker still holds,
    locked until the transaction ends."""
    pairs = set(
        Delivery.objects.filter(
            id__in=[r.leased.id for r in results],
            state=LEASED,
            lease_token__in={r.leased.lease_token for r in results},
        )
        .select_for_update()
        .values_list("id", "lease_token")
    )
    return {r.leased.id for r in results if (r.leased.id, r.leased.lease_token) in pairs}


# Failures of a batch in one statement, each row with its own next state: pending at its
# next attempt time (a retry) or dead. The rows were locked by _held, lease held.
_FAIL_SQL = """
UPDATE deliveries_delivery d SET state = v.state,
    next_attempt_at = coalesce(v.next_attempt_at, d.next_attempt_at),
    finished_at = coalesce(v.finished_at, d.finished_at),
    last_outcome = v.outcome, last_status_code = v.status, last_error = v.error,
    lease_until = NULL, lease_token = NULL, last_attempt_at = %(now)s, updated_at = %(now)s
FROM unnest(%(ids)b::uuid[], %(tokens)b::uuid[], %(states)b::text[],
    %(next)b::timestamptz[], %(finished)b::timestamptz[], %(outcomes)b::text[],
    %(statuses)b::int[], %(errors)b::text[])
    AS v(id, token, state, next_attempt_at, finished_at, outcome, status, error)
WHERE d.id = v.id AND (d.state || '') = 'leased' AND d.lease_token = v.token
"""


@dataclass(frozen=True)
class _Failed:
    """The transition one failed attempt makes (a row of _FAIL_SQL)."""

    id: uuid.UUID
    token: uuid.UUID
    state: str
    next_attempt_at: datetime | None
    finished_at: datetime | None
    outcome: str
    status: int | None
    error: str


def _finish_failures(failures, now, policy, summary) -> tuple[set, set, set]:
    """Retry (pending at the next step) or dead, each guarded by the lease: one
    statement for the batch on PostgreSQL (an endpoint that is down fails every
    delivery), one UPDATE each elsewhere."""
    if not failures:
        return set(), set(), set()
    held = _held(failures)
    failing: set[uuid.UUID] = set()
    gone: set[uuid.UUID] = set()
    rows: list[_Failed] = []
    for r in failures:
        if r.leased.id not in held:
            continue
        outcome = r.classification.outcome
        failing.add(r.leased.endpoint_id)
        delay = (
            policy.next_delay(r.leased.policy_attempts, retry_after=r.retry_after)
            if r.classification.retryable
            else None
        )
        if delay is not None:
            next_state, next_at, finished = PENDING, now + timedelta(seconds=delay), None
            summary.retrying += 1
        else:
            next_state, next_at, finished = DEAD, None, now
            summary.dead += 1
            if outcome == Outcome.ENDPOINT_GONE:
                gone.add(r.leased.endpoint_id)
        rows.append(
            _Failed(
                r.leased.id,
                r.leased.lease_token,
                next_state,
                next_at,
                finished,
                str(outcome),
                r.status_code,
                r.error[:500],
            )
        )
    signals.send_after_commit(
        signals.delivery_dead, Delivery, [f.id for f in rows if f.state == DEAD]
    )
    if rows and connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(
                _FAIL_SQL,
                {
                    "now": now,
                    "ids": [f.id for f in rows],
                    "tokens": [f.token for f in rows],
                    "states": [f.state for f in rows],
                    "next": [f.next_attempt_at for f in rows],
                    "finished": [f.finished_at for f in rows],
                    "outcomes": [f.outcome for f in rows],
                    "statuses": [f.status for f in rows],
                    "errors": [f.error for f in rows],
                },
            )
    else:  # SQLite (or every lease was lost: nothing to move)
        for f in rows:
            fields = {
                **_DONE,
                "state": f.state,
                "last_attempt_at": now,
                "updated_at": now,
                "last_outcome": f.outcome,
                "last_status_code": f.status,
                "last_error": f.error,
            }
            if f.next_attempt_at is not None:
                fields["next_attempt_at"] = f.next_attempt_at
            if f.finished_at is not None:
                fields["finished_at"] = f.finished_at
            Delivery.objects.filter(id=f.id, state=LEASED, lease_token=f.token).update(**fields)
    return held, failing, gone


_ATTEMPT_COLUMNS = (
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


def _attempt_row(r: AttemptResult, held: set) -> tuple:
    return (
        r.leased.id,
        r.leased.endpoint_id,
        r.leased.attempt_number,
        r.started_at,
        r.duration_ms,
        r.status_code,
        str(r.classification.outcome),
        r.error_kind,
        r.error[:500],
        r.classification.ambiguous,
        r.response_body,
        r.response_truncated,
        r.request_headers,
        r.leased.id in held,
        r.worker,
    )


def _append_attempts(results: Sequence[AttemptResult], held: set) -> None:
    """The attempt rows: COPY on PostgreSQL (the cheapest bulk insert), else the ORM."""
    rows = [_attempt_row(r, held) for r in results]
    if connection.vendor == "postgresql":
        from psycopg.types.json import Jsonb

        with (
            bound_cursor() as cursor,
            cursor.copy(
                f"COPY deliveries_attempt ({', '.join(_ATTEMPT_COLUMNS)}) FROM STDIN"
            ) as copy,
        ):
            for row in rows:
                copy.write_row((*row[:12], Jsonb(row[12]), *row[13:]))
        return
    Attempt.objects.bulk_create(
        [Attempt(**dict(zip(_ATTEMPT_COLUMNS, row, strict=True))) for row in rows]
    )


def _update_endpoint_health(*, now: datetime, failed: set, gone: set) -> list[uuid.UUID]:
    """Failing endpoints start their failure clock (a success stops it:
    _finish_successes); an endpoint failing for longer than DELIVERY_DISABLE_AFTER, or
    answering 410 Gone, is disabled."""
    if failed:
        Endpoint.objects.filter(id__in=failed, failing_since__isnull=True).update(failing_since=now)
    window = timedelta(seconds=settings.DELIVERY_DISABLE_AFTER)
    to_disable = dict.fromkeys(gone, "the endpoint answered 410 Gone")
    if failed - gone:
        for endpoint_id in Endpoint.objects.filter(
            id__in=failed - gone, enabled=True, failing_since__lt=now - window
        ).values_list("id", flat=True):
            to_disable[endpoint_id] = f"failing for more than {window}"
    disabled = []
    for endpoint_id, reason in to_disable.items():
        if endpoint_set_disabled(endpoint_id=endpoint_id, reason=reason, now=now):
            disabled.append(endpoint_id)
    return disabled


def endpoint_set_disabled(*, endpoint_id: uuid.UUID, reason: str, now: datetime) -> bool:
    """Disable an endpoint (guarded: only an enabled one). Its queued deliveries go
    ``dead`` as ``endpoint_disabled`` when a worker reaches them; bulk recovery brings
    them back after it is enabled again."""
    disabled = Endpoint.objects.filter(id=endpoint_id, enabled=True).update(
        enabled=False, disabled_reason=reason[:200], disabled_at=now
    )
    if disabled:
        signals.send_after_commit(signals.endpoint_disabled, Endpoint, [endpoint_id])
    return bool(disabled)


# --- Operators: replay and cancel ------------------------------------------------------


def replay(*, delivery_ids: Iterable[uuid.UUID], now: datetime) -> int:
    """Return terminal or waiting deliveries to ``pending``, due now, with a fresh retry
    budget and the same identity (the same ``webhook-id``). In-flight rows are left
    alone: they are already on their way."""
    replayed = Delivery.objects.filter(
        Q(state__in=TERMINAL) | Q(state=PENDING), id__in=list(delivery_ids)
    ).update(
        state=PENDING,
        next_attempt_at=now,
        policy_attempts=0,
        finished_at=None,
        updated_at=now,
    )
    if replayed:
        wakeup.notify(wakeup.DUE)
    return replayed


def cancel(*, delivery_ids: Iterable[uuid.UUID], now: datetime) -> int:
    """Stop deliveries that have not been sent yet (pending or enqueued): ``dead`` with
    outcome ``cancelled``. A leased delivery is mid-request and cannot be recalled."""
    waiting = Delivery.objects.filter(id__in=list(delivery_ids), state__in=(PENDING, ENQUEUED))
    with transaction.atomic():
        ids = list(waiting.select_for_update().values_list("id", flat=True))
        signals.send_after_commit(signals.delivery_dead, Delivery, ids)
        return waiting.filter(id__in=ids).update(
            state=DEAD,
            finished_at=now,
            last_outcome=Outcome.CANCELLED,
            last_error="cancelled by an operator",
            updated_at=now,
        )
