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
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Q

from .models import (
    Attempt,
    Delivery,
    DeliveryState,
    Endpoint,
    EndpointThrottle,
    Outbox,
    Outcome,
)
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


def message_key(job_id: uuid.UUID, dispatch: int, kind: str = DELIVERY_KIND) -> str:
    """Unique per job *and* dispatch: a retry gets a new outbox row and message while
    the delivery keeps its identity."""
    prefix = "" if kind == DELIVERY_KIND else f"{kind}:"
    return f"{prefix}{job_id.hex}:{dispatch}"


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
    scan reads (twice the free slots), tenants are served round-robin.
    """
    result = AdmissionResult()
    with transaction.atomic():
        _take_admission_lock()
        in_flight = list(
            Delivery.objects.filter(state__in=IN_FLIGHT)
            .values("tenant_id", "endpoint_id")
            .annotate(n=Count("id"))
            .order_by()
        )
        total = sum(row["n"] for row in in_flight)
        free = min(page_size, limits.max_in_flight - total)
        if free <= 0:
            return result
        by_tenant: Counter = Counter()
        by_endpoint: Counter = Counter()
        for row in in_flight:
            by_tenant[row["tenant_id"]] += row["n"]
            by_endpoint[row["endpoint_id"]] += row["n"]
        full_tenants = [t for t, n in by_tenant.items() if n >= limits.tenant_max_in_flight]

        candidates = Delivery.objects.filter(state=PENDING, next_attempt_at__lte=now)
        if full_tenants:
            candidates = candidates.exclude(tenant_id__in=full_tenants)
        # Uses the partial index delivery_due. Scans past `free` so that rows of
        # endpoints at their ceiling do not use up the page.
        rows = list(
            candidates.select_for_update(skip_locked=True)
            .order_by("-priority", "next_attempt_at")
            .values_list("id", "tenant_id", "endpoint_id", "priority")[: free * 2]
        )
        if not rows:
            return result
        endpoint_ids = {r[2] for r in rows}
        endpoints = {
            e["id"]: e
            for e in Endpoint.objects.filter(id__in=endpoint_ids).values(
                "id", "max_concurrency", "rate_limit"
            )
        }
        buckets = _rate_buckets(endpoints.values(), now)

        chosen: list[tuple[uuid.UUID, int]] = []
        queues: dict = defaultdict(list)
        for row in rows:
            queues[row[1]].append(row)
        # Round-robin over tenants, each tenant's rows already in priority/age order.
        while queues and len(chosen) < free:
            for tenant_id in list(queues):
                row = queues[tenant_id].pop(0)
                if not queues[tenant_id]:
                    del queues[tenant_id]
                delivery_id, _, endpoint_id, priority = row
                ep = endpoints[endpoint_id]
                ceiling = ep["max_concurrency"] or limits.endpoint_max_concurrency
                bucket = buckets.get(endpoint_id)
                if (
                    by_tenant[tenant_id] >= limits.tenant_max_in_flight
                    or by_endpoint[endpoint_id] >= ceiling
                    or (bucket is not None and bucket.tokens < 1)
                ):
                    result.held_back += 1
                    continue
                by_tenant[tenant_id] += 1
                by_endpoint[endpoint_id] += 1
                if bucket is not None:
                    bucket.tokens -= 1
                chosen.append((delivery_id, priority))
                if len(chosen) >= free:
                    break
        if not chosen:
            _save_buckets(buckets)
            return result

        ids = [c[0] for c in chosen]
        # The rows are locked by this transaction; the state guard is belt and braces.
        Delivery.objects.filter(id__in=ids, state=PENDING).update(
            state=ENQUEUED,
            enqueued_at=now,
            dispatch_count=F("dispatch_count") + 1,
            updated_at=now,
        )
        dispatches = dict(Delivery.objects.filter(id__in=ids).values_list("id", "dispatch_count"))
        Outbox.objects.bulk_create(
            [
                Outbox(
                    message_key=message_key(delivery_id, dispatches[delivery_id]),
                    kind=DELIVERY_KIND,
                    ref_id=delivery_id,
                    dispatch=dispatches[delivery_id],
                    priority=priority,
                    created_at=now,
                )
                for delivery_id, priority in chosen
            ]
        )
        _save_buckets(buckets)
        result.admitted = len(chosen)
    return result


@dataclass
class _Bucket:
    endpoint_id: uuid.UUID
    tokens: float
    refilled_at: datetime
    touched: bool = field(default=False)


def _rate_buckets(endpoints: Iterable[dict], now: datetime) -> dict[uuid.UUID, _Bucket]:
    """Refilled token buckets for the endpoints that have a start-rate ceiling. The
    bucket holds at most one second of tokens, so a burst is at most ``rate`` starts."""
    limited = {e["id"]: e["rate_limit"] for e in endpoints if e["rate_limit"]}
    if not limited:
        return {}
    stored = {
        t.endpoint_id: t
        for t in EndpointThrottle.objects.select_for_update().filter(endpoint_id__in=limited)
    }
    buckets = {}
    for endpoint_id, rate in limited.items():
        row = stored.get(endpoint_id)
        if row is None:
            tokens = rate
        else:
            elapsed = max(0.0, (now - row.refilled_at).total_seconds())
            tokens = min(rate, row.tokens + elapsed * rate)
        buckets[endpoint_id] = _Bucket(endpoint_id, max(tokens, 0.0), now, touched=True)
    return buckets


def _save_buckets(buckets: dict[uuid.UUID, _Bucket]) -> None:
    for bucket in buckets.values():
        EndpointThrottle.objects.update_or_create(
            endpoint_id=bucket.endpoint_id,
            defaults={"tokens": bucket.tokens, "refilled_at": bucket.refilled_at},
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
    wanted = dict(messages)
    token = uuid.uuid4()
    with transaction.atomic():
        rows = list(
            Delivery.objects.filter(id__in=wanted, state=ENQUEUED)
            .select_for_update(skip_locked=True, of=("self",))
            .values_list(
                "id",
                "dispatch_count",
                "endpoint__enabled",
                "attempt_count",
                "policy_attempts",
                "event_id",
                "endpoint_id",
                "tenant_id",
                "event__event_type",
                "event__body",
            )
        )
        rows = [r for r in rows if wanted.get(r[0]) == r[1]]
        live = [r for r in rows if r[2]]
        disabled = [r[0] for r in rows if not r[2]]
        if disabled:
            Delivery.objects.filter(id__in=disabled, state=ENQUEUED).update(
                state=DEAD,
                finished_at=now,
                last_outcome=Outcome.ENDPOINT_DISABLED,
                last_error="endpoint disabled",
                updated_at=now,
            )
        if live:
            Delivery.objects.filter(id__in=[r[0] for r in live], state=ENQUEUED).update(
                state=LEASED,
                lease_until=now + timedelta(seconds=lease_seconds),
                lease_token=token,
                attempt_count=F("attempt_count") + 1,
                policy_attempts=F("policy_attempts") + 1,
                updated_at=now,
            )
    leased = [
        Leased(
            id=r[0],
            event_id=r[5],
            endpoint_id=r[6],
            tenant_id=r[7],
            event_type=r[8],
            body=bytes(r[9]),
            attempt_number=r[3] + 1,
            policy_attempts=r[4] + 1,
            lease_token=token,
        )
        for r in live
    ]
    return leased, len(messages) - len(rows)


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

    Only the lease holder moves a delivery: rows are re-read under lock with the lease
    token, and a result whose lease expired (and maybe went to another worker) is kept
    as an attempt with ``recorded=False`` and changes nothing.
    """
    summary = RecordSummary()
    if not results:
        return summary
    with transaction.atomic():
        held = set(
            Delivery.objects.filter(
                id__in=[r.leased.id for r in results],
                state=LEASED,
                lease_token__in={r.leased.lease_token for r in results},
            )
            .select_for_update()
            .values_list("id", "lease_token")
        )
        mine = [r for r in results if (r.leased.id, r.leased.lease_token) in held]
        summary.stale = len(results) - len(mine)
        Attempt.objects.bulk_create(
            [
                Attempt(
                    delivery_id=r.leased.id,
                    number=r.leased.attempt_number,
                    started_at=r.started_at,
                    duration_ms=r.duration_ms,
                    status_code=r.status_code,
                    outcome=r.classification.outcome,
                    error_kind=r.error_kind,
                    error=r.error[:500],
                    ambiguous=r.classification.ambiguous,
                    response_body=r.response_body,
                    response_truncated=r.response_truncated,
                    request_headers=r.request_headers,
                    recorded=(r.leased.id, r.leased.lease_token) in held,
                    worker=r.worker,
                )
                for r in results
            ]
        )
        done = {
            "lease_until": None,
            "lease_token": None,
            "last_attempt_at": now,
            "updated_at": now,
        }
        # Successes, grouped by status code: usually one UPDATE for the whole batch.
        by_status: dict[int, list[uuid.UUID]] = defaultdict(list)
        failures = []
        for r in mine:
            if r.classification.outcome == Outcome.SUCCESS:
                by_status[r.status_code].append(r.leased.id)
            else:
                failures.append(r)
        for status, ids in by_status.items():
            Delivery.objects.filter(id__in=ids, state=LEASED).update(
                state=SUCCEEDED,
                finished_at=now,
                last_outcome=Outcome.SUCCESS,
                last_status_code=status,
                last_error="",
                **done,
            )
            summary.succeeded += len(ids)
        failing_endpoints: set[uuid.UUID] = set()
        gone_endpoints: set[uuid.UUID] = set()
        for r in failures:
            outcome = r.classification.outcome
            failing_endpoints.add(r.leased.endpoint_id)
            fields = {
                **done,
                "last_outcome": outcome,
                "last_status_code": r.status_code,
                "last_error": r.error[:500],
            }
            delay = (
                policy.next_delay(r.leased.policy_attempts, retry_after=r.retry_after)
                if r.classification.retryable
                else None
            )
            if delay is not None:
                fields.update(state=PENDING, next_attempt_at=now + timedelta(seconds=delay))
                summary.retrying += 1
            else:
                fields.update(state=DEAD, finished_at=now)
                summary.dead += 1
                if outcome == Outcome.ENDPOINT_GONE:
                    gone_endpoints.add(r.leased.endpoint_id)
            Delivery.objects.filter(id=r.leased.id, state=LEASED).update(**fields)

        succeeded_endpoints = {
            r.leased.endpoint_id for r in mine if r.classification.outcome == Outcome.SUCCESS
        }
        summary.disabled_endpoints = _update_endpoint_health(
            now=now,
            succeeded=succeeded_endpoints,
            failed=failing_endpoints - succeeded_endpoints,
            gone=gone_endpoints,
        )
    return summary


def _update_endpoint_health(
    *, now: datetime, succeeded: set, failed: set, gone: set
) -> list[uuid.UUID]:
    """One success resets an endpoint's failure clock; an endpoint failing for longer
    than DELIVERY_DISABLE_AFTER, or answering 410 Gone, is disabled."""
    if succeeded:
        Endpoint.objects.filter(id__in=succeeded, failing_since__isnull=False).update(
            failing_since=None
        )
    if failed:
        Endpoint.objects.filter(id__in=failed, failing_since__isnull=True).update(failing_since=now)
    window = timedelta(seconds=settings.DELIVERY_DISABLE_AFTER)
    to_disable = dict.fromkeys(gone, "the endpoint answered 410 Gone")
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
    return bool(
        Endpoint.objects.filter(id=endpoint_id, enabled=True).update(
            enabled=False, disabled_reason=reason[:200], disabled_at=now
        )
    )


# --- Operators: replay and cancel ------------------------------------------------------


def replay(*, delivery_ids: Iterable[uuid.UUID], now: datetime) -> int:
    """Return terminal or waiting deliveries to ``pending``, due now, with a fresh retry
    budget and the same identity (the same ``webhook-id``). In-flight rows are left
    alone: they are already on their way."""
    return Delivery.objects.filter(
        Q(state__in=TERMINAL) | Q(state=PENDING), id__in=list(delivery_ids)
    ).update(
        state=PENDING,
        next_attempt_at=now,
        policy_attempts=0,
        finished_at=None,
        updated_at=now,
    )


def cancel(*, delivery_ids: Iterable[uuid.UUID], now: datetime) -> int:
    """Stop deliveries that have not been sent yet (pending or enqueued): ``dead`` with
    outcome ``cancelled``. A leased delivery is mid-request and cannot be recalled."""
    return Delivery.objects.filter(id__in=list(delivery_ids), state__in=(PENDING, ENQUEUED)).update(
        state=DEAD,
        finished_at=now,
        last_outcome=Outcome.CANCELLED,
        last_error="cancelled by an operator",
        updated_at=now,
    )
