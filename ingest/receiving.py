"""Events coming in, stored once: a verified request to the receive view
(``inbound_receive``), a message from a mail source (``email_receive``) and a page of
polled records (``inbound_store_many``). Each is
inserted with its processing job, and ``UNIQUE(source, event_id)`` turns a copy, even a
concurrent one, into a counted duplicate on the stored row. Processing is
``ingest.worker``'s."""

import hashlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.core.cache import cache
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from psycopg.types.json import Jsonb

from deliveries.core.ids import uuid7
from deliveries.core.prometheus import INBOUND_EMAILS, INBOUND_RECEIVED, INBOUND_SIGNATURE_FAILURES
from deliveries.core.signals import send_after_commit

from . import mail
from .conf import settings
from .models import InboundEmail, InboundEvent, InboundState, Source
from .schemes import MAX_EVENT_ID_LENGTH, MailPost, Request, UnparseableBody, VerificationFailed
from .signals import inbound_event_stored
from .sources import count_refusal, email_throttle, live_secrets, verifier_for
from .statements import INSERT_EVENT, INSERT_EVENTS, KIND

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
    sequenced=False,
    not_before=None,
) -> tuple[uuid.UUID, bool]:
    """Store the event (and, if it is to be processed now, its outbox row) unless the
    source has it already: the same ``event_id``, or the same ``body_sha256`` when given
    (the second key, for schemes that do not sign the id). A copy counts as a duplicate
    on the stored row. Returns the stored id and whether it was a duplicate.

    An event to be processed with ``not_before`` is stored ``pending`` until then, with
    no job: the scheduler admits it when it is due. ``sequenced`` (an email with an
    entity) runs only after its entity's earlier events (ingest.worker)."""
    if not_before is not None and state == InboundState.ENQUEUED:
        state = InboundState.PENDING
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
        "next_attempt_at": now if not_before is None else not_before,
        "last_error": error,
        "dispatch_count": 1 if state == InboundState.ENQUEUED else 0,
        "enqueued_at": now if state == InboundState.ENQUEUED else None,
        "sequenced": sequenced,
    }
    with_job = state == InboundState.ENQUEUED
    params = {**fields, "headers": Jsonb(fields["headers"]), "now": now, "with_job": with_job}
    if INSERT_EVENT(params)[0] == 1:
        if state != InboundState.REJECTED:
            send_after_commit(inbound_event_stored, InboundEvent, [fields["id"]])
        return fields["id"], False
    stored = InboundEvent.objects.filter(source=source)
    found = stored.filter(event_id=event_id).values_list("id", flat=True).first()
    if found is None and body_sha256 is not None:
        found = stored.filter(body_sha256=body_sha256).values_list("id", flat=True).first()
    stored.filter(id=found).update(duplicates=F("duplicates") + 1, last_duplicate_at=now)
    return found, True


# --- A message from a mail source -------------------------------------------------------


@dataclass(frozen=True)
class MailReceived:
    """What became of a message: ``accepted`` (stored for processing), ``duplicate``
    (every recipient's copy was stored already) or ``rejected`` (stored as evidence
    with ``reason``, never processed); the stored events' ids."""

    outcome: str
    event_ids: tuple[uuid.UUID, ...]
    reason: str = ""


@dataclass(frozen=True)
class MailPostReceived:
    """The receive view's answer to a mail provider's post: ``status`` 200 (``mail``
    says what became of the message), 400 (authentic, but no message in it), 401
    (not authentic) or 429 (a sender's or recipient's rate limit: the provider retries
    later)."""

    status: int
    mail: MailReceived | None = None


def email_post_receive(*, source: Source, request: Request) -> MailPostReceived:
    """Verify a provider's inbound-parse post for ``source`` (a mail scheme), then
    store its message with :func:`email_receive`. Verification comes first; a refusal
    creates nothing but a count."""
    scheme = verifier_for(source)
    try:
        scheme.verify(
            request,
            secrets=live_secrets(source, timezone.now()),
            now=time.time(),
            tolerance=source.replay_tolerance,
        )
    except VerificationFailed as exc:
        INBOUND_SIGNATURE_FAILURES.labels(source.slug, exc.reason).inc()
        count_refusal(source, exc.reason, remote=request.remote)
        return MailPostReceived(401)
    token = scheme.replay_key(request)
    # Remembered in the shared cache for longer than the replay window, once stored.
    seen = f"mail-token:{source.id}:{hashlib.sha256(token.encode()).hexdigest()}"
    if token and cache.get(seen):
        INBOUND_SIGNATURE_FAILURES.labels(source.slug, "replayed_token").inc()
        count_refusal(source, "replayed_token", remote=request.remote)
        return MailPostReceived(401)
    try:
        post = scheme.mail(request)
    except UnparseableBody as exc:
        count_refusal(source, f"unparseable_{exc.reason}", remote=request.remote)
        return MailPostReceived(400)
    for recipient in post.recipients or [""]:
        reason = email_throttle(source, sender=post.mail_from, recipient=recipient)
        if reason:
            count_refusal(source, reason, remote=request.remote)
            return MailPostReceived(429)
    received = email_receive(
        source=source,
        post=post,
        transport=scheme.name,
        remote=request.remote,
        tls=request.secure,
    )
    if token:
        cache.set(seen, 1, timeout=2 * source.replay_tolerance + 60)
    return MailPostReceived(200, received)


def email_limits() -> mail.Limits:
    return mail.Limits(
        max_parts=settings.INBOUND_EMAIL_MAX_PARTS,
        max_depth=settings.INBOUND_EMAIL_MAX_DEPTH,
        max_attachments=settings.INBOUND_EMAIL_MAX_ATTACHMENTS,
        max_attachment_bytes=settings.INBOUND_EMAIL_MAX_ATTACHMENT_BYTES,
    )


def email_receive(
    *,
    source: Source,
    post: MailPost,
    transport: str,
    remote: str = "",
    tls: bool = False,
    authenticated_as: str = "",
    evidence: dict | None = None,
) -> MailReceived:
    """Store a message from a mail source once per accepted recipient, in one transaction.

    The message is read with the ``email`` package and checked (``ingest.mail.inspect``):
    one that breaks a rule is stored ``rejected`` with its reason and no processing job.
    Otherwise each accepted recipient gets an inbound event (type: the recipient without
    its plus tag; entity: the tag, or the source's header pattern; time: the Date header,
    never later than now) and its processing job. The dedupe key is the Message-ID (the
    SHA-256 of the raw bytes without one) with the recipient: a copy sent again, even
    concurrently, is a counted duplicate. ``evidence`` is the SMTP listener's own DKIM
    verdict; a provider's come from its ``Authentication-Results`` and its post."""
    now = timezone.now()
    scheme = verifier_for(source)
    recipients = list(dict.fromkeys(mail.normalize(r) for r in post.recipients if r.strip()))
    accepted = [
        r
        for r in recipients
        if not scheme.addresses or mail.accepts(scheme.addresses, r, scheme.separator)
    ]
    reason, inspected = "", None
    try:
        for address in [post.mail_from, *recipients] if post.mail_from else recipients:
            if problem := mail.address_problem(address):
                # A provider posts the envelope as text: stored, it is escaped.
                accepted = [mail.clean(address)[:320]] if address in recipients else []
                raise mail.Rejected(problem, mail.clean(address)[:200])
        if not accepted:
            raise mail.Rejected("no_accepted_recipient", ", ".join(recipients)[:200])
        inspected = mail.inspect(post.raw, email_limits())
    except mail.Rejected as exc:
        reason = exc.reason
        accepted = accepted or [mail.clean(r)[:320] for r in recipients[:1]] or [""]
    if inspected is None:
        key = "rejected:sha256:" + hashlib.sha256(post.raw).hexdigest()
        authentication = {}
    else:
        key = mail.message_key(inspected.message_id, post.raw)
        if transport == InboundEmail.Transport.SMTP:
            # Authentication-Results inside mail that came straight to the listener were
            # written by whoever sent it: only the listener's own check counts.
            authentication = dict(evidence or {})
        else:
            authentication = {
                **post.verdicts,
                **mail.authentication_results(inspected.authentication_results, scheme.authserv_id),
            }
    # Verdicts are the provider's fields or the DKIM check's reading of the message: text
    # from outside, so cleaned like every other stored value (jsonb refuses NUL).
    authentication = {
        mail.clean(str(k))[:40]: mail.clean(str(v))[:200] for k, v in authentication.items()
    }
    occurred = min(inspected.sent_at, now) if inspected and inspected.sent_at else now
    # An email about an entity waits out the order window before it may run, so that one
    # dated earlier arriving a moment later runs first (docs/inbound.md, "Time and order").
    window = settings.INBOUND_EMAIL_ORDER_WINDOW
    settled = now + timedelta(seconds=window) if window > 0 else None
    stored, new = [], []
    with transaction.atomic():
        for recipient in accepted:
            base, _ = mail.split_plus(recipient, scheme.separator)
            entity = ""
            if inspected is not None:
                entity = mail.clean(
                    mail.entity_for(
                        recipient,
                        inspected.message,
                        separator=scheme.separator,
                        header=scheme.entity_header,
                        pattern=scheme.entity_pattern,
                    )
                )
            event, duplicate = _insert(
                source,
                event_id=_email_event_id(key, recipient),
                event_type=base,
                entity_id=entity,
                occurred_at=occurred,
                request=Request(headers={}, body=post.raw),
                now=now,
                state=InboundState.REJECTED if reason else InboundState.ENQUEUED,
                error=f"rejected: {reason}" if reason else "",
                sequenced=bool(entity) and not reason,
                not_before=settled if entity and not reason else None,
            )
            stored.append(event)
            if duplicate:
                continue
            new.append(event)
            InboundEmail.objects.create(
                event_id=event,
                transport=transport,
                message_id=inspected.message_id[:998] if inspected else "",
                mail_from=mail.clean(post.mail_from)[:320],
                recipient=recipient[:320],
                recipients=[r[:320] for r in accepted],
                from_address=inspected.from_address[:320] if inspected else "",
                to=list(inspected.to) if inspected else [],
                cc=list(inspected.cc) if inspected else [],
                subject=inspected.subject if inspected else "",
                sent_at=inspected.sent_at if inspected else None,
                size=len(post.raw),
                attachments=[
                    {"filename": a.filename, "content_type": a.content_type, "size": a.size}
                    for a in (inspected.attachments if inspected else ())
                ],
                authentication=authentication,
                remote_addr=mail.clean(remote)[:100],
                tls=tls,
                authenticated_as=mail.clean(authenticated_as)[:200],
                rejected_reason=reason,
                received_at=now,
            )
    outcome = "rejected" if reason else ("accepted" if new else "duplicate")
    INBOUND_EMAILS.labels(source.slug, "duplicate").inc(len(stored) - len(new))
    if reason:
        INBOUND_EMAILS.labels(source.slug, "rejected").inc(len(new))
        count_refusal(source, reason, remote=remote)
    else:
        INBOUND_EMAILS.labels(source.slug, "accepted").inc(len(new))
        INBOUND_RECEIVED.labels(source.slug, "false").inc(len(new))
        INBOUND_RECEIVED.labels(source.slug, "true").inc(len(stored) - len(new))
    logger.info(
        "inbound email",
        extra={
            "action": "ingest.email",
            "job_type": KIND,
            "source": source.slug,
            "transport": transport,
            "message_key": key[:200],
            "recipients": len(accepted),
            "inbound_ids": [str(i) for i in stored],
            "outcome": outcome,
            "reason": reason,
            "duration_ms": round((timezone.now() - now).total_seconds() * 1000, 1),
        },
    )
    return MailReceived(outcome, tuple(stored), reason)


def _email_event_id(key: str, recipient: str) -> str:
    """The dedupe key of one recipient's copy: the message's key and the recipient,
    hashed when longer than an event id may be (never truncated: two keys would merge)."""
    event_id = f"{key} {recipient}"
    if len(event_id) <= MAX_EVENT_ID_LENGTH:
        return event_id
    return "sha256:" + hashlib.sha256(event_id.encode("utf-8", "surrogateescape")).hexdigest()


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
