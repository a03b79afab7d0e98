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

Admission (``deliveries.admission``) chooses which due rows to admit and moves them
through ``enqueue`` here; the statements themselves, PostgreSQL's and the ORM's, are
named in ``deliveries.statements``.

No function here makes a network call: callers commit the claim, do their I/O, and come
back with the result in a new short transaction.
"""

import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F, Q
from psycopg.types.json import Jsonb

from deliveries.core.conf import settings

from . import signals
from .core.retry import RetryPolicy
from .jobs import wakeup
from .models import Delivery, DeliveryState, Endpoint, Outcome
from .policy import Classification
from .statements import admit, worker

PENDING = DeliveryState.PENDING
ENQUEUED = DeliveryState.ENQUEUED
LEASED = DeliveryState.LEASED
SUCCEEDED = DeliveryState.SUCCEEDED
DEAD = DeliveryState.DEAD
IN_FLIGHT = (ENQUEUED, LEASED)
TERMINAL = (SUCCEEDED, DEAD)


# --- Scheduler: admission (pending → enqueued) -----------------------------------------


def enqueue(ids: list[str], *, now: datetime) -> int:
    """``pending → enqueued`` for the due rows ``ids`` that admission chose
    (deliveries.admission), each with its outbox row, in one statement that re-checks the
    state: a row that changed since the scan (cancelled, say) is skipped. Returns how
    many were enqueued."""
    return admit.ENQUEUE({"ids": ids, "now": now})


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
    attempt. Deliveries for a paused endpoint (admitted before the pause committed) go
    back to ``pending`` without an attempt, held until the endpoint is resumed. Returns
    the leases taken and how many messages were skipped.

    The attempt counters are incremented here, before the request, so that a worker that
    dies mid-send still leaves a count of the attempt that may have reached the receiver.
    """
    if not messages:
        return [], 0
    token = uuid.uuid4()
    until = now + timedelta(seconds=lease_seconds)
    # No savepoint: the worker leases inside its take's transaction, all or nothing.
    with transaction.atomic(savepoint=False):
        rows = worker.LEASE(
            {
                "ids": [m[0] for m in messages],
                "dispatches": [m[1] for m in messages],
                "until": until,
                "token": token,
                "now": now,
            }
        )
    signals.send_after_commit(signals.delivery_dead, Delivery, [r[0] for r in rows if r[8] == DEAD])
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
        if r[8] == LEASED
    ]
    return leased, len(messages) - len(rows)


# --- Workers: release (leased → pending) -----------------------------------------------

_DONE = {"lease_until": None, "lease_token": None}


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
        # The failures first: the statement that moves the successes also writes every
        # attempt row, which says whether its lease was held.
        failure_held, failing, gone = _finish_failures(failures, now, policy, summary)
        succeeded = _finish_successes(successes, results, failure_held, now)
        summary.succeeded = len(succeeded)
        signals.send_after_commit(signals.delivery_succeeded, Delivery, succeeded)
        held = succeeded | failure_held
        summary.stale = len(results) - len(held)
        succeeded_endpoints = {r.leased.endpoint_id for r in successes if r.leased.id in held}
        summary.disabled_endpoints = _update_endpoint_health(
            now=now, failed=failing - succeeded_endpoints, gone=gone
        )
    return summary


def _finish_successes(
    successes: Sequence[AttemptResult],
    results: Sequence[AttemptResult],
    failure_held: set,
    now: datetime,
) -> set[uuid.UUID]:
    """``leased → succeeded`` for the successes whose lease is still held (returned), and
    their endpoints' failure clocks reset (_update_endpoint_health starts them); in the
    same statement (worker.RECORD) every attempt row of ``results`` and the overview's
    tallies of them. ``failure_held``: the failures whose lease was held."""
    params = {
        "now": now,
        "ids": [r.leased.id for r in successes],
        "tokens": [r.leased.lease_token for r in successes],
        "statuses": [r.status_code for r in successes],
    }
    rows = [_attempt_row(r, failure_held) for r in results]
    for i, column in enumerate(worker.ATTEMPT_COLUMNS):
        params[column] = [row[i] for row in rows]
    # Slots under the ceilings freed: RECORD wakes the scheduler, which may admit more.
    params["freed"] = bool(failure_held)
    return {row[0] for row in worker.RECORD(params) if row[0] is not None}


def _held(results: Sequence[AttemptResult]) -> set[uuid.UUID]:
    """The deliveries among ``results`` whose lease the recording worker still holds,
    locked until the transaction ends."""
    return worker.held_leases(
        [r.leased.id for r in results], [r.leased.lease_token for r in results]
    )


@dataclass(frozen=True)
class _Failed:
    """The transition one failed attempt makes (a row of worker.FAIL)."""

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
    statement for the batch (an endpoint that is down fails every delivery)."""
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
    if rows:  # else every lease was lost: nothing to move
        worker.FAIL(
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
            }
        )
    return held, failing, gone


def _attempt_row(r: AttemptResult, held: set) -> tuple:
    """An attempt row, in worker.ATTEMPT_COLUMNS' order; ``recorded`` if its lease is in
    ``held`` (worker.RECORD adds the successes it moves)."""
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
        Jsonb(r.request_headers),
        r.leased.id in held,
        r.worker,
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


def endpoint_set_paused(*, endpoint_id: uuid.UUID, reason: str, now: datetime) -> bool:
    """Pause an endpoint (guarded: only a running one). Admission leaves its pending
    deliveries out from its next pass, and a worker that finds one of its deliveries
    still ``enqueued`` returns it to ``pending`` without an attempt (``lease``); one
    already ``leased`` is mid-request, and its outcome is recorded as usual (a retry
    then waits too). Nothing is dead-lettered; publishing still writes its deliveries."""
    return bool(
        Endpoint.objects.filter(id=endpoint_id, paused_at__isnull=True).update(
            paused_at=now, paused_reason=reason[:200], updated_at=now
        )
    )


def endpoint_set_resumed(*, endpoint_id: uuid.UUID, now: datetime) -> bool:
    """Resume a paused endpoint (guarded: only a paused one). Its held deliveries are
    due at their own ``next_attempt_at`` (the held ones long since, a retry in backoff
    at its step), so the scheduler is woken to admit them."""
    resumed = bool(
        Endpoint.objects.filter(id=endpoint_id, paused_at__isnull=False).update(
            paused_at=None, paused_reason="", updated_at=now
        )
    )
    if resumed:
        wakeup.notify(wakeup.DUE)
    return resumed


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
