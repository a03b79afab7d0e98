"""Bearer API keys: one tenant per key, keys stored as SHA-256 hashes."""

from dataclasses import dataclass

from django.db.models import Q
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions, permissions, throttling

from deliveries.core import ratelimit

from ..core.conf import settings
from ..models import ApiKey, Tenant
from ..services import hash_api_key


@dataclass(frozen=True)
class TenantPrincipal:
    """``request.user`` for API calls: the tenant a key belongs to."""

    tenant: Tenant
    api_key_id: int
    is_authenticated: bool = True

    @property
    def pk(self) -> int:
        return self.api_key_id


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, key = header.partition(" ")
        if scheme != self.keyword or not key.strip():
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <api key>'.")
        api_key = (
            ApiKey.objects.select_related("tenant")
            .filter(key_hash=hash_api_key(key.strip()), revoked_at__isnull=True)
            .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))
            .first()
        )
        if api_key is None:
            # One answer for unknown, revoked, expired and malformed keys: nothing to probe.
            raise exceptions.AuthenticationFailed("Invalid API key.")
        return TenantPrincipal(tenant=api_key.tenant, api_key_id=api_key.id), api_key

    def authenticate_header(self, request):
        return self.keyword


class IsTenant(permissions.BasePermission):
    def has_permission(self, request, view):
        return isinstance(request.user, TenantPrincipal)


class ApiKeyThrottle(throttling.SimpleRateThrottle):
    """Requests per API key (``API_THROTTLE_RATE``), answered 429 with Retry-After.

    Counted in fixed windows in the shared cache (deliveries/core/ratelimit.py), so the rate holds
    for the key across every web process and host. DRF's own throttle keeps a list of
    request times per key and writes it back, which loses concurrent requests."""

    scope = "api_key"

    def get_rate(self):
        # The product's own setting, not the host's DEFAULT_THROTTLE_RATES.
        return settings.API_THROTTLE_RATE

    def get_cache_key(self, request, view):
        if isinstance(request.user, TenantPrincipal):
            return self.cache_format % {"scope": self.scope, "ident": request.user.api_key_id}
        return None

    def allow_request(self, request, view):
        self._wait = None
        if self.rate is None:
            return True
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        hits, window_left = ratelimit.hit(key, window=self.duration)
        if hits <= self.num_requests:
            return True
        self._wait = window_left
        return False

    def wait(self):
        return self._wait


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyAuthentication
    name = "ApiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer"}
