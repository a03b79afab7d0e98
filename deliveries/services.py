"""Writes: the functions that change the service's state, called by views, the admin,
commands and the application's own code. Delivery state changes themselves live in
``deliveries/state.py``; these functions compose them with validation and bookkeeping."""

import contextlib
import hashlib
import json
import logging
import secrets
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.core.validators import validate_email
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from deliveries.core.conf import settings

from . import catalogue, schemas, state
from .core import encryption, tracing
from .core.egress import validate_endpoint_url
from .core.headers import validate_endpoint_headers
from .core.ids import uuid7
from .core.prometheus import EVENT_SCHEMA_MISMATCHES
from .core.timezones import validate_time_zone
from .models import (
    ApiKey,
    AuditEntry,
    Delivery,
    EgressAllowance,
    Endpoint,
    EndpointSecret,
    Event,
    SchemaValidation,
    Tenant,
)
from .selectors import egress_policy_for
from .signing import generate_secret
from .statements import publish

logger = logging.getLogger("deliveries.services")


class DomainError(Exception):
    """A request the service refuses, with a stable machine-readable code."""

    code = "invalid"
    status = 400

    def __init__(self, message: str, *, code: str | None = None, details=None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        if code:
            self.code = code


class PayloadTooLarge(DomainError):
    code = "payload_too_large"
    status = 413


class PayloadInvalid(DomainError):
    """The payload does not match its type's schema, whose mode is ``reject``."""

    code = "payload_invalid"
    status = 422


def check_payload(*, event_type: str, payload_version: int, payload: Any) -> None:
    """The catalogue's verdict on a payload (deliveries.catalogue): ``reject`` raises
    PayloadInvalid naming the failing JSON path; ``warn`` logs and counts it (the path and
    the failing keyword, never the value) and lets it through."""
    problem = schemas.schema_problem(event_type, payload_version, payload)
    if problem is None:
        return
    EVENT_SCHEMA_MISMATCHES.labels(event_type, problem.mode).inc()
    if problem.mode == SchemaValidation.REJECT:
        raise PayloadInvalid(
            problem.sentence(),
            details={
                "path": problem.path,
                "schema_path": problem.schema_path,
                "event_type": event_type,
                "payload_version": payload_version,
            },
        )
    logger.warning(
        "payload does not match its schema",
        extra={
            "action": "event.schema_mismatch",
            "event_type": event_type,
            "payload_version": payload_version,
            "path": problem.path,
            "reason": problem.reason,
        },
    )


def encode_payload(payload: Any) -> bytes:
    """The body bytes sent on every attempt: compact JSON, fixed once at publish.

    Django's JSON encoder, so that what a model gives (a ``Decimal`` amount, a
    ``datetime``, a ``UUID``) is written as Django writes it (a string; ISO 8601 for
    times). ``NaN`` and infinities are refused (``ValueError``): no JSON parser reads them.
    """
    return json.dumps(
        payload, cls=DjangoJSONEncoder, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def publish_event(
    *,
    tenant: Tenant | uuid.UUID,
    event_type: str,
    payload: Any,
    entity_id: str = "",
    priority: int = 0,
    payload_version: int = 1,
    idempotency_key: str | None = None,
    request_hash: str = "",
    deliver_at: datetime | None = None,
    endpoint_ids: Iterable[uuid.UUID] | None = None,
) -> Event:
    """Record an event and one pending delivery per subscribed, enabled endpoint.

    Call it inside the transaction that makes the business change the event describes
    (the transactional outbox): if that transaction rolls back, the event and its
    deliveries vanish with it; once it commits, the rows are the recovery record and the
    scheduler will find them however the process ends. Nothing is sent from here.

    ``priority``: higher is sent first when there is a backlog (a password email before
    a bulk export). ``deliver_at``: an aware datetime; the deliveries are not admitted
    before it (a past time means now). For "09:00 in the tenant's time zone" pass
    ``deliveries.core.timezones.next_local_time(tenant.time_zone, time(9))``. ``endpoint_ids``:
    exactly these of the tenant's enabled endpoints, whatever their event-type filters (a
    test event).
    """
    tenant_id = tenant.id if isinstance(tenant, Tenant) else tenant
    body = encode_payload(payload)
    if len(body) > settings.DELIVERY_MAX_PAYLOAD_BYTES:
        raise PayloadTooLarge(
            f"payload is {len(body)} bytes; the limit is {settings.DELIVERY_MAX_PAYLOAD_BYTES}"
        )
    if problem := catalogue.event_type_problem(event_type):
        raise DomainError(problem, code="invalid_event_type")
    check_payload(event_type=event_type, payload_version=payload_version, payload=payload)
    if deliver_at is not None and timezone.is_naive(deliver_at):
        raise DomainError(
            "deliver_at needs a time zone (an aware datetime); the service runs on UTC",
            code="invalid_deliver_at",
        )
    now = timezone.now()
    span = (
        tracing.start_span("webhooks.publish", event_type=event_type, tenant_id=str(tenant_id))
        if tracing.enabled()
        else None
    )
    fields = {
        "tenant_id": tenant_id,
        "event_type": event_type,
        "payload_version": payload_version,
        "entity_id": entity_id,
        "body": body,
        "priority": priority,
        "idempotency_key": idempotency_key,
        "request_hash": request_hash,
        "trace_context": tracing.traceparent_of(span) if span is not None else "",
    }
    due = max(deliver_at or now, now)
    only = None if endpoint_ids is None else list(endpoint_ids)
    # Inside the caller's transaction no savepoint is needed: nothing here can fail in a
    # way the caller could recover from and go on, except a reused idempotency key.
    with (
        tracing.use_span(span) if span is not None else contextlib.nullcontext(),
        transaction.atomic(savepoint=idempotency_key is not None),
    ):
        event = Event(id=uuid7(), created_at=now, **fields)
        publish.PUBLISH(
            {
                **fields,
                "id": event.id,
                "now": now,
                "due": due,
                "only": only,
                "patterns": catalogue.filter_patterns(event_type),
            }
        )
        event._state.adding = False
        event._state.db = connection.alias
        if span is not None:
            span.set_attribute("webhooks.event_id", str(event.id))
    return event


class IdempotencyInProgress(DomainError):
    code = "idempotency_key_in_use"
    status = 409


class IdempotencyMismatch(DomainError):
    code = "idempotency_key_reused"
    status = 422


def event_publish_idempotent(
    *, tenant: Tenant, idempotency_key: str, request_hash: str, **fields: Any
) -> tuple[Event, bool]:
    """``publish_event`` under an ``Idempotency-Key`` (Stripe's semantics). Returns the
    event and whether it is a replay of an earlier request.

    The same key and request give back the event the first request created, and create
    nothing; the same key with another request is refused (422); a request arriving
    while another with the same key is still running is refused (409), which a
    transaction-scoped advisory lock detects on PostgreSQL. Keys are per tenant.
    """
    with transaction.atomic():
        if not publish.TAKE_IDEMPOTENCY_LOCK([str(tenant.id), idempotency_key])[0]:
            raise IdempotencyInProgress(
                "A request with this Idempotency-Key is in progress; retry later."
            )
        existing = Event.objects.filter(tenant=tenant, idempotency_key=idempotency_key).first()
        if existing is not None:
            if existing.request_hash != request_hash:
                raise IdempotencyMismatch("This Idempotency-Key was used with a different request.")
            return existing, True
        event = publish_event(
            tenant=tenant, idempotency_key=idempotency_key, request_hash=request_hash, **fields
        )
    return event, False


def request_fingerprint(data: Any) -> str:
    return hashlib.sha256(
        json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()
    ).hexdigest()


# --- Tenants and keys ----------------------------------------------------------------


API_KEY_PREFIX = "whk_"


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def api_key_create(
    *, tenant: Tenant, name: str = "", expires_at: datetime | None = None, actor=None
) -> tuple[ApiKey, str]:
    """A new API key, valid until ``expires_at`` (None: until revoked). The plain key is
    returned once and never stored."""
    key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        api_key = ApiKey.objects.create(
            tenant=tenant,
            name=name,
            prefix=key[:12],
            key_hash=hash_api_key(key),
            expires_at=expires_at,
        )
        if actor is not None:
            audit(
                actor=actor,
                action="api_key.create",
                target="api_key",
                count=1,
                tenant=str(tenant.id),
                prefix=api_key.prefix,
            )
    return api_key, key


def api_keys_revoke(*, key_ids: Iterable[int], actor=None) -> int:
    with transaction.atomic():
        n = ApiKey.objects.filter(id__in=list(key_ids), revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        audit(actor=actor, action="api_key.revoke", target="api_key", count=n)
    return n


def api_key_set_expiry(*, key_id: int, expires_at: datetime | None, actor=None) -> int:
    """Set (or clear, with None) when a key stops working; audited. Returns rows changed."""
    with transaction.atomic():
        n = ApiKey.objects.filter(id=key_id).update(expires_at=expires_at)
        audit(
            actor=actor,
            action="api_key.set_expiry",
            target="api_key",
            count=n,
            key_id=key_id,
            expires_at=expires_at.isoformat() if expires_at else None,
        )
    return n


def _check_time_zone(time_zone: str) -> None:
    try:
        validate_time_zone(time_zone)
    except ValidationError as exc:
        raise DomainError(exc.messages[0], code="invalid_time_zone") from exc


def tenant_create(*, name: str, time_zone: str = "UTC") -> tuple[Tenant, str]:
    _check_time_zone(time_zone)
    with transaction.atomic():
        try:
            with transaction.atomic():
                tenant = Tenant.objects.create(name=name, time_zone=time_zone)
        except IntegrityError as exc:
            raise DomainError(f"a tenant named {name!r} exists already", code="exists") from exc
        _, key = api_key_create(tenant=tenant, name="default")
    return tenant, key


def tenant_get_or_create(
    *, external_id: str, name: str = "", time_zone: str = "UTC"
) -> tuple[Tenant, bool]:
    """The tenant for the host's account ``external_id``, made on first use (named
    ``name``, or the id itself) without an API key: a host that publishes in process
    needs none, and ``api_key_create`` makes one for its customer's REST calls. Returns
    (tenant, created); safe under concurrency: two first calls make one tenant."""
    external_id = external_id.strip()
    if not external_id:
        raise DomainError("external_id must not be blank", code="invalid_external_id")
    if found := Tenant.objects.filter(external_id=external_id).first():
        return found, False
    _check_time_zone(time_zone)
    try:
        with transaction.atomic():
            return Tenant.objects.create(
                external_id=external_id, name=name or external_id, time_zone=time_zone
            ), True
    except IntegrityError as exc:
        if found := Tenant.objects.filter(external_id=external_id).first():
            return found, False  # a concurrent first call made it
        raise DomainError(
            f"a tenant named {name or external_id!r} exists already", code="exists"
        ) from exc


def tenant_set_notification_email(*, tenant: Tenant, email: str, actor=None, via: str = "") -> None:
    """Where the tenant is told about its endpoints (deliveries.alerts); "" for nowhere."""
    email = email.strip()
    if email:
        try:
            validate_email(email)
        except ValidationError as exc:
            raise DomainError(f"notification_email: {exc.messages[0]}") from exc
    with transaction.atomic():
        Tenant.objects.filter(id=tenant.id).update(notification_email=email)
        audit(
            actor=actor,
            action="tenant.notification_email",
            target="tenant",
            count=1,
            tenant=str(tenant.id),
            via=via,
        )
    tenant.notification_email = email


# --- Endpoints -----------------------------------------------------------------------


def endpoint_create(
    *,
    tenant: Tenant,
    url: str,
    event_types: Iterable[str] = (),
    description: str = "",
    **options: Any,
) -> tuple[Endpoint, str]:
    """A new endpoint and its first signing secret (returned so it can be shown once)."""
    event_types = list(event_types)
    _check_endpoint_fields({"url": url, "event_types": event_types, **options}, tenant_id=tenant.id)
    secret = generate_secret()
    with transaction.atomic():
        endpoint = Endpoint.objects.create(
            tenant=tenant,
            url=url,
            event_types=event_types,
            description=description,
            **options,
        )
        EndpointSecret.objects.create(endpoint=endpoint, secret=secret)
    return endpoint, secret


def _check_endpoint_fields(
    fields: dict[str, Any], *, tenant_id: uuid.UUID, endpoint_id: uuid.UUID | None = None
) -> None:
    """The model's own rules (Endpoint.clean), for a caller that comes through no form or
    serializer (host code, a command): QuerySet.update() and create() run no validators,
    so the services run them."""
    checks = {
        "url": lambda url: validate_endpoint_url(
            url, egress_policy_for(tenant_id=tenant_id, endpoint_id=endpoint_id)
        ),
        "headers": validate_endpoint_headers,
        "event_types": catalogue.validate_event_type_filter,
        "rate_limit": lambda rate: _at_most(rate, settings.DELIVERY_ENDPOINT_RATE_CEILING),
        "max_concurrency": lambda n: _at_most(n, settings.DELIVERY_ENDPOINT_CONCURRENCY_CEILING),
    }
    for name, check in checks.items():
        if name not in fields:
            continue
        try:
            check(fields[name])
        except ValidationError as exc:
            raise DomainError(f"{name}: {' '.join(exc.messages)}") from exc


def _at_most(value, ceiling) -> None:
    """The operator's ceiling on what an endpoint may ask for."""
    if value is not None and value > ceiling:
        raise ValidationError(f"at most {ceiling:g}, the service's ceiling")


def endpoint_rotate_secret(
    *, endpoint: Endpoint, overlap: timedelta = timedelta(hours=24), actor=None, via: str = ""
) -> str:
    """Add a new secret; the current ones keep signing for ``overlap`` so receivers can
    switch without dropping a message. Returns the new secret."""
    now = timezone.now()
    secret = generate_secret()
    with transaction.atomic():
        EndpointSecret.objects.filter(endpoint=endpoint, expires_at__isnull=True).update(
            expires_at=now + overlap
        )
        EndpointSecret.objects.filter(endpoint=endpoint, expires_at__lte=now).delete()
        EndpointSecret.objects.create(endpoint=endpoint, secret=secret)
        audit(
            actor=actor,
            action="endpoint.rotate_secret",
            target="endpoint",
            count=1,
            endpoint=str(endpoint.id),
            via=via,
        )
    return secret


TEST_EVENT_TYPE = "webhook.test"


def endpoint_send_test(*, endpoint: Endpoint) -> Event:
    """Publish a ``webhook.test`` event to this endpoint alone, whatever its filter."""
    return publish_event(
        tenant=endpoint.tenant_id,
        event_type=TEST_EVENT_TYPE,
        payload={"message": "test event", "endpoint_id": str(endpoint.id)},
        endpoint_ids=[endpoint.id],
    )


def active_secrets(
    endpoint_ids: Iterable[uuid.UUID], *, now: datetime
) -> dict[uuid.UUID, list[str]]:
    """Signing secrets by endpoint, newest first, leaving out expired ones (and, logged,
    any that no configured key decrypts: deliveries.core.encryption.reveal_or_skip).

    Workers ask for every batch they lease: one statement (publish.ACTIVE_SECRETS)."""
    found: dict[uuid.UUID, list[str]] = {}
    for secret_id, endpoint_id, token, legacy in publish.ACTIVE_SECRETS([list(endpoint_ids), now]):
        secret = encryption.reveal_or_skip(token, legacy, row=f"endpoint secret {secret_id}")
        if secret is not None:
            found.setdefault(endpoint_id, []).append(secret)
    return found


ENDPOINT_UPDATABLE = frozenset(
    {
        "url",
        "description",
        "event_types",
        "enabled",
        "rate_limit",
        "max_concurrency",
        "timeout",
        "headers",
        "retry_client_errors",
    }
)


def endpoint_update(*, endpoint: Endpoint, **changes: Any) -> Endpoint:
    """Change an endpoint's settings. Enabling or disabling goes through the guarded
    transitions so the reason and the failure clock are kept right."""
    unknown = set(changes) - ENDPOINT_UPDATABLE
    if unknown:
        raise DomainError(f"cannot change {sorted(unknown)}")
    _check_endpoint_fields(changes, tenant_id=endpoint.tenant_id, endpoint_id=endpoint.id)
    enabled = changes.pop("enabled", None)
    with transaction.atomic():
        if changes:
            Endpoint.objects.filter(id=endpoint.id).update(**changes, updated_at=timezone.now())
        if enabled is True:
            endpoint_enable(endpoint=endpoint)
        elif enabled is False:
            endpoint_disable(endpoint=endpoint, reason="disabled by the tenant")
    endpoint.refresh_from_db()
    return endpoint


def endpoint_enable(*, endpoint: Endpoint, actor=None, via: str = "") -> bool:
    with transaction.atomic():
        changed = bool(
            Endpoint.objects.filter(id=endpoint.id, enabled=False).update(
                enabled=True, disabled_reason="", disabled_at=None, failing_since=None
            )
        )
        if changed:
            audit(
                actor=actor,
                action="endpoint.enable",
                target="endpoint",
                count=1,
                endpoint=str(endpoint.id),
                via=via,
            )
    return changed


def endpoint_disable(*, endpoint: Endpoint, reason: str, actor=None) -> bool:
    with transaction.atomic():
        changed = state.endpoint_set_disabled(
            endpoint_id=endpoint.id, reason=reason, now=timezone.now()
        )
        if changed:
            audit(
                actor=actor,
                action="endpoint.disable",
                target="endpoint",
                count=1,
                endpoint=str(endpoint.id),
                reason=reason,
            )
    return changed


def endpoint_pause(*, endpoint: Endpoint, actor=None, reason: str = "", via: str = "api") -> bool:
    """Hold an endpoint's deliveries: they stay pending, neither sent nor dead-lettered,
    and events published meanwhile still get theirs, until ``endpoint_resume``. A
    delivery already mid-request finishes (deliveries.state.endpoint_set_paused). Audited
    in the same transaction; returns False (and writes nothing) if it was paused
    already. ``via``: where the request came from (``admin``, ``api key 12``)."""
    with transaction.atomic():
        changed = state.endpoint_set_paused(
            endpoint_id=endpoint.id, reason=reason, now=timezone.now()
        )
        if changed:
            audit(
                actor=actor,
                action="endpoint.pause",
                target="endpoint",
                count=1,
                endpoint=str(endpoint.id),
                reason=reason[:200],
                via=via,
            )
    return changed


def endpoint_resume(*, endpoint: Endpoint, actor=None, via: str = "api") -> bool:
    """Let a paused endpoint's held deliveries flow again: each is due at its own next
    attempt time (the held ones at once). Audited in the same transaction; returns False
    (and writes nothing) if it was not paused."""
    with transaction.atomic():
        changed = state.endpoint_set_resumed(endpoint_id=endpoint.id, now=timezone.now())
        if changed:
            audit(
                actor=actor,
                action="endpoint.resume",
                target="endpoint",
                count=1,
                endpoint=str(endpoint.id),
                via=via,
            )
    return changed


# --- Deliveries ----------------------------------------------------------------------


# --- Egress allowances ---------------------------------------------------------------


def egress_allowance_save(*, allowance: EgressAllowance, actor=None) -> EgressAllowance:
    """Open a network for a tenant (or one of its endpoints), or change one, audited.
    Validated here whoever calls (ValidationError): a CIDR, and an endpoint of that
    tenant."""
    allowance.full_clean()
    creating = allowance.pk is None
    if creating and getattr(actor, "is_authenticated", False):
        allowance.created_by = actor
    with transaction.atomic():
        allowance.save()
        audit(
            actor=actor,
            action="egress_allowance.create" if creating else "egress_allowance.change",
            target="egress_allowance",
            count=1,
            allowance=allowance.pk,
            tenant=str(allowance.tenant_id),
            endpoint=str(allowance.endpoint_id) if allowance.endpoint_id else None,
            network=allowance.network,
        )
    return allowance


def egress_allowances_delete(*, allowance_ids: Iterable[int], actor=None) -> int:
    """Close networks again, audited with what each one was."""
    with transaction.atomic():
        rows = list(
            EgressAllowance.objects.filter(pk__in=list(allowance_ids)).values(
                "id", "tenant_id", "endpoint_id", "network"
            )
        )
        EgressAllowance.objects.filter(pk__in=[row["id"] for row in rows]).delete()
        audit(
            actor=actor,
            action="egress_allowance.delete",
            target="egress_allowance",
            count=len(rows),
            allowances=[
                {
                    "id": row["id"],
                    "tenant": str(row["tenant_id"]),
                    "endpoint": str(row["endpoint_id"]) if row["endpoint_id"] else None,
                    "network": row["network"],
                }
                for row in rows
            ],
        )
    return len(rows)


def audit(*, actor, action: str, target: str, count: int, **details: Any) -> AuditEntry:
    """An audit row; call it inside the transaction that makes the change."""
    return AuditEntry.objects.create(
        actor=actor if getattr(actor, "is_authenticated", False) else None,
        action=action,
        target=target,
        count=count,
        details=details,
    )


def _audited(transition, action: str, delivery_ids, actor, via: str) -> int:
    """Apply a state transition to deliveries and write its audit row, atomically."""
    ids = list(delivery_ids)
    with transaction.atomic():
        count = transition(delivery_ids=ids, now=timezone.now())
        audit(
            actor=actor,
            action=action,
            target="delivery",
            count=count,
            via=via,
            ids=[str(i) for i in ids[:100]],
        )
    return count


def delivery_replay(*, delivery_ids: Iterable[uuid.UUID], actor=None, via: str = "api") -> int:
    """Send deliveries again with the same identity; audited."""
    return _audited(state.replay, "delivery.replay", delivery_ids, actor, via)


def delivery_cancel(*, delivery_ids: Iterable[uuid.UUID], actor=None, via: str = "api") -> int:
    """Stop deliveries not yet sent; audited."""
    return _audited(state.cancel, "delivery.cancel", delivery_ids, actor, via)


RECOVER_MAX_AGE = timedelta(days=14)
RECOVER_MAX_ROWS = 10_000


def deliveries_recover(
    *, tenant: Tenant, since: datetime, endpoint_id: uuid.UUID | None = None
) -> int:
    """Replay a tenant's dead deliveries that died since ``since`` (at most 14 days back,
    at most 10,000 at a time; call again for more)."""
    now = timezone.now()
    if since < now - RECOVER_MAX_AGE:
        raise DomainError("since must be within the last 14 days", code="since_too_old")
    dead = Delivery.objects.filter(tenant=tenant, state=state.DEAD, finished_at__gte=since)
    if endpoint_id is not None:
        dead = dead.filter(endpoint_id=endpoint_id)
    ids = list(dead.order_by("finished_at").values_list("id", flat=True)[:RECOVER_MAX_ROWS])
    return delivery_replay(delivery_ids=ids, via=f"recover since {since.isoformat()}")
