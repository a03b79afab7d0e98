"""Events coming in, stored once: a verified request to the receive view
(``inbound_receive``) and a page of polled records (``inbound_store_many``). Each is
inserted with its processing job, and ``UNIQUE(source, event_id)`` turns a copy, even a
concurrent one, into a counted duplicate on the stored row. Processing is
``ingest.processing``'s."""

import hashlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db.models import F
from django.utils import timezone
from psycopg.types.json import Jsonb

from deliveries.jobs.ids import uuid7
from deliveries.prometheus import INBOUND_RECEIVED, INBOUND_SIGNATURE_FAILURES
from deliveries.signals import send_after_commit

from .models import InboundEvent, InboundState, Source
from .queries import INSERT_EVENT, INSERT_EVENTS, KIND
from .schemes import Request, UnparseableBody, VerificationFailed
from .signals import inbound_event_stored
from .sources import count_refusal, live_secrets, verifier_for

logger = logging.getLogger("ingest")

# Headers never stored with an event: credentials and signatures.
SECRET_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization", "x-api-key"})
SIGNATURE_WORDS = ("signature", "hmac", "token", "secret")


# --- A request to the receive view ------------------------------------------------------


@dataclass(frozen=True)
class Received:
    status: int
    event_id: uuid.UUID | None = None
    duplicate: bool = False


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
    scheme = verifier_for(source)
    try:
        scheme.verify(
            request,
            secrets=live_secrets(source, now),
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
    if INSERT_EVENT(params)[0] == 1:
        if state == InboundState.ENQUEUED:
            send_after_commit(inbound_event_stored, InboundEvent, [fields["id"]])
        return fields["id"], False
    stored = InboundEvent.objects.filter(source=source)
    found = stored.filter(event_id=event_id).values_list("id", flat=True).first()
    if found is None and body_sha256 is not None:
        found = stored.filter(body_sha256=body_sha256).values_list("id", flat=True).first()
    stored.filter(id=found).update(duplicates=F("duplicates") + 1, last_duplicate_at=now)
    return found, True


# --- Polled records --------------------------------------------------------------------


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
