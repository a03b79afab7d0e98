"""Inbound webhooks: receiving (verify, dedupe, store) and processing (lease, run the
handlers under an entity lock, record), with guarded transitions on ``InboundEvent``:

    enqueued ──lease──▶ processing ──finish──▶ processed | skipped | dead
       ▲                    │         └──retry──▶ pending ──admit──▶ enqueued
       └──lost dispatch─────┴──lease expired──▶ pending

The processing job rides the delivery pipeline's outbox, relay, broker and workers as job
kind ``inbound`` (``deliveries.jobs.kinds``); the retry schedule is the deliveries' policy.
"""

import hashlib
import json
import logging
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connection,
    transaction,
)
from django.db.models import F
from django.utils import timezone
from psycopg.types.json import Jsonb

from deliveries import encryption, ratelimit
from deliveries.jobs.broker import Message
from deliveries.jobs.ids import uuid7
from deliveries.jobs.locks import entity_lock_acquire, entity_lock_release, entity_locks_acquire
from deliveries.policy import RetryPolicy
from deliveries.prometheus import (
    INBOUND_HANDLER_DURATION,
    INBOUND_PROCESSED,
    INBOUND_RECEIVED,
    INBOUND_REFUSED,
    INBOUND_SIGNATURE_FAILURES,
)
from deliveries.signals import send_after_commit
from ingest.conf import settings

from .handlers import ParsedEvent, handlers_for
from .models import (
    HandlerRun,
    InboundEvent,
    InboundState,
    Source,
    SourceSecret,
    VerificationFailure,
)
from .queries import (
    ADVANCE_VERSION,
    COMPLETE,
    INSERT_EVENT,
    INSERT_EVENTS,
    KIND,
    LEASE,
    LOCK_VERSIONS,
    write_outbox,
)
from .schemes import Request, UnparseableBody, VerificationFailed, get_scheme
from .signals import inbound_event_stored

logger = logging.getLogger("ingest")

# Headers never stored with an event: credentials and signatures.
SECRET_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization", "x-api-key"})
SIGNATURE_WORDS = ("signature", "hmac", "token", "secret")
LOCK_TTL = 60.0
LOCK_BUSY_RETRY = 1.0


# --- Sources --------------------------------------------------------------------------


# The receive view's per-process cache of sources and their secrets: without it every
# request spends two queries before its one write. A change made in this process (a
# save or delete of a source or secret, admin included) clears it at once
# (ingest.apps wires the signals); other processes see it within
# INGEST_SOURCE_CACHE_SECONDS. Secrets are cached with their expiry and filtered at use,
# so an expiring secret still stops on time.
_SOURCE_CACHE: dict[str, tuple[float, Source | None]] = {}
_SOURCE_CACHE_MAX = 1000  # unknown slugs are cached too; bounded against slug floods


def source_for(slug: str) -> Source | None:
    """The enabled source ``slug`` (None if unknown or disabled), with its configured
    ``verifier`` (its scheme), ``accepted_content_types`` and ``cached_secrets``
    [(secret, expires_at)] attached."""
    ttl = settings.INGEST_SOURCE_CACHE_SECONDS
    now = time.monotonic()
    hit = _SOURCE_CACHE.get(slug)
    if hit is not None and hit[0] > now:
        return hit[1]
    source = Source.objects.filter(slug=slug, enabled=True).first()
    if source is not None:
        source.verifier = _verifier(source)
        source.accepted_content_types = tuple(source.content_types or source.verifier.content_types)
        source.cached_secrets = _stored_secrets(source)
    if ttl > 0:
        if len(_SOURCE_CACHE) >= _SOURCE_CACHE_MAX:
            _SOURCE_CACHE.clear()
        _SOURCE_CACHE[slug] = (now + ttl, source)
    return source


def forget_sources(**_signal_kwargs) -> None:
    """Empty this process's source cache (connected to Source/SourceSecret changes)."""
    _SOURCE_CACHE.clear()


def source_create(
    *, slug: str, scheme: str, secrets: Sequence[str], options: dict | None = None, **fields
) -> Source:
    get_scheme(scheme, options or None)  # refuses an unknown scheme or bad options
    with transaction.atomic():
        source = Source.objects.create(slug=slug, scheme=scheme, options=options or {}, **fields)
        for secret in secrets:
            SourceSecret.objects.create(source=source, secret=secret)
    return source


def source_throttle(source: Source) -> int:
    """Seconds to wait if ``source`` is over its rate limit this second, else 0. Counted
    per second in the shared cache (deliveries/ratelimit.py): the limit holds across every
    web process and host."""
    if not source.rate_limit:
        return 0
    hits, _ = ratelimit.hit(f"ingest-rate:{source.id}", window=1.0)
    return 1 if hits > source.rate_limit else 0


def count_refusal(source: Source, reason: str, request=None, remote: str = "") -> None:
    """Count a refused request per source and reason; never creates work."""
    now = timezone.now()
    sample = {"at": now.isoformat(), "remote": remote or _remote(request)}
    updated = VerificationFailure.objects.filter(source=source, reason=reason).update(
        count=F("count") + 1, last_at=now, sample=sample
    )
    if not updated:
        try:
            with transaction.atomic():
                VerificationFailure.objects.create(
                    source=source,
                    reason=reason,
                    count=1,
                    first_at=now,
                    last_at=now,
                    sample=sample,
                )
        except IntegrityError:  # a concurrent first failure created it
            VerificationFailure.objects.filter(source=source, reason=reason).update(
                count=F("count") + 1, last_at=now, sample=sample
            )
    INBOUND_REFUSED.labels(source.slug, reason).inc()
    logger.info(
        "inbound refused",
        extra={"action": "ingest.refused", "source": source.slug, "reason": reason},
    )


def _remote(request) -> str:
    return request.META.get("REMOTE_ADDR", "") if request is not None else ""


# --- Receiving ------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    status: int
    event_id: uuid.UUID | None = None
    duplicate: bool = False


def _verifier(source: Source):
    """The source's configured scheme: the one ``source_for`` attached (built once per
    cache period, not per request), else built now."""
    return getattr(source, "verifier", None) or get_scheme(source.scheme, source.options or None)


def _live_secrets(source: Source, now: datetime) -> list[str]:
    """The secrets not yet expired, newest first (from the cache when the source came
    from ``source_for``)."""
    secrets = getattr(source, "cached_secrets", None)
    if secrets is None:
        secrets = _stored_secrets(source)
    return [secret for secret, expires_at in secrets if expires_at is None or expires_at > now]


def _stored_secrets(source: Source) -> tuple[tuple[str, datetime | None], ...]:
    """(secret, expires_at) of every secret of ``source``, newest first, decrypted; one
    that no configured key opens is logged and left out."""
    rows = (
        SourceSecret.objects.filter(source=source)
        .order_by("-created_at")
        .values_list("id", "secret_encrypted", "legacy_plaintext", "expires_at")
    )
    found = []
    for secret_id, token, legacy, expires_at in rows:
        secret = encryption.reveal_or_skip(token, legacy, row=f"source secret {secret_id}")
        if secret is not None:
            found.append((secret, expires_at))
    return tuple(found)


def _stored_headers(headers) -> dict[str, str]:
    return {
        k: v
        for k, v in headers.items()
        if k not in SECRET_HEADERS and not any(w in k for w in SIGNATURE_WORDS)
    }


def inbound_receive(*, source: Source, request: Request, remote: str = "") -> Received:
    """Verify ``request`` for ``source``, then store it once.

    Verification comes first and failures create nothing but a count. An authentic body
    that does not parse is stored as ``rejected`` (evidence, never processed) and
    answered 400. Otherwise the event and its processing job are inserted in one short
    transaction; ``UNIQUE(source, event_id)`` turns a second copy, even a concurrent
    one, into a counted duplicate."""
    now = timezone.now()
    scheme = _verifier(source)
    try:
        scheme.verify(
            request,
            secrets=_live_secrets(source, now),
            now=time.time(),
            tolerance=source.replay_tolerance,
        )
    except VerificationFailed as exc:
        INBOUND_SIGNATURE_FAILURES.labels(source.slug, exc.reason).inc()
        count_refusal(source, exc.reason, remote=remote)
        return Received(401)
    try:
        parsed = scheme.parse(request)
        meta = scheme.extract(request, parsed)
    except UnparseableBody as exc:
        digest = hashlib.sha256(request.body).hexdigest()
        event, duplicate = _insert(
            source,
            event_id=f"rejected:{digest}",
            event_type="",
            entity_id="",
            occurred_at=None,
            request=request,
            now=now,
            state=InboundState.REJECTED,
            error=f"unparseable: {exc.reason}",
        )
        count_refusal(source, f"unparseable_{exc.reason}", remote=remote)
        return Received(400, event, duplicate)
    event, duplicate = _insert(
        source,
        event_id=meta.event_id,
        event_type=meta.event_type,
        entity_id=meta.entity_id,
        occurred_at=meta.occurred_at,
        request=request,
        now=now,
        state=InboundState.ENQUEUED,
        body_sha256=None if scheme.signs_event_id else hashlib.sha256(request.body).hexdigest(),
    )
    INBOUND_RECEIVED.labels(source.slug, str(duplicate).lower()).inc()
    # DEBUG, like a successful delivery attempt: the stored row is the record and the
    # counter the rate; formatting a line for every acknowledged webhook cost about a
    # tenth of the request. Refusals stay at INFO.
    logger.debug(
        "inbound received",
        extra={
            "action": "ingest.received",
            "job_type": KIND,
            "source": source.slug,
            "event_id": meta.event_id,
            "event_type": meta.event_type,
            "inbound_id": str(event),
            "duplicate": duplicate,
            "outcome": "duplicate" if duplicate else "accepted",
            "duration_ms": round((timezone.now() - now).total_seconds() * 1000, 1),
        },
    )
    return Received(200, event, duplicate)


def _insert(
    source,
    *,
    event_id,
    event_type,
    entity_id,
    occurred_at,
    request,
    now,
    state,
    error="",
    body_sha256=None,
) -> tuple[uuid.UUID, bool]:
    """Store the event (and, if it is to be processed, its outbox row) unless the source
    has it already: the same ``event_id``, or the same ``body_sha256`` when given (the
    second key, for schemes that do not sign the id). A copy counts as a duplicate on
    the stored row. Returns the stored id and whether it was a duplicate."""
    fields = {
        "id": uuid7(),
        "source_id": source.id,
        "event_id": event_id,
        "body_sha256": body_sha256,
        "event_type": event_type[:200],
        "entity_id": entity_id[:300],
        "occurred_at": occurred_at,
        "body": request.body,
        "headers": _stored_headers(request.headers),
        "state": state,
        "received_at": now,
        "next_attempt_at": now,
        "last_error": error,
        "dispatch_count": 1 if state == InboundState.ENQUEUED else 0,
        "enqueued_at": now if state == InboundState.ENQUEUED else None,
    }
    with_job = state == InboundState.ENQUEUED
    params = {**fields, "headers": Jsonb(fields["headers"]), "now": now, "with_job": with_job}
    if _insert_event(params):
        if state == InboundState.ENQUEUED:
            send_after_commit(inbound_event_stored, InboundEvent, [fields["id"]])
        return fields["id"], False
    stored = InboundEvent.objects.filter(source=source)
    found = stored.filter(event_id=event_id).values_list("id", flat=True).first()
    if found is None and body_sha256 is not None:
        found = stored.filter(body_sha256=body_sha256).values_list("id", flat=True).first()
    stored.filter(id=found).update(duplicates=F("duplicates") + 1, last_duplicate_at=now)
    return found, True


def _insert_event(params: dict) -> bool:
    """``INSERT_EVENT``, one statement in autocommit; whether the event was inserted. It
    is usually the request's first use of a persistent connection, with no health check
    before it (the source came from the cache), so a connection the PostgreSQL server
    dropped (a restart) shows up here: the statement is then tried once more on a fresh
    connection. That is safe because it is idempotent: had the first try committed, the
    second finds the event and reports a duplicate. A SQLite file has no server to lose:
    its errors are not retried."""
    for attempt in (1, 2):
        try:
            return INSERT_EVENT(params)[0] == 1
        except (OperationalError, InterfaceError):
            if attempt == 2 or connection.in_atomic_block or connection.vendor != "postgresql":
                raise
            connection.close()
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class NewEvent:
    """An event that did not come through the receive view (a polled record)."""

    event_id: str
    event_type: str
    entity_id: str
    occurred_at: datetime | None
    body: bytes


def inbound_store_many(*, source: Source, events: Sequence[NewEvent]) -> tuple[int, int]:
    """Store events of ``source`` with their processing jobs, like :func:`inbound_receive`
    stores one verified request: ``UNIQUE(source, event_id)`` makes a copy a counted
    duplicate. Returns (stored, duplicates). Runs in the caller's transaction, so a
    poller commits the events and its cursor together."""
    if not events:
        return 0, 0
    now = timezone.now()
    new, duplicates = INSERT_EVENTS(
        {
            "event_ids": [e.event_id for e in events],
            "types": [e.event_type[:200] for e in events],
            "entities": [e.entity_id[:300] for e in events],
            "occurred": [e.occurred_at for e in events],
            "bodies": [e.body for e in events],
            "source_id": source.id,
            "now": now,
        }
    )
    send_after_commit(inbound_event_stored, InboundEvent, new)
    stored = len(new)
    INBOUND_RECEIVED.labels(source.slug, "false").inc(stored)
    INBOUND_RECEIVED.labels(source.slug, "true").inc(duplicates)
    return stored, duplicates


# --- Scheduling (run by the scheduler's sweeps) -----------------------------------------


def inbound_schedule(now: datetime, page_size: int) -> tuple[Counter, bool]:
    """Admit due pending events, expire leases, recover lost dispatches."""
    counts: Counter = Counter()
    lease_cutoff = now
    stale_cutoff = now - timedelta(seconds=settings.SCHEDULER_STALE_ENQUEUED_SECONDS)
    with transaction.atomic():
        expired = list(
            InboundEvent.objects.filter(state=InboundState.PROCESSING, lease_until__lt=lease_cutoff)
            .select_for_update(skip_locked=True)
            .values_list("id", flat=True)[:page_size]
        )
        lost = list(
            InboundEvent.objects.filter(state=InboundState.ENQUEUED, enqueued_at__lt=stale_cutoff)
            .select_for_update(skip_locked=True)
            .values_list("id", flat=True)[:page_size]
        )
        InboundEvent.objects.filter(id__in=expired, state=InboundState.PROCESSING).update(
            state=InboundState.PENDING,
            next_attempt_at=now,
            lease_until=None,
            lease_token=None,
            last_error="lease expired",
        )
        InboundEvent.objects.filter(id__in=lost, state=InboundState.ENQUEUED).update(
            state=InboundState.PENDING, next_attempt_at=now
        )
        counts["lease_expired"], counts["transport_lost"] = len(expired), len(lost)
    with transaction.atomic():
        # Uses the partial index inbound_due.
        due = list(
            InboundEvent.objects.filter(state=InboundState.PENDING, next_attempt_at__lte=now)
            .select_for_update(skip_locked=True)
            .order_by("next_attempt_at")
            .values_list("id", flat=True)[:page_size]
        )
        if due:
            InboundEvent.objects.filter(id__in=due, state=InboundState.PENDING).update(
                state=InboundState.ENQUEUED,
                enqueued_at=now,
                dispatch_count=F("dispatch_count") + 1,
            )
            write_outbox(due, now)
        counts["enqueued"] = len(due)
    return counts, len(due) >= page_size


# --- Processing (run by the workers) --------------------------------------------------


def inbound_process(messages: Sequence[Message]) -> Counter:
    """Lease the events named by the messages and process them. Stale copies of
    messages (another dispatch, already leased or done) are skipped.

    On PostgreSQL a batch is applied in one transaction (``_process_batch``): every
    event's handlers, then one statement for all the bookkeeping. If a handler raises or
    a lease was lost, that transaction is rolled back and each event of the batch runs
    again in a transaction of its own (``_process_one``), the path SQLite always takes,
    so one failing event costs the others a second run, never their result."""
    counts: Counter = Counter()
    now = timezone.now()
    token = uuid.uuid4()
    wanted = {m.job_id: m.dispatch for m in messages}
    until = now + timedelta(seconds=LOCK_TTL + 30)
    rows = _lease(wanted, token=token, until=until)
    counts["skipped_messages"] = len(messages) - len(rows)
    # Batches are PostgreSQL's (docs/inbound.md): on SQLite every event runs one by one.
    if connection.vendor == "postgresql":
        leased = _process_batch(rows, token, counts) if rows else []
    else:
        leased = [r.id for r in rows]
    events = (
        InboundEvent.objects.filter(id__in=leased)
        .select_related("source")
        .order_by(F("occurred_at").asc(nulls_first=True), "received_at")
    )
    for event in events if leased else ():
        t0 = time.perf_counter()
        result = _process_one(event, token)
        counts[result] += 1
        INBOUND_PROCESSED.labels(event.source.slug, result).inc()
        _log_processed(
            event.id, event.source.slug, event.event_id, event.event_type, event.attempt_count,
            result, time.perf_counter() - t0,
        )  # fmt: skip
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


def _lease(wanted: dict, *, token, until) -> list[_Leased]:
    with transaction.atomic():
        rows = LEASE(
            {
                "ids": list(wanted),
                "dispatches": list(wanted.values()),
                "token": token,
                "until": until,
            }
        )
    return [
        _Leased(*row[:7], row[7] if isinstance(row[7], dict) else json.loads(row[7]), row[8])
        for row in rows
    ]


def _entity_key(slug: str, entity_id: str) -> str:
    """The key of an entity's lock and applied version ("" for an event without one):
    the batch and the one-by-one paths must name an entity alike to exclude each other."""
    return f"{slug}:{entity_id}" if entity_id else ""


_EARLIEST = datetime.min.replace(tzinfo=UTC)


def _process_batch(rows: list[_Leased], token: uuid.UUID, counts: Counter) -> list[uuid.UUID]:
    """Apply a leased batch in one transaction; returns the ids left to process one by
    one (all of them if the transaction was rolled back, none if it committed).

    Entity locks are taken for the whole batch at once, before the transaction; events
    whose entity another worker holds wait ``LOCK_BUSY_RETRY`` as on the one-by-one
    path. Within the batch, events run in the order of their own time, so that an
    entity's events arriving out of order in one batch are applied in order; an event
    older than its entity's applied version is stale, exactly as one by one."""
    sources = Source.objects.in_bulk({r.source_id for r in rows})
    owner = str(token)
    keys = {r.id: _entity_key(sources[r.source_id].slug, r.entity_id) for r in rows if r.entity_id}
    if keys:
        held = entity_locks_acquire(keys=keys.values(), owner=owner, ttl=LOCK_TTL)
        busy = [event_id for event_id, key in keys.items() if key not in held]
        if busy:
            _finish_many(
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
    rows.sort(key=lambda r: r.occurred_at or _EARLIEST)
    try:
        with transaction.atomic():
            outcomes, observed = _apply_batch(rows, sources, keys, token)
    except Exception as exc:
        logger.info(
            "inbound batch rolled back, its events run one by one",
            extra={
                "action": "inbound.batch_rolled_back",
                "events": len(rows),
                "error": type(exc).__name__,
            },
        )
        if not isinstance(exc, _HandlerFailed):
            return [r.id for r in rows]
        # A handler raised: that run is this event's attempt, recorded as the one-by-one
        # path would have. The batch's other events run again one by one.
        failed = exc.row
        INBOUND_HANDLER_DURATION.labels(exc.handler, "error").observe(exc.seconds)
        event = InboundEvent(id=failed.id, attempt_count=failed.attempt)
        _record_failure(event, token, exc.started, exc.__cause__)
        if failed.id in keys:
            entity_lock_release(key=keys[failed.id], owner=owner)
        slug = sources[failed.source_id].slug
        counts["failed"] += 1
        INBOUND_PROCESSED.labels(slug, "failed").inc()
        _log_processed(
            failed.id, slug, failed.event_id, failed.event_type, failed.attempt, "failed",
            exc.seconds,
        )  # fmt: skip
        return [r.id for r in rows if r.id != failed.id]
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


def _apply_batch(rows: list[_Leased], sources: dict, keys: dict, token: uuid.UUID):
    """Run the handlers of every event in ``rows`` and record them in one statement;
    in the caller's transaction. Raises if a handler raises or a lease was lost."""
    version_keys = sorted({keys[r.id] for r in rows if r.id in keys and r.occurred_at})
    applied = _applied_versions(version_keys)
    latest: dict[str, tuple[datetime, uuid.UUID]] = {}
    schemes = {
        i: get_scheme(source.scheme, source.options or None) for i, source in sources.items()
    }
    registered: dict[tuple[str, str], list] = {}
    runs: list[tuple] = []
    observed: list[tuple[str, float]] = []
    outcomes: list[tuple[_Leased, str, float]] = []
    states: list[str] = []
    for r in rows:
        t_event = time.perf_counter()
        slug = sources[r.source_id].slug
        request = Request(headers=r.headers, body=r.body)
        parsed = ParsedEvent(
            id=str(r.id),
            source=slug,
            event_id=r.event_id,
            event_type=r.event_type,
            entity_id=r.entity_id,
            occurred_at=r.occurred_at,
            payload=schemes[r.source_id].parse(request),
            body=r.body,
            headers=r.headers,
            attempt=r.attempt,
        )
        stale = False
        key = keys.get(r.id)
        if key and r.occurred_at is not None:
            if key in applied and r.occurred_at < applied[key]:
                stale = True
            else:
                applied[key] = r.occurred_at
                latest[key] = (r.occurred_at, r.id)
        registrations = registered.get((slug, r.event_type))
        if registrations is None:
            registrations = registered[slug, r.event_type] = handlers_for(slug, r.event_type)
        started = timezone.now()
        ran = 0
        for registration in registrations:
            if stale and not registration.see_stale:
                runs.append((r.id, registration.name, r.attempt, started, 0.0, "stale"))
                continue
            t0 = time.perf_counter()
            try:
                registration.func(parsed)
            except DatabaseError:
                # Perhaps caused by an earlier handler of the batch (a swallowed error
                # leaves the transaction aborted): the one-by-one run tells.
                raise
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
    if not _complete_many(ids, states, runs, sorted(latest.items()), lock_keys, token):
        raise _LeaseLost
    return outcomes, observed


def _applied_versions(version_keys: list[str]) -> dict[str, datetime]:
    """The applied version of each key, its row locked to the end of the transaction
    (the entity locks already keep other workers off these keys)."""
    if not version_keys:
        return {}
    return dict(LOCK_VERSIONS({"keys": version_keys}))


def _complete_many(ids, states, runs, versions, lock_keys, token) -> bool:
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


def _process_one(event: InboundEvent, token: uuid.UUID) -> str:
    owner = str(token)
    lock_key = _entity_key(event.source.slug, event.entity_id)
    if lock_key and not entity_lock_acquire(key=lock_key, owner=owner, ttl=LOCK_TTL):
        # Another event of the same entity is being applied: try again shortly, without
        # counting it as a failure.
        _finish(
            event,
            token,
            state=InboundState.PENDING,
            delay=LOCK_BUSY_RETRY,
            error="entity locked",
            count_attempt=False,
        )
        return "entity_busy"
    released = False
    try:
        result = _run_handlers(event, token, lock_key=lock_key)
        released = result in COMMITTED  # the lock went with the handlers' commit
        return result
    finally:
        if lock_key and not released:
            entity_lock_release(key=lock_key, owner=owner)


# _run_handlers' results whose transaction committed (the entity lock released with it).
COMMITTED = frozenset({InboundState.PROCESSED, InboundState.SKIPPED, "stale"})


def _run_handlers(event: InboundEvent, token: uuid.UUID, lock_key: str = "") -> str:
    """Run the event's handlers and mark it done, in one transaction; ``lock_key`` (if
    any) is the entity lock the lease's token holds, given back in that same
    transaction, so that a success costs one commit."""
    scheme = get_scheme(event.source.scheme, event.source.options or None)
    request = Request(headers=event.headers, body=bytes(event.body))
    parsed = ParsedEvent(
        id=str(event.id),
        source=event.source.slug,
        event_id=event.event_id,
        event_type=event.event_type,
        entity_id=event.entity_id,
        occurred_at=event.occurred_at,
        payload=scheme.parse(request),
        body=request.body,
        headers=event.headers,
        attempt=event.attempt_count,
    )
    registrations = handlers_for(event.source.slug, event.event_type)
    version_key = _entity_key(event.source.slug, event.entity_id)
    started = timezone.now()
    try:
        with transaction.atomic():
            stale = not _advance_version(version_key, event)
            runs, ran = [], 0
            for registration in registrations:
                if stale and not registration.see_stale:
                    runs.append(_run_row(event, registration.name, started, "stale"))
                    continue
                t0 = time.perf_counter()
                try:
                    registration.func(parsed)
                except Exception:
                    INBOUND_HANDLER_DURATION.labels(registration.name, "error").observe(
                        time.perf_counter() - t0
                    )
                    raise
                elapsed = time.perf_counter() - t0
                INBOUND_HANDLER_DURATION.labels(registration.name, "ok").observe(elapsed)
                ran += 1
                runs.append(_run_row(event, registration.name, started, "ok", elapsed * 1000))
            if not registrations:
                runs.append(_run_row(event, "", started, "no_handler"))
            final = InboundState.PROCESSED if ran else InboundState.SKIPPED
            if not _complete(event, token, final, runs, lock_key):
                # The lease was lost (expired and taken over): undo, the owner applies it.
                raise _LeaseLost
    except _LeaseLost:
        return "lease_lost"
    except Exception as exc:
        _record_failure(event, token, started, exc)
        return "failed"
    return "stale" if stale else final


class _LeaseLost(Exception):
    pass


class _HandlerFailed(Exception):
    """A handler raised (the ``__cause__``) on ``row``, in a batch."""

    def __init__(self, row: _Leased, handler: str, started: datetime, seconds: float) -> None:
        super().__init__(handler)
        self.row, self.handler, self.started, self.seconds = row, handler, started, seconds


def _advance_version(version_key: str, event: InboundEvent) -> bool:
    """Record ``event`` as the last one applied to its entity, by the events' own time,
    unless it is older than the one already applied (stale: returns False). Runs before
    the handlers in their transaction, so a failing handler undoes it."""
    if not version_key or event.occurred_at is None:
        return True
    params = {"key": version_key, "applied_at": event.occurred_at, "event_id": event.id}
    return ADVANCE_VERSION(params) is not None


def _run_row(event, name, started, outcome, duration_ms=0.0, error=""):
    return HandlerRun(
        event=event,
        handler=name,
        attempt=event.attempt_count,
        started_at=started,
        duration_ms=duration_ms,
        outcome=outcome,
        error=error,
    )


def _record_failure(event, token, started, exc) -> None:
    error = "".join(traceback.format_exception_only(exc)).strip()[:2000]
    policy = RetryPolicy.from_settings()
    delay = policy.next_delay(max(event.attempt_count, 1))
    with transaction.atomic():
        HandlerRun.objects.create(
            event=event,
            handler="",
            attempt=event.attempt_count,
            started_at=started,
            duration_ms=(timezone.now() - started).total_seconds() * 1000,
            outcome=HandlerRun.Outcome.ERROR,
            error=error,
        )
        _finish(
            event,
            token,
            state=InboundState.PENDING if delay is not None else InboundState.DEAD,
            delay=delay or 0,
            error=error,
        )
    logger.warning(
        "handler failed",
        extra={
            "action": "ingest.handler_failed",
            "inbound_id": str(event.id),
            "error": error[:200],
        },
    )


def _complete(event, token, state, runs: list, lock_key: str) -> bool:
    """Record ``runs``, mark ``event`` ``state`` and give back the entity lock
    ``lock_key`` (if any) the token holds, if the lease is still ours; False when it was
    lost."""
    lock_keys = [lock_key] if lock_key else []
    rows = [(event.id, r.handler, r.attempt, r.started_at, r.duration_ms, r.outcome) for r in runs]
    # The version was advanced before the handlers (_advance_version): none to move here.
    return _complete_many([event.id], [state], rows, [], lock_keys, token)


def _finish(
    event, token, *, state, delay: float = 0.0, error: str = "", count_attempt: bool = True
) -> bool:
    """The guarded transition out of ``processing``, for the lease holder only."""
    return bool(
        _finish_many(
            [event.id], token, state=state, delay=delay, error=error, count_attempt=count_attempt
        )
    )


def _finish_many(
    ids, token, *, state, delay: float = 0.0, error: str = "", count_attempt: bool = True
) -> int:
    now = timezone.now()
    fields = {"state": state, "lease_until": None, "lease_token": None, "last_error": error}
    if state == InboundState.PENDING:
        fields["next_attempt_at"] = now + timedelta(seconds=delay)
        if not count_attempt:
            fields["attempt_count"] = F("attempt_count") - 1
    else:
        fields["processed_at"] = now
    return InboundEvent.objects.filter(
        id__in=ids, state=InboundState.PROCESSING, lease_token=token
    ).update(**fields)


def inbound_reprocess(*, event_ids: Sequence[uuid.UUID], actor=None) -> int:
    """Process events again (staff), audited; the handlers must be idempotent for it."""
    from deliveries.services import audit

    now = timezone.now()
    with transaction.atomic():
        n = InboundEvent.objects.filter(
            id__in=list(event_ids),
            state__in=[InboundState.PROCESSED, InboundState.SKIPPED, InboundState.DEAD],
        ).update(state=InboundState.PENDING, next_attempt_at=now, attempt_count=0)
        audit(
            actor=actor,
            action="inbound.reprocess",
            target="inbound_event",
            count=n,
            ids=[str(i) for i in list(event_ids)[:100]],
        )
    return n
