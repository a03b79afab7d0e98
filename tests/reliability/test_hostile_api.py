"""API abuse: the tenant-isolation sweep, and every kind of bad key getting one answer.

The sweep itself lives in ``tests/deliveries/test_api.py`` (every object route from the
URL resolver, four methods, another tenant's id against a random one; every list under
every filter and cursor). It is imported here, not copied, so that it runs as part of
this suite too and any route added later is swept in both places.

Bad keys: unknown, revoked, expired and malformed credentials must each get the same 401
with the one JSON error shape, the same ``WWW-Authenticate``, and nothing of any tenant.
"""

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from deliveries import services
from deliveries.models import ApiKey, AuditEntry
from tests.deliveries.test_api import (  # noqa: F401 (fixtures and the sweep, collected here)
    alice,
    bob,
    client_for,
    test_another_tenants_id_is_404_exactly_like_a_random_id,
    test_lists_never_show_another_tenants_rows,
    test_the_route_list_covers_every_object_route,
)

pytestmark = pytest.mark.django_db

UNAUTHORIZED = {"error": {"code": "authentication_failed", "message": "Invalid API key."}}


def answer(header: str | None, path: str = "/api/v1/endpoints/"):
    client = APIClient()
    if header is not None:
        client.credentials(HTTP_AUTHORIZATION=header)
    return client.get(path)


@pytest.fixture
def victim():
    """A tenant with data worth leaking and a key that works."""
    client, tenant, key = client_for("victim-corp")
    created = client.post(
        "/api/v1/endpoints/", {"url": "https://victim.example/hook"}, format="json"
    ).json()
    services.publish_event(tenant=tenant, event_type="victim.secret", payload={"n": 1})
    return tenant, key, created


def assert_refused_without_tenant_data(response, tenant, created) -> None:
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
    assert response["Content-Type"].startswith("application/json")
    assert response.json() == UNAUTHORIZED
    text = response.content.decode()
    for leak in (tenant.name, str(tenant.id), created["id"], created["secret"], "victim"):
        assert leak not in text


def test_an_expired_key_gets_the_same_401_as_an_unknown_one(victim):
    tenant, key, created = victim
    assert answer(f"Bearer {key}").status_code == 200
    ApiKey.objects.filter(tenant=tenant).update(expires_at=timezone.now() - timedelta(seconds=1))

    for path in ("/api/v1/endpoints/", "/api/v1/events/", f"/api/v1/endpoints/{created['id']}/"):
        response = answer(f"Bearer {key}", path)
        assert_refused_without_tenant_data(response, tenant, created)
        assert response.json() == answer("Bearer whk_unknown", path).json()


def test_a_key_with_a_future_expiry_works_until_then(victim):
    tenant, _key, _created = victim
    _api_key, key = services.api_key_create(
        tenant=tenant, name="ci", expires_at=timezone.now() + timedelta(minutes=5)
    )

    assert answer(f"Bearer {key}").status_code == 200
    ApiKey.objects.filter(prefix=key[:12]).update(expires_at=timezone.now())
    assert answer(f"Bearer {key}").status_code == 401


def test_a_revoked_key_gets_the_same_401_and_no_tenant_data(victim):
    tenant, key, created = victim
    services.api_keys_revoke(
        key_ids=ApiKey.objects.filter(tenant=tenant).values_list("id", flat=True)
    )

    response = answer(f"Bearer {key}")

    assert_refused_without_tenant_data(response, tenant, created)


def test_a_revoked_key_with_a_future_expiry_stays_revoked(victim):
    tenant, key, created = victim
    ApiKey.objects.filter(tenant=tenant).update(
        revoked_at=timezone.now(), expires_at=timezone.now() + timedelta(days=1)
    )

    assert_refused_without_tenant_data(answer(f"Bearer {key}"), tenant, created)


MALFORMED = [
    "Bearer whk_" + "A" * 10_000,  # long, but under any server's header limit
    "Bearer {key}x",  # one character more
    "Bearer {key_upper}",  # another case
    "Bearer {key_prefix}",  # the visible prefix alone
    "Bearer {key} {key}",
    "Bearer\t{key}",
    "Bearer ' OR '1'='1",
    "Bearer whk_\x00",
    "Bearer whk_\xe9\xff",  # Latin-1 bytes, as a WSGI server hands them over
    "Bearer %77%68%6b%5f",
    "Bearer {hash}",  # the stored hash instead of the key
    "Bearer=",
    ",Bearer {key}",
]


@pytest.mark.parametrize("template", MALFORMED)
def test_malformed_credentials_get_the_one_401_shape_and_no_tenant_data(template, victim):
    tenant, key, created = victim
    header = template.format(
        key=key,
        key_upper=key.upper(),
        key_prefix=key[:12],
        hash=services.hash_api_key(key),
    )

    response = answer(header)

    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
    assert set(response.json()) == {"error"}
    assert set(response.json()["error"]) == {"code", "message"}
    text = response.content.decode()
    for leak in (tenant.name, str(tenant.id), created["id"], created["secret"]):
        assert leak not in text


def test_an_expiry_set_in_the_admin_is_audited_and_takes_effect(victim):
    tenant, key, _created = victim
    staff = User.objects.create_superuser("ops", "ops@example.com", "pw")
    browser = Client()
    browser.force_login(staff)
    api_key = ApiKey.objects.get(tenant=tenant)
    page = f"/admin/deliveries/apikey/{api_key.id}/change/"
    assert browser.get(page).status_code == 200

    past = timezone.localtime(timezone.now() - timedelta(hours=1))
    response = browser.post(
        page, {"expires_at_0": past.strftime("%Y-%m-%d"), "expires_at_1": past.strftime("%H:%M:%S")}
    )

    assert response.status_code == 302, response.content[:2000]
    api_key.refresh_from_db()
    assert api_key.expires_at is not None and api_key.expires_at < timezone.now()
    entry = AuditEntry.objects.get(action="api_key.set_expiry")
    assert entry.actor == staff and entry.count == 1
    assert answer(f"Bearer {key}").status_code == 401
