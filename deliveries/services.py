"""Writes: the functions that change the service's state, called by views, the admin,
commands and the application's own code. Delivery state changes themselves live in
``deliveries/state.py``; these functions compose them with validation and bookkeeping."""

import hashlib
import json
import secrets
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from . import state
from .models import ApiKey, Delivery, Endpoint, EndpointSecret, Event, Tenant
from .signing import generate_secret


class DomainError(Exception):
    """A request the service refuses, with a stable machine-readable code."""

    code = "invalid"
    status = 400

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code


class PayloadTooLarge(DomainError):
    code = "payload_too_large"
    status = 413


def encode_payload(payload: Any) -> bytes:
    """The body bytes sent on every attempt: compact JSON, fixed once at publish."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def publish_event(
    *,
    tenant: Tenant | uuid.UUID,
    event_type: str,
    payload: Any,
    entity_id: str = "",
    priority: int = 0,
    payload_version: int = 1,
    idempotency_key: str | None = None,
    deliver_at: datetime | None = None,
) -> Event:
    """Record an event and one pending delivery per subscribed, enabled endpoint.

    Call it inside the transaction that makes the business change the event describes
    (the transactional outbox): if that transaction rolls back, the event and its
    deliveries vanish with it; once it commits, the rows are the recovery record and the
    scheduler will find them however the process ends. Nothing is sent from here.

    ``priority``: higher is sent first when there is a backlog (a password email before
    a bulk export). ``deliver_at``: not before this time.
    """
    tenant_id = tenant.id if isinstance(tenant, Tenant) else tenant
    body = encode_payload(payload)
    if len(body) > settings.DELIVERY_MAX_PAYLOAD_BYTES:
        raise PayloadTooLarge(
            f"payload is {len(body)} bytes; the limit is {settings.DELIVERY_MAX_PAYLOAD_BYTES}"
        )
    if not event_type or len(event_type) > 200:
        raise DomainError("event_type must be 1 to 200 characters", code="invalid_event_type")
    now = timezone.now()
    with transaction.atomic():
        event = Event.objects.create(
            tenant_id=tenant_id,
            event_type=event_type,
            payload_version=payload_version,
            entity_id=entity_id,
            body=body,
            priority=priority,
            idempotency_key=idempotency_key,
        )
        endpoints = Endpoint.objects.filter(tenant_id=tenant_id, enabled=True).only(
            "id", "event_types"
        )
        Delivery.objects.bulk_create(
            [
                Delivery(
                    event=event,
                    endpoint_id=endpoint.id,
                    tenant_id=tenant_id,
                    priority=priority,
                    next_attempt_at=max(deliver_at or now, now),
                )
                for endpoint in endpoints
                if endpoint.subscribes_to(event_type)
            ]
        )
    return event


# --- Tenants and keys ----------------------------------------------------------------


API_KEY_PREFIX = "whk_"


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def api_key_create(*, tenant: Tenant, name: str = "") -> tuple[ApiKey, str]:
    """A new API key. The plain key is returned once and never stored."""
    key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = ApiKey.objects.create(
        tenant=tenant, name=name, prefix=key[:12], key_hash=hash_api_key(key)
    )
    return api_key, key


def tenant_create(*, name: str) -> tuple[Tenant, str]:
    with transaction.atomic():
        try:
            with transaction.atomic():
                tenant = Tenant.objects.create(name=name)
        except IntegrityError as exc:
            raise DomainError(f"a tenant named {name!r} exists already", code="exists") from exc
        _, key = api_key_create(tenant=tenant, name="default")
    return tenant, key


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
    secret = generate_secret()
    with transaction.atomic():
        endpoint = Endpoint.objects.create(
            tenant=tenant,
            url=url,
            event_types=list(event_types),
            description=description,
            **options,
        )
        EndpointSecret.objects.create(endpoint=endpoint, secret=secret)
    return endpoint, secret


def endpoint_rotate_secret(*, endpoint: Endpoint, overlap: timedelta = timedelta(hours=24)) -> str:
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
    return secret


def active_secrets(
    endpoint_ids: Iterable[uuid.UUID], *, now: datetime
) -> dict[uuid.UUID, list[str]]:
    """Signing secrets by endpoint, newest first, leaving out expired ones."""
    from django.db.models import Q

    found: dict[uuid.UUID, list[str]] = {}
    for endpoint_id, secret in (
        EndpointSecret.objects.filter(endpoint_id__in=list(endpoint_ids))
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("-created_at")
        .values_list("endpoint_id", "secret")
    ):
        found.setdefault(endpoint_id, []).append(secret)
    return found


def endpoint_enable(*, endpoint: Endpoint) -> bool:
    return bool(
        Endpoint.objects.filter(id=endpoint.id, enabled=False).update(
            enabled=True, disabled_reason="", disabled_at=None, failing_since=None
        )
    )


def endpoint_disable(*, endpoint: Endpoint, reason: str) -> bool:
    return state.endpoint_set_disabled(endpoint_id=endpoint.id, reason=reason, now=timezone.now())


# --- Deliveries ----------------------------------------------------------------------


def delivery_replay(*, delivery_ids: Iterable[uuid.UUID]) -> int:
    return state.replay(delivery_ids=delivery_ids, now=timezone.now())


def delivery_cancel(*, delivery_ids: Iterable[uuid.UUID]) -> int:
    return state.cancel(delivery_ids=delivery_ids, now=timezone.now())
