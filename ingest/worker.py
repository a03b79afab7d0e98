"""Processing inbound events: the workers lease the events their messages name, run
their handlers under entity locks and record the outcome (the state machine is
``ingest.state``; the statements ``ingest.statements``).

The processing job rides the delivery pipeline's outbox, relay, broker and workers as job
kind ``inbound`` (``deliveries.jobs.kinds``): the scheduler's sweeps call
``ingest.state.inbound_schedule``, the workers ``inbound_process``. The retry schedule is the
deliveries' policy. Events are stored by ``ingest.receiving``.

Emails with an entity are *sequenced*: each runs only after the earlier ones of its
entity have finished, across takes (``_in_sequence``, "Sequenced events" below).
"""

import json
import logging
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from django.db import DatabaseError, transaction
from django.db.models import F
from django.utils import timezone

from deliveries.core.prometheus import INBOUND_HANDLER_DURATION, INBOUND_PROCESSED
from deliveries.core.retry import RetryPolicy
from deliveries.jobs.brokers import Message
from deliveries.jobs.locks import entity_lock_acquire, entity_lock_release, entity_locks_acquire
from ingest.conf import settings

from . import mail
from .handlers import InboundMessage, ParsedEvent, handlers_for
from .models import HandlerRun, InboundEmail, InboundEvent, InboundState, Source
from .schemes import Request, get_scheme
from .state import finish
from .statements import (
    COMPLETE,
    KIND,
    LEASE,
    LEASE_INLINE_BODY_BYTES,
    LOCK_VERSIONS,
    SOURCES,
    TAKE_SEQUENCED,
    inline_body,
)

logger = logging.getLogger("ingest")

LOCK_TTL = 60.0
LOCK_BUSY_RETRY = 1.0


# --- Processing (run by the workers) --------------------------------------------------


def inbound_process(messages: Sequence[Message]) -> Counter:
    """Lease the events named by the messages and process them. Stale copies of
    messages (another dispatch, already leased or done) are skipped.

    Where the bookkeeping is one ``COMPLETE`` statement (PostgreSQL), a batch is applied
    in one transaction (``_process_batch``): every event's handlers, then that statement.
    If a handler raises or a lease was lost, that transaction is rolled back and each
    event of the batch runs again in a transaction of its own (``_process_one``), the
    path SQLite always takes, so one failing event costs the others a second run, never
    their result. Both paths apply events by one rule, ``_apply``."""
    counts: Counter = Counter()
    now = timezone.now()
    token = uuid.uuid4()
    wanted = {m.job_id: m.dispatch for m in messages}
    until = now + timedelta(seconds=LOCK_TTL + 30)
    rows = _lease(wanted, token=token, until=until)
    counts["skipped_messages"] = len(messages) - len(rows)
    rows = _in_sequence(rows, token, until, counts)
    # Batches are PostgreSQL's (docs/inbound.md): where COMPLETE is its ORM spelling, a
    # query per row, every event runs one by one.
    if COMPLETE.one_statement():
        leased = _process_batch(rows, token, counts) if rows else []
    else:
        leased = [r.id for r in rows]
    ordered = _in_applying_order(leased) if leased else []
    held: set[uuid.UUID] = set()
    for i, (row, source) in enumerate(ordered):
        if row.id in held:
            continue
        t0 = time.perf_counter()
        result = _process_one(row, source, token)
        counts[result] += 1
        INBOUND_PROCESSED.labels(source.slug, result).inc()
        _log_processed(
            row.id, source.slug, row.event_id, row.event_type, row.attempt, result,
            time.perf_counter() - t0,
        )  # fmt: skip
        if result not in COMMITTED:
            held |= _hold_behind(row, [r for r, _ in ordered[i + 1 :]], token, counts)
    return counts


def _log_processed(event_id, slug, provider_id, event_type, attempt, result, seconds) -> None:
    logger.debug(
        "inbound processed",
        extra={
            "action": "inbound.process",
            "job_type": KIND,
            "inbound_id": str(event_id),
            "source": slug,
            "event_id": provider_id,
            "event_type": event_type,
            "attempt": attempt,
            "outcome": result,
            "duration_ms": round(seconds * 1000, 1),
        },
    )


class _Leased(NamedTuple):
    id: uuid.UUID
    source_id: uuid.UUID
    event_id: str
    event_type: str
    entity_id: str
    occurred_at: datetime | None
    body: bytes
    headers: dict
    attempt: int
    received_at: datetime
    sequenced: bool


class _Source(NamedTuple):
    """What processing reads of an event's source (``SOURCES``)."""

    id: int
    slug: str
    scheme: str
    options: dict


def _sources(ids: Iterable[int]) -> dict[int, _Source]:
    """The sources ``ids`` by id."""
    rows = SOURCES({"ids": sorted(ids)})
    return {
        row[0]: _Source(*row[:3], row[3] if isinstance(row[3], dict) else json.loads(row[3]))
        for row in rows
    }


def _leased(row: Sequence) -> _Leased:
    """An event as LEASE and TAKE_SEQUENCED return it (ingest.statements, LEASED_SQL)."""
    headers = row[7] if isinstance(row[7], dict) else json.loads(row[7])
    return _Leased(*row[:7], headers, *row[8:11])


def _lease(wanted: dict, *, token, until) -> list[_Leased]:
    with transaction.atomic():
        rows = LEASE(
            {
                "ids": list(wanted),
                "dispatches": list(wanted.values()),
                "token": token,
                "until": until,
                "inline_body_bytes": LEASE_INLINE_BODY_BYTES,
            }
        )
    return [_leased(row) for row in rows]


def _entity_key(slug: str, entity_id: str) -> str:
    """The key of an entity's lock and applied version ("" for an event without one):
    the batch and the one-by-one paths must name an entity alike to exclude each other."""
    return f"{slug}:{entity_id}" if entity_id else ""


_EARLIEST = datetime.min.replace(tzinfo=UTC)


def _order(row: _Leased) -> tuple:
    """The order events are applied in, in a batch and one by one: by their own time
    (none first), then by arrival (TAKE_SEQUENCED and ``_in_applying_order`` sort alike)."""
    return (row.occurred_at or _EARLIEST, row.received_at, row.id)


def _in_applying_order(ids: list[uuid.UUID]) -> list[tuple[_Leased, Source]]:
    """The leased events ``ids`` with their sources, read again in the order the
    one-by-one path applies them (``_order``)."""
    events = (
        InboundEvent.objects.filter(id__in=ids)
        .select_related("source")
        .defer("body")
        .annotate(inline_body=inline_body(LEASE_INLINE_BODY_BYTES))
        .order_by(F("occurred_at").asc(nulls_first=True), "received_at", "id")
    )
    return [
        (
            _Leased(
                e.id,
                e.source_id,
                e.event_id,
                e.event_type,
                e.entity_id,
                e.occurred_at,
                None if e.inline_body is None else bytes(e.inline_body),
                e.headers,
                e.attempt_count,
                e.received_at,
                e.sequenced,
            ),
            e.source,
        )
        for e in events
    ]


# --- Sequenced events ------------------------------------------------------------------

# What a sequenced event waiting behind an earlier one of its entity records.
WAITING = "waiting for an earlier email of its entity"
UNFINISHED = frozenset({InboundState.PENDING, InboundState.ENQUEUED, InboundState.PROCESSING})


def _in_sequence(rows: list[_Leased], token: uuid.UUID, until, counts: Counter) -> list[_Leased]:
    """The leased ``rows`` with their sequenced events (emails with an entity) put in
    their entity's order: each such entity's other events that are due are leased too
    (``TAKE_SEQUENCED``), so that they run in this take in their order; the leased ones
    behind an unfinished event of their entity that this worker does not hold (another
    worker's, or one waiting for its retry or its settle window) are put back to wait
    for it (``_hold``). Costs nothing, not a statement, when no row is sequenced."""
    entities = sorted({(r.source_id, r.entity_id) for r in rows if r.sequenced})
    if not entities:
        return rows
    now = timezone.now()
    # In a transaction, as LEASE: the ORM spelling's reads and its update are one (on
    # SQLite an IMMEDIATE transaction keeps every other writer out until the commit).
    with transaction.atomic():
        found = TAKE_SEQUENCED(
            {
                "sources": [source_id for source_id, _ in entities],
                "entities": [entity_id for _, entity_id in entities],
                "token": token,
                "until": until,
                "now": now,
                "limit": settings.WORKER_BATCH_SIZE,
                "inline_body_bytes": LEASE_INLINE_BODY_BYTES,
            }
        )
    rows = rows + [_leased(row[1:12]) for row in found if row[0]]
    first_waiting = {
        (row[2], row[5]): ((row[6] or _EARLIEST, row[10], row[1]), row[12], row[13])
        for row in found
        if not row[0]
    }
    held = []
    for r in rows:
        waiting = first_waiting.get((r.source_id, r.entity_id)) if r.sequenced else None
        if waiting is not None and _order(r) > waiting[0]:
            held.append((r, _wait_until(waiting[1], waiting[2], now)))
    if not held:
        return rows
    _hold(held, token, counts)
    gone = {r.id for r, _ in held}
    return [r for r in rows if r.id not in gone]


def _wait_until(state: str, next_attempt_at: datetime, now: datetime) -> datetime:
    """When the events waiting behind an unfinished one (``state``, ``next_attempt_at``)
    try again: when it is due, if it waits for its retry or its settle window; else
    (another worker has it) as an event whose entity is locked does."""
    if state == InboundState.PENDING and next_attempt_at > now:
        return next_attempt_at
    return now + timedelta(seconds=LOCK_BUSY_RETRY)


def _hold(held: list[tuple[_Leased, datetime]], token: uuid.UUID, counts: Counter) -> None:
    """Put leased events back to ``pending`` until the given times, without using up an
    attempt (as an event whose entity is locked), counted ``held``."""
    until: dict[datetime, list[uuid.UUID]] = {}
    for r, at in held:
        until.setdefault(at, []).append(r.id)
    for at, ids in until.items():
        finish(ids, token, state=InboundState.PENDING, at=at, error=WAITING,
                count_attempt=False)  # fmt: skip
    slugs = dict(
        Source.objects.filter(id__in={r.source_id for r, _ in held}).values_list("id", "slug")
    )
    for slug, n in Counter(slugs[r.source_id] for r, _ in held).items():
        counts["held"] += n
        INBOUND_PROCESSED.labels(slug, "held").inc(n)


def _hold_behind(
    row: _Leased, rest: list[_Leased], token: uuid.UUID, counts: Counter
) -> set[uuid.UUID]:
    """After the sequenced ``row`` did not finish (it failed and waits for its retry, or
    its entity was busy, or another worker took it over), hold the events of ``rest``
    behind it in its entity's order; returns their ids. Once it is dead, nothing waits
    for it."""
    if not row.sequenced:
        return set()
    entity = (row.source_id, row.entity_id)
    behind = [
        r
        for r in rest
        if r.sequenced and (r.source_id, r.entity_id) == entity and _order(r) > _order(row)
    ]
    if not behind:
        return set()
    state, due = InboundEvent.objects.values_list("state", "next_attempt_at").get(id=row.id)
    if state not in UNFINISHED:
        return set()
    at = _wait_until(state, due, timezone.now())
    _hold([(r, at) for r in behind], token, counts)
    return {r.id for r in behind}


def _process_batch(rows: list[_Leased], token: uuid.UUID, counts: Counter) -> list[uuid.UUID]:
    """Apply a leased batch in one transaction; returns the ids left to process one by
    one (all of them if the transaction was rolled back, none if it committed).

    Entity locks are taken for the whole batch at once, before the transaction; events
    whose entity another worker holds wait ``LOCK_BUSY_RETRY`` as on the one-by-one
    path. Within the batch, events run in ``_order``, so that an entity's events
    arriving out of order in one batch are applied in order; an event older than its
    entity's applied version is stale, exactly as one by one."""
    sources = _sources({r.source_id for r in rows})
    owner = str(token)
    keys = {r.id: _entity_key(sources[r.source_id].slug, r.entity_id) for r in rows if r.entity_id}
    if keys:
        held = entity_locks_acquire(keys=keys.values(), owner=owner, ttl=LOCK_TTL)
        busy = [event_id for event_id, key in keys.items() if key not in held]
        if busy:
            finish(
                busy,
                token,
                state=InboundState.PENDING,
                delay=LOCK_BUSY_RETRY,
                error="entity locked",
                count_attempt=False,
            )
            waiting = set(busy)
            for slug, n in Counter(
                sources[r.source_id].slug for r in rows if r.id in waiting
            ).items():
                counts["entity_busy"] += n
                INBOUND_PROCESSED.labels(slug, "entity_busy").inc(n)
            rows = [r for r in rows if r.id not in waiting]
    if not rows:
        return []
    rows.sort(key=_order)
    observed: list[tuple[str, float]] = []
    try:
        with transaction.atomic():
            outcomes = _apply(rows, _parsed(rows, sources), sources, keys, token, observed)
    except Exception as exc:
        blamed = isinstance(exc, _HandlerFailed) and exc.blamed
        unblamed_handler = isinstance(exc, _HandlerFailed) and not blamed
        logger.info(
            "inbound batch rolled back, its events run one by one",
            extra={
                "action": "inbound.batch_rolled_back",
                "events": len(rows),
                "error": type(exc.__cause__ if unblamed_handler else exc).__name__,
            },
        )
        if not blamed:
            return [r.id for r in rows]
        # A handler raised: that run is this event's attempt, recorded as the one-by-one
        # path would have. The batch's other events run again one by one.
        failed = exc.row
        INBOUND_HANDLER_DURATION.labels(exc.handler, "error").observe(exc.seconds)
        _record_failure(failed, token, exc.started, exc.__cause__)
        if failed.id in keys:
            entity_lock_release(key=keys[failed.id], owner=owner)
        slug = sources[failed.source_id].slug
        counts["failed"] += 1
        INBOUND_PROCESSED.labels(slug, "failed").inc()
        _log_processed(
            failed.id, slug, failed.event_id, failed.event_type, failed.attempt, "failed",
            exc.seconds,
        )  # fmt: skip
        rest = [r for r in rows if r.id != failed.id]
        held = _hold_behind(failed, rest, token, counts)
        return [r.id for r in rest if r.id not in held]
    for name, seconds in observed:
        INBOUND_HANDLER_DURATION.labels(name, "ok").observe(seconds)
    by_label: Counter = Counter()
    debug = logger.isEnabledFor(logging.DEBUG)
    for r, result, seconds in outcomes:
        slug = sources[r.source_id].slug
        by_label[slug, result] += 1
        if debug:
            _log_processed(r.id, slug, r.event_id, r.event_type, r.attempt, result, seconds)
    for (slug, result), n in by_label.items():
        counts[result] += n
        INBOUND_PROCESSED.labels(slug, result).inc(n)
    return []


def _process_one(row: _Leased, source: Source, token: uuid.UUID) -> str:
    """Apply one leased event in a transaction of its own, under its entity's lock."""
    owner = str(token)
    lock_key = _entity_key(source.slug, row.entity_id)
    if lock_key and not entity_lock_acquire(key=lock_key, owner=owner, ttl=LOCK_TTL):
        # Another event of the same entity is being applied: try again shortly, without
        # counting it as a failure.
        finish(
            [row.id],
            token,
            state=InboundState.PENDING,
            delay=LOCK_BUSY_RETRY,
            error="entity locked",
            count_attempt=False,
        )
        return "entity_busy"
    released = False
    try:
        result = _apply_one(row, source, token, lock_key)
        released = result in COMMITTED  # the lock went with the handlers' commit
        return result
    finally:
        if lock_key and not released:
            entity_lock_release(key=lock_key, owner=owner)


# _apply_one's results whose transaction committed (the entity lock released with it).
COMMITTED = frozenset({InboundState.PROCESSED, InboundState.SKIPPED, "stale"})


def _apply_one(row: _Leased, source: Source, token: uuid.UUID, lock_key: str) -> str:
    """``_apply`` for ``row`` alone, in one transaction; ``lock_key`` (if any) is the
    entity lock the lease's token holds, given back in that same transaction, so that a
    success costs one commit. A failure is recorded as the event's attempt."""
    sources = {source.id: source}
    keys = {row.id: lock_key} if lock_key else {}
    parsed = _parsed([row], sources)
    started = timezone.now()
    observed: list[tuple[str, float]] = []
    try:
        with transaction.atomic():
            [(_, result, _)] = _apply([row], parsed, sources, keys, token, observed)
    except _LeaseLost:
        return "lease_lost"
    except _HandlerFailed as exc:
        INBOUND_HANDLER_DURATION.labels(exc.handler, "error").observe(exc.seconds)
        _record_failure(row, token, exc.started, exc.__cause__)
        return "failed"
    except Exception as exc:
        _record_failure(row, token, started, exc)
        return "failed"
    finally:
        for name, seconds in observed:
            INBOUND_HANDLER_DURATION.labels(name, "ok").observe(seconds)
    return result


def _parsed(rows: list[_Leased], sources: dict) -> Iterator[ParsedEvent]:
    """What the handlers of each event in ``rows`` are given, one at a time as ``_apply``
    reaches it: a ParsedEvent, or for mail an InboundMessage, the stored message parsed
    again with its envelope. Made as they are applied, so that a batch holds one parsed
    message (three times its size or more) at a time, and a body the lease left out
    (over ``LEASE_INLINE_BODY_BYTES``) is read then; an error here is its event's."""
    schemes = {
        i: get_scheme(source.scheme, source.options or None) for i, source in sources.items()
    }
    emails = InboundEmail.objects.in_bulk([r.id for r in rows if schemes[r.source_id].is_email])
    for r in rows:
        if r.body is None:
            r = r._replace(
                body=bytes(InboundEvent.objects.values_list("body", flat=True).get(id=r.id))
            )
        common = {
            "id": str(r.id),
            "source": sources[r.source_id].slug,
            "event_id": r.event_id,
            "event_type": r.event_type,
            "entity_id": r.entity_id,
            "occurred_at": r.occurred_at,
            "body": r.body,
            "headers": r.headers,
            "attempt": r.attempt,
        }
        email = emails.get(r.id)
        if email is None:
            payload = schemes[r.source_id].parse(Request(headers=r.headers, body=r.body))
            yield ParsedEvent(payload=payload, **common)
            continue
        content = mail.read(r.body)
        yield (
            InboundMessage(
                payload=content.message,
                **common,
                transport=email.transport,
                mail_from=email.mail_from,
                recipient=email.recipient,
                recipients=tuple(email.recipients),
                from_address=email.from_address,
                to=tuple(email.to),
                cc=tuple(email.cc),
                subject=email.subject,
                message_id=email.message_id,
                text=content.text,
                html=content.html,
                attachments=content.attachments,
                authentication=dict(email.authentication),
                message=content.message,
            )
        )


def _apply(
    rows: list[_Leased],
    parsed: Iterable[ParsedEvent],
    sources: dict,
    keys: dict,
    token: uuid.UUID,
    observed: list[tuple[str, float]],
) -> list[tuple[_Leased, str, float]]:
    """The rule both paths apply events by, in the caller's transaction: run the
    handlers of every event in ``rows`` (in their order) and record them in one
    ``COMPLETE`` statement. Returns (row, outcome, seconds) per event and appends
    (handler, seconds) to ``observed`` for every handler that ran.

    - **Versions**: an event with an entity (its key in ``keys``, whose locks the token
      holds) and a time is stale if older than the version applied to that entity; a
      stale event's handlers are recorded ``stale`` and not run, unless registered with
      ``see_stale``. Otherwise it becomes the entity's version, written with the runs.
    - **Runs**: one ``HandlerRun`` row per handler (``ok`` or ``stale``), or one
      ``no_handler`` row; the event is ``processed`` if a handler ran, else ``skipped``.
    - **Failure**: a handler that raises raises ``_HandlerFailed``; a lease that was
      lost (expired and taken over) raises ``_LeaseLost``, and the caller rolls back."""
    version_keys = sorted({keys[r.id] for r in rows if r.id in keys and r.occurred_at})
    applied = _applied_versions(version_keys)
    latest: dict[str, tuple[datetime, uuid.UUID]] = {}
    registered: dict[tuple[str, str], list] = {}
    runs: list[tuple] = []
    outcomes: list[tuple[_Leased, str, float]] = []
    states: list[str] = []
    for r, event in zip(rows, parsed, strict=True):
        t_event = time.perf_counter()
        slug = sources[r.source_id].slug
        # Each email is a message of its own, never a newer copy of an older one: it is
        # applied in its turn (by its Date within a batch), never skipped as stale.
        is_email = isinstance(event, InboundMessage)
        stale = False
        key = keys.get(r.id)
        if key and r.occurred_at is not None:
            if key in applied and r.occurred_at < applied[key]:
                stale = not is_email
            else:
                applied[key] = r.occurred_at
                latest[key] = (r.occurred_at, r.id)
        registrations = registered.get((slug, r.event_type))
        if registrations is None:
            registrations = registered[slug, r.event_type] = handlers_for(
                slug, r.event_type, email=is_email
            )
        started = timezone.now()
        ran = 0
        for registration in registrations:
            if stale and not registration.see_stale:
                runs.append((r.id, registration.name, r.attempt, started, 0.0, "stale"))
                continue
            t0 = time.perf_counter()
            try:
                registration.func(event)
            except Exception as exc:
                raise _HandlerFailed(
                    r, registration.name, started, time.perf_counter() - t0
                ) from exc
            elapsed = time.perf_counter() - t0
            observed.append((registration.name, elapsed))
            ran += 1
            runs.append((r.id, registration.name, r.attempt, started, elapsed * 1000, "ok"))
        if not registrations:
            runs.append((r.id, "", r.attempt, started, 0.0, "no_handler"))
        final = InboundState.PROCESSED if ran else InboundState.SKIPPED
        states.append(final)
        outcomes.append((r, "stale" if stale else final, time.perf_counter() - t_event))
    ids = [r.id for r in rows]
    lock_keys = sorted(set(keys.values()))
    if not _complete(ids, states, runs, sorted(latest.items()), lock_keys, token):
        raise _LeaseLost
    return outcomes


class _LeaseLost(Exception):
    pass


class _HandlerFailed(Exception):
    """A handler raised (the ``__cause__``) on ``row``."""

    def __init__(self, row: _Leased, handler: str, started: datetime, seconds: float) -> None:
        super().__init__(handler)
        self.row, self.handler, self.started, self.seconds = row, handler, started, seconds

    @property
    def blamed(self) -> bool:
        """Whether the failure is the event's own even within a batch. A database error
        may have been caused by an earlier handler of the same transaction (a swallowed
        error leaves it aborted): only a run in a transaction of its own tells."""
        return not isinstance(self.__cause__, DatabaseError)


def _applied_versions(version_keys: list[str]) -> dict[str, datetime]:
    """The applied version of each key, its row locked to the end of the transaction
    (the entity locks already keep other workers off these keys)."""
    if not version_keys:
        return {}
    return dict(LOCK_VERSIONS({"keys": version_keys}))


def _complete(ids, states, runs, versions, lock_keys, token) -> bool:
    """``COMPLETE``: ``runs`` are (event id, handler, attempt, started, duration ms,
    outcome), ``versions`` (key, (applied at, event id)); the entity locks ``lock_keys``
    are released if the lease's token owns them. False when a lease was lost."""
    columns = list(zip(*runs, strict=True))  # every event has at least one run row
    (done,) = COMPLETE(
        {
            "now": timezone.now(),
            "ids": ids,
            "states": states,
            "token": token,
            "run_events": list(columns[0]),
            "run_handlers": list(columns[1]),
            "run_attempts": list(columns[2]),
            "run_started": list(columns[3]),
            "run_durations": list(columns[4]),
            "run_outcomes": list(columns[5]),
            "version_keys": [k for k, _ in versions],
            "version_times": [v[0] for _, v in versions],
            "version_events": [v[1] for _, v in versions],
            "lock_keys": lock_keys,
            "owner": str(token),
        }
    )
    return done == len(ids)


def _record_failure(row: _Leased, token, started, exc) -> None:
    error = "".join(traceback.format_exception_only(exc)).strip()[:2000]
    policy = RetryPolicy.from_settings()
    delay = policy.next_delay(max(row.attempt, 1))
    with transaction.atomic():
        HandlerRun.objects.create(
            event_id=row.id,
            handler="",
            attempt=row.attempt,
            started_at=started,
            duration_ms=(timezone.now() - started).total_seconds() * 1000,
            outcome=HandlerRun.Outcome.ERROR,
            error=error,
        )
        finish(
            [row.id],
            token,
            state=InboundState.PENDING if delay is not None else InboundState.DEAD,
            delay=delay or 0,
            error=error,
        )
    logger.warning(
        "handler failed",
        extra={
            "action": "ingest.handler_failed",
            "inbound_id": str(row.id),
            "error": error[:200],
        },
    )
