"""Who a portal request is: the tenant its session was opened for by a link, or nobody.

The portal session is a few keys in Django's session, apart from anything else the host
keeps there (its own login stays untouched and grants nothing here): the tenant's id and
when the session ends (PORTAL_SESSION_SECONDS after the link was opened). Every portal
view is wrapped by ``portal_view``, which also sets the headers every portal page
carries: the Content-Security-Policy (frame-ancestors from PORTAL_FRAME_ANCESTORS),
no caching, and CSRF protection on every form whatever the host's middleware is."""

import time
import uuid
from datetime import UTC
from functools import wraps
from urllib.parse import urlsplit

from django.http import Http404
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.clickjacking import xframe_options_exempt
from django.views.decorators.csrf import csrf_protect

from deliveries.core.conf import settings

from ..models import Tenant

SESSION_KEY = "trusty_portal"


def open_session(request, tenant_id: uuid.UUID) -> None:
    """Start a portal session for ``tenant_id`` (a new session key: no fixation)."""
    request.session.cycle_key()
    request.session[SESSION_KEY] = {
        "tenant": str(tenant_id),
        "until": time.time() + settings.PORTAL_SESSION_SECONDS,
    }


def close_session(request) -> None:
    request.session.pop(SESSION_KEY, None)
    request.session.cycle_key()


def session_tenant(request) -> Tenant | None:
    """The tenant of the request's live portal session, or None."""
    data = request.session.get(SESSION_KEY)
    if not isinstance(data, dict) or not isinstance(data.get("until"), int | float):
        return None
    if data["until"] < time.time():
        request.session.pop(SESSION_KEY, None)
        return None
    try:
        return Tenant.objects.filter(id=uuid.UUID(str(data.get("tenant")))).first()
    except ValueError:
        return None


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else ""


def content_security_policy() -> str:
    """The portal's CSP: its own scripts and styles only (no inline code, no CDN), the
    host's stylesheet and logo origins if set, and who may frame it."""
    styles = " ".join(filter(None, ["'self'", _origin(settings.PORTAL_CSS_URL)]))
    images = " ".join(filter(None, ["'self'", "data:", _origin(settings.PORTAL_LOGO_URL)]))
    ancestors = " ".join(settings.PORTAL_FRAME_ANCESTORS) or "'none'"
    return (
        "default-src 'none'; script-src 'self'; connect-src 'self'; "
        f"style-src {styles}; img-src {images}; form-action 'self'; base-uri 'none'; "
        f"frame-ancestors {ancestors}"
    )


def with_portal_headers(response):
    response["Content-Security-Policy"] = content_security_policy()
    response["Cache-Control"] = "no-store"
    response["Referrer-Policy"] = "same-origin"
    if not settings.PORTAL_FRAME_ANCESTORS:
        response["X-Frame-Options"] = "DENY"
    # Else the CSP's frame-ancestors rules: X-Frame-Options cannot name origins.
    return response


def page(request, template: str, context: dict | None = None, status: int = 200):
    """A portal page: ``template`` with the look (PORTAL_TITLE, PORTAL_LOGO_URL,
    PORTAL_CSS_URL) and the session's tenant in ``portal``. Rendered in UTC, as the pages
    label their times, whatever the host's TIME_ZONE."""
    portal = {
        "title": settings.PORTAL_TITLE,
        "logo_url": settings.PORTAL_LOGO_URL,
        "css_url": settings.PORTAL_CSS_URL,
        "tenant": getattr(request, "portal_tenant", None),
    }
    with timezone.override(UTC):
        return render(request, template, {"portal": portal, **(context or {})}, status=status)


def public_view(view):
    """A portal page anyone may open (the entry page, the stylesheets)."""

    @wraps(view)
    def wrapped(request, *args, **kwargs):
        return with_portal_headers(view(request, *args, **kwargs))

    return xframe_options_exempt(csrf_protect(wrapped))


def portal_view(view):
    """A page of the tenant's own: ``view(request, tenant, ...)``. Without a live portal
    session, the 'open it from a link' page (403)."""

    @wraps(view)
    def wrapped(request, *args, **kwargs):
        tenant = session_tenant(request)
        if tenant is None:
            response = page(request, "deliveries/portal/signed_out.html", status=403)
        else:
            request.portal_tenant = tenant
            try:
                response = view(request, tenant, *args, **kwargs)
            except Http404:
                response = page(request, "deliveries/portal/not_found.html", status=404)
        return with_portal_headers(response)

    return xframe_options_exempt(csrf_protect(wrapped))


def object_id(value: str) -> uuid.UUID:
    """A URL's object id, or the portal's 404: a malformed id is no different from an
    unknown one, or another tenant's."""
    try:
        return uuid.UUID(value)
    except ValueError:
        raise Http404 from None
