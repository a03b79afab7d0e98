"""API abuse: the tenant-isolation sweep, and every kind of bad key getting one answer.

The sweep itself lives in ``tests/deliveries/test_api.py`` (every object route from the
URL resolver, four methods, another tenant's id against a random one; every list under
every filter and cursor). It is imported here, not copied, so that it runs as part of
this suite too and any route added later is swept in both places.

Bad keys: unknown, revoked, expired and malformed credentials must each get the same 401
with the one JSON error shape, the same ``WWW-Authenticate``, and nothing of any tenant.
"""

import base64
import json
from datetime import timedelta
from urllib.parse import urlencode

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from deliveries import services
from deliveries.models import ApiKey, Attempt, AuditEntry, Delivery, Endpoint, Event, Outcome
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


# --- Hostile input: every answer a 4xx in the one error shape, nothing written ----------


def assert_one_error_shape(response, status: int = 400, code: str | None = None) -> dict:
    assert response.status_code == status, response.content[:500]
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) <= {"code", "message", "details"}
    assert isinstance(body["error"]["code"], str) and isinstance(body["error"]["message"], str)
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def cursor(**fields: str) -> str:
    """A cursor as DRF spells one (base64 of a query string), with the fields given."""
    return base64.b64encode(urlencode(fields).encode()).decode()


@pytest.fixture
def tenant_with_rows():
    client, tenant, _key = client_for("hostile")
    endpoint = client.post(
        "/api/v1/endpoints/", {"url": "https://example.com/hook"}, format="json"
    ).json()
    for i in range(3):
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
    delivery = Delivery.objects.filter(tenant=tenant).first()
    Attempt.objects.create(
        delivery=delivery,
        number=1,
        started_at=timezone.now(),
        duration_ms=1.0,
        status_code=503,
        outcome=Outcome.RETRY,
    )
    return client, tenant, endpoint, delivery


TAMPERED_CURSORS = {
    "offset -20:00 in the position": cursor(p="2026-01-01 00:00:00-20:00"),
    "offset +23:59 at the end of the calendar": cursor(p="9999-12-31 23:59:59-15:00"),
    "a position that is no time": cursor(p="yesterday"),
    "a NUL in the position": cursor(p="2026\x00"),
    "a negative offset": cursor(o="-20"),
    "an offset that is no number": cursor(o="-20:00"),
    "a reverse flag that is no number": cursor(r="yes"),
    "not base64": "!!!",
    "base64 of bytes that are not UTF-8": base64.b64encode(b"p=\xff\xfe").decode(),
}
LISTS = ["/api/v1/events/", "/api/v1/deliveries/", "/api/v1/endpoints/", "/api/v1/backfill-runs/"]


@pytest.mark.parametrize("tampered", TAMPERED_CURSORS, ids=list(TAMPERED_CURSORS))
@pytest.mark.parametrize("path", LISTS)
def test_a_tampered_cursor_is_a_400_invalid_cursor_on_every_list(path, tampered, tenant_with_rows):
    client, *_ = tenant_with_rows

    response = client.get(path, {"cursor": TAMPERED_CURSORS[tampered]})

    assert_one_error_shape(response, 400, "invalid_cursor")


@pytest.mark.parametrize(
    "position", ["abc", "1.5", "\x00", "-", "9" * 40, "2026-01-01 00:00:00+00:00"]
)
def test_a_position_that_is_no_attempt_number_is_a_400_invalid_cursor(position, tenant_with_rows):
    client, _tenant, _endpoint, delivery = tenant_with_rows

    response = client.get(
        f"/api/v1/deliveries/{delivery.id}/attempts/", {"cursor": cursor(p=position)}
    )

    assert_one_error_shape(response, 400, "invalid_cursor")


def test_the_cursors_the_api_hands_out_still_walk_every_page(tenant_with_rows):
    client, tenant, *_ = tenant_with_rows
    for i in range(5):
        services.publish_event(tenant=tenant, event_type="t", payload={"more": i})

    for path in ("/api/v1/events/", "/api/v1/deliveries/"):
        page = client.get(path, {"limit": 2}).json()
        seen = [row["id"] for row in page["results"]]
        while page["next"]:
            page = client.get(page["next"]).json()
            seen += [row["id"] for row in page["results"]]
        assert len(seen) == len(set(seen)) == 8
        back = client.get(page["previous"]).json()
        assert back["results"] and back["results"][0]["id"] in seen


def deep(levels: int, opener: str = "[", closer: str = "]") -> str:
    return opener * levels + closer * levels


DEEP = {
    "lists": deep(5000),
    "objects": '{"a":' * 5000 + "1" + "}" * 5000,
    "just past the limit": deep(65),
}


@pytest.mark.parametrize("nesting", DEEP, ids=list(DEEP))
@pytest.mark.parametrize(
    "path, template",
    [
        ("/api/v1/events/", '{"event_type": "t", "payload": {"x": %s}}'),
        ("/api/v1/endpoints/", '{"url": "https://example.com/h", "event_types": %s}'),
        ("/api/v1/deliveries/recover/", '{"since": %s}'),
        ("/api/v1/events/", "%s"),
    ],
)
def test_a_body_nested_too_deep_is_a_400_and_writes_nothing(
    path, template, nesting, tenant_with_rows
):
    client, *_ = tenant_with_rows
    before = Event.objects.count(), Endpoint.objects.count()

    response = client.post(path, template % DEEP[nesting], content_type="application/json")

    assert_one_error_shape(response, 400, "parse_error")
    assert "nested" in response.json()["error"]["message"]
    assert (Event.objects.count(), Endpoint.objects.count()) == before


def test_a_payload_nested_to_the_limit_is_accepted_and_sent_unchanged(tenant_with_rows):
    client, *_ = tenant_with_rows
    # The body's object is one level, "payload" another: 62 lists inside them make 64.
    payload = {"x": json.loads(deep(62))}

    response = client.post(
        "/api/v1/events/", {"event_type": "t", "payload": payload}, format="json"
    )

    assert response.status_code == 201, response.content[:300]
    assert (
        bytes(Event.objects.get(id=response.json()["id"]).body)
        == json.dumps(payload, separators=(",", ":")).encode()
    )


# Text PostgreSQL cannot store, or UTF-8 cannot encode, where no text field checks it:
# inside a JSON field and in a dictionary's keys. (DRF's text fields refuse both
# already; the schema-driven run sends them to every field.)
UNSTORABLE = {"NUL": "\\u0000", "lone high surrogate": "\\ud800", "lone low surrogate": "\\udfff"}
UNSTORABLE_PLACES = [
    ("/api/v1/events/", '{"event_type": "t", "payload": {"x": "a%sb"}}'),
    ("/api/v1/events/", '{"event_type": "t", "payload": {"a%sb": 1}}'),
    ("/api/v1/events/", '{"event_type": "t", "payload": {"x": [[{"y": "%s"}]]}}'),
    ("/api/v1/endpoints/", '{"url": "https://example.com/h", "headers": {"X-%s": "v"}}'),
]


@pytest.mark.parametrize("text", UNSTORABLE, ids=list(UNSTORABLE))
@pytest.mark.parametrize("path, template", UNSTORABLE_PLACES)
def test_nul_and_lone_surrogates_anywhere_in_a_json_body_are_a_400_and_write_nothing(
    path, template, text, tenant_with_rows
):
    client, *_ = tenant_with_rows
    before = Event.objects.count(), Endpoint.objects.count()

    response = client.post(path, template % UNSTORABLE[text], content_type="application/json")

    assert response.status_code == 400, response.content[:300]
    assert_one_error_shape(response)
    assert (Event.objects.count(), Endpoint.objects.count()) == before


@pytest.mark.parametrize("text", UNSTORABLE, ids=list(UNSTORABLE))
def test_an_endpoint_update_with_unstorable_text_is_a_400_and_changes_nothing(
    text, tenant_with_rows
):
    client, _tenant, endpoint, _delivery = tenant_with_rows
    path = f"/api/v1/endpoints/{endpoint['id']}/"

    for body in ('{"headers": {"X-%s": "v"}}', '{"event_types": ["%s"]}'):
        response = client.patch(path, body % UNSTORABLE[text], content_type="application/json")
        assert_one_error_shape(response)

    stored = Endpoint.objects.get(id=endpoint["id"])
    assert stored.headers == {} and stored.event_types == []


@pytest.mark.parametrize(
    "payload",
    [
        '{"x": "\\ud800"}',
        '{"x": "\\u0000"}',
        deep(5000),
        '{"x": 1e999}',
    ],
)
def test_a_form_posted_payload_is_held_to_the_same_rules(payload, tenant_with_rows):
    client, *_ = tenant_with_rows
    before = Event.objects.count()

    response = client.post(
        "/api/v1/events/",
        urlencode({"event_type": "t", "payload": payload}),
        content_type="application/x-www-form-urlencoded",
    )

    assert_one_error_shape(response)
    assert Event.objects.count() == before


@pytest.mark.parametrize("key", ["a\x00b", "\x00"])
def test_an_idempotency_key_with_a_nul_byte_is_a_400_and_writes_nothing(key, tenant_with_rows):
    client, *_ = tenant_with_rows
    before = Event.objects.count()

    response = client.post(
        "/api/v1/events/",
        {"event_type": "t", "payload": {}},
        format="json",
        HTTP_IDEMPOTENCY_KEY=key,
    )

    assert_one_error_shape(response, 400, "invalid_idempotency_key")
    assert Event.objects.count() == before


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/endpoints/%00%2F/rotate-secret/",  # an id holding "/" routes nowhere
        "/api/v1/no-such-collection/",
        "/ingest/",
    ],
)
def test_a_path_under_the_api_that_routes_nowhere_is_a_404_in_the_one_shape(path):
    client, *_ = client_for("lost")

    assert_one_error_shape(client.post(path), 404, "not_found")
    assert client.get("/nowhere/").status_code == 404  # elsewhere, Django's own page
    assert not client.get("/nowhere/")["Content-Type"].startswith("application/json")
