"""Portal links: a random token (``whp_`` + 256 bits) of which only a SHA-256 is stored,
valid once and for a few minutes, that starts a portal session for one tenant.

The token travels in the link's fragment (``…/portal/enter/#whp_…``), which a browser
never sends to a server: it appears in no access log, proxy log or Referer. The entry
page's script posts it to the portal (with the CSRF token), which redeems it."""

import hashlib
import secrets
import uuid
from datetime import datetime, timedelta

from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from deliveries.core.conf import settings

from ..models import PortalLink, Tenant
from ..services import DomainError

TOKEN_PREFIX = "whp_"  # noqa: S105 (a prefix, as deliveries.core.text masks it)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def link_ttl(ttl: int | float | None) -> timedelta:
    """``ttl`` seconds (PORTAL_LINK_TTL when None), at least 1 and at most
    PORTAL_LINK_MAX_TTL, else DomainError."""
    seconds = settings.PORTAL_LINK_TTL if ttl is None else ttl
    if not 1 <= seconds <= settings.PORTAL_LINK_MAX_TTL:
        raise DomainError(
            f"ttl must be 1 to {settings.PORTAL_LINK_MAX_TTL} seconds", code="invalid_ttl"
        )
    return timedelta(seconds=seconds)


def portal_link_create(
    *, tenant: Tenant | uuid.UUID, ttl: int | float | None = None, via: str = "python"
) -> tuple[PortalLink, str]:
    """A new link for ``tenant``; the token is returned once and never stored."""
    expires = timezone.now() + link_ttl(ttl)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    tenant_id = tenant.id if isinstance(tenant, Tenant) else tenant
    link = PortalLink.objects.create(
        tenant_id=tenant_id, token_hash=_hash(token), expires_at=expires, via=via[:100]
    )
    return link, token


def enter_path(token: str) -> str:
    """The portal's entry page with ``token`` in the fragment."""
    return f"{reverse('trusty_portal:enter')}#{token}"


def portal_url(
    tenant: Tenant | uuid.UUID, *, ttl: int | float | None = None, base_url: str | None = None
) -> str:
    """A short-lived, single-use link that opens ``tenant``'s portal, valid for ``ttl``
    seconds (PORTAL_LINK_TTL). Absolute under ``base_url`` (PORTAL_BASE_URL, the
    service's public address, as ``https://webhooks.example.com``); without one, the
    path alone, for the host to put under its own address."""
    _, token = portal_link_create(tenant=tenant, ttl=ttl)
    base = (settings.PORTAL_BASE_URL if base_url is None else base_url).rstrip("/")
    return base + enter_path(token)


def portal_link_redeem(*, token: str, now: datetime | None = None) -> uuid.UUID | None:
    """The tenant of an unused, unexpired link with this token, marking it used (a
    guarded UPDATE: of two concurrent openings, one wins); None for any other token."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 100:
        return None
    now = now or timezone.now()
    with transaction.atomic():
        link = (
            PortalLink.objects.filter(token_hash=_hash(token), used_at__isnull=True)
            .filter(expires_at__gt=now)
            .values_list("id", "tenant_id")
            .first()
        )
        if link is None:
            return None
        if not PortalLink.objects.filter(id=link[0], used_at__isnull=True).update(used_at=now):
            return None
    return link[1]
