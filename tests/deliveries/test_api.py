"""The customer REST API: shapes, tenant isolation, idempotency, errors."""

import json
import threading
import uuid

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.urls import get_resolver
from rest_framework.test import APIClient

from deliveries import services
from deliveries.jobs.background import enqueue
from deliveries.models import (
    ApiKey,
    Attempt,
    AuditEntry,
    Delivery,
    DeliveryListing,
    Endpoint,
    Event,
    Tenant,
)
from tests.conftest import drain
from tests.deliveries.jobs import sample_jobs  # noqa: F401  (registers test.noop)

pytestmark = pytest.mark.django_db


def client_for(tenant_name: str) -> tuple[APIClient, Tenant, str]:
    tenant, key = services.tenant_create(name=tenant_name)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client, tenant, key


@pytest.fixture
def alice():
    return client_for("alice")


@pytest.fixture
def bob():
    return client_for("bob")


def test_create_an_endpoint_and_get_its_secret_once(alice):
    client, _tenant, _ = alice
    r = client.post(
        "/api/v1/endpoints/",
        {"url": "https://example.com/hook", "event_types": ["invoice.paid"]},
        format="json",
    )
    assert r.status_code == 201, r.content
    assert r.json()["secret"].startswith("whsec_")
    listed = client.get("/api/v1/endpoints/").json()
    assert [e["id"] for e in listed["results"]] == [r.json()["id"]]
    assert "secret" not in json.dumps(listed)
    detail = client.get(f"/api/v1/endpoints/{r.json()['id']}/").json()
    assert "secret" not in detail


def test_an_endpoint_url_the_egress_guard_refuses_is_a_clear_400(alice, settings):
    client, _, _ = alice
    settings.EGRESS_ALLOW_NETWORKS = []
    for url in ("http://169.254.169.254/latest", "ftp://example.com/", "http://2130706433/"):
        r = client.post("/api/v1/endpoints/", {"url": url}, format="json")
        assert r.status_code == 400, url
        assert r.json()["error"]["code"] == "invalid"
        assert "url" in r.json()["error"]["details"]


REFUSED_URLS = [
    "http://169.254.169.254/latest/meta-data/",
    "http://[fd00:ec2::254]/",
    "http://100.100.100.200/",
    "http://2130706433/",
    "http://10.0.0.1/hook",
    "ftp://example.com/",
    "https://user:pw@example.com/",
]


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_the_admin_the_model_and_the_services_refuse_the_urls_the_api_refuses(
    url, alice, admin_client, settings
):
    client, tenant, _ = alice
    settings.EGRESS_ALLOW_NETWORKS = []
    assert client.post("/api/v1/endpoints/", {"url": url}, format="json").status_code == 400

    page = admin_client.post(
        "/admin/deliveries/endpoint/add/",
        {"tenant": str(tenant.id), "url": url, "description": "", "event_types": "[]"},
    )
    assert page.status_code == 200  # the form again, with the error; no redirect
    # Django's own URL check may speak first (it refuses "2130706433" as a host too).
    assert b"cannot receive webhooks" in page.content or b"Enter a valid URL" in page.content
    with pytest.raises(services.DomainError, match="cannot receive webhooks"):
        services.endpoint_create(tenant=tenant, url=url)
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/ok")
    with pytest.raises(services.DomainError, match="cannot receive webhooks"):
        services.endpoint_update(endpoint=endpoint, url=url)
    endpoint.url = url
    with pytest.raises(ValidationError) as refused:
        endpoint.full_clean()
    assert "url" in refused.value.message_dict
    assert list(Endpoint.objects.values_list("url", flat=True)) == ["https://example.com/ok"]


def test_the_admin_form_still_creates_an_endpoint_with_an_allowed_url(alice, admin_client):
    _client, tenant, _ = alice

    page = admin_client.post(
        "/admin/deliveries/endpoint/add/",
        {"tenant": str(tenant.id), "url": "https://example.com/ok", "event_types": "[]"},
    )

    assert page.status_code == 302, page.content[:2000]
    assert Endpoint.objects.get(tenant=tenant).url == "https://example.com/ok"


def test_custom_headers_are_write_only_and_protocol_headers_are_refused(alice):
    client, _, _ = alice
    r = client.post(
        "/api/v1/endpoints/",
        {"url": "https://example.com/h", "headers": {"X-Token": "s3cret"}},
        format="json",
    )
    assert r.status_code == 201
    assert r.json()["header_names"] == ["X-Token"]
    assert "s3cret" not in r.content.decode()
    bad = client.post(
        "/api/v1/endpoints/",
        {"url": "https://example.com/h", "headers": {"webhook-id": "x"}},
        format="json",
    )
    assert bad.status_code == 400


def test_a_tenant_pauses_and_resumes_its_endpoint_over_rest(alice):
    client, tenant, _ = alice
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/hook")
    services.publish_event(tenant=tenant, event_type="t", payload={})
    url = f"/api/v1/endpoints/{endpoint.id}/"
    assert client.get(url).json()["paused"] is False

    r = client.post(url + "pause/", {"reason": "deploying the receiver"}, format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["paused"] is True and body["paused_reason"] == "deploying the receiver"
    assert body["paused_at"] and body["enabled"] is True
    assert client.get(url).json()["paused"] is True
    # The delivery's sentence says it is held; it stays pending.
    [delivery] = client.get("/api/v1/deliveries/").json()["results"]
    assert delivery["state"] == "pending" and delivery["explanation"].startswith("Held")
    # Again: nothing changes, and the answer is the same endpoint.
    again = client.post(url + "pause/", {}, format="json")
    assert again.status_code == 200 and again.json()["paused_at"] == body["paused_at"]

    r = client.post(url + "resume/")
    assert r.status_code == 200, r.content
    assert (r.json()["paused"], r.json()["paused_at"], r.json()["paused_reason"]) == (
        False,
        None,
        "",
    )
    key_id = ApiKey.objects.get(tenant=tenant).id
    audit = list(AuditEntry.objects.order_by("id").values_list("action", "details"))
    assert audit == [
        (
            "endpoint.pause",
            {
                "endpoint": str(endpoint.id),
                "reason": "deploying the receiver",
                "via": f"api key {key_id}",
            },
        ),
        ("endpoint.resume", {"endpoint": str(endpoint.id), "via": f"api key {key_id}"}),
    ]


@pytest.mark.parametrize(
    "body", [{"reason": "x" * 201}, {"reason": None}, {"reason": "a\x00b"}, ["reason"]]
)
def test_a_bad_pause_request_is_a_400_and_pauses_nothing(alice, body):
    client, tenant, _ = alice
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/hook")
    r = client.post(f"/api/v1/endpoints/{endpoint.id}/pause/", body, format="json")
    assert r.status_code == 400, r.content
    assert set(r.json()) == {"error"}
    endpoint.refresh_from_db()
    assert endpoint.paused_at is None
    assert not AuditEntry.objects.exists()


def test_rotate_secret_keeps_the_old_one_signing_for_the_overlap(alice):
    client, _, _ = alice
    created = client.post("/api/v1/endpoints/", {"url": "https://example.com/h"}, format="json")
    endpoint_id = created.json()["id"]
    r = client.post(f"/api/v1/endpoints/{endpoint_id}/rotate-secret/")
    assert r.status_code == 200
    assert r.json()["secret"] != created.json()["secret"]
    assert r.json()["previous_secrets_expire_at"] is not None
    from django.utils import timezone

    active = services.active_secrets([uuid.UUID(endpoint_id)], now=timezone.now())
    assert active[uuid.UUID(endpoint_id)] == [r.json()["secret"], created.json()["secret"]]


@pytest.mark.django_db(transaction=True)
def test_publish_deliver_and_read_the_history(receiver):
    client, _tenant, _ = client_for("carol")
    client.post("/api/v1/endpoints/", {"url": receiver.url("/ok")}, format="json")
    r = client.post(
        "/api/v1/events/", {"event_type": "invoice.paid", "payload": {"n": 1}}, format="json"
    )
    assert r.status_code == 201
    drain()

    deliveries = client.get("/api/v1/deliveries/", {"event_id": r.json()["id"]}).json()
    [delivery] = deliveries["results"]
    assert delivery["state"] == "succeeded"
    assert delivery["id"] == receiver.received[0].webhook_id
    attempts = client.get(f"/api/v1/deliveries/{delivery['id']}/attempts/").json()["results"]
    assert [a["status_code"] for a in attempts] == [200]
    # The headers the receiver got; the signature is never kept, so never shown.
    headers = attempts[0]["request_headers"]
    assert headers["webhook-signature"] == "[not stored]"
    assert headers["webhook-id"] == headers["idempotency-key"] == delivery["id"]

    replay = client.post(f"/api/v1/deliveries/{delivery['id']}/replay/")
    assert replay.status_code == 202 and replay.json() == {"count": 1}
    drain()
    assert [r.webhook_id for r in receiver.received] == [delivery["id"]] * 2


def test_filters_and_cursor_pagination(alice):
    client, _tenant, _ = alice
    client.post("/api/v1/endpoints/", {"url": "https://example.com/h"}, format="json")
    for i in range(7):
        client.post(
            "/api/v1/events/",
            {"event_type": "a" if i % 2 else "b", "payload": {"i": i}},
            format="json",
        )
    page = client.get("/api/v1/deliveries/", {"limit": 3}).json()
    seen = [d["id"] for d in page["results"]]
    while page["next"]:
        page = client.get(page["next"]).json()
        seen += [d["id"] for d in page["results"]]
    assert len(seen) == len(set(seen)) == 7
    only_a = client.get("/api/v1/deliveries/", {"event_type": "a"}).json()["results"]
    assert len(only_a) == 3
    pending = client.get("/api/v1/deliveries/", {"state": "pending"}).json()["results"]
    assert len(pending) == 7
    bad = client.get("/api/v1/deliveries/", {"state": "nonsense"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid"


def test_deliveries_list_newest_first_and_by_endpoint(alice):
    client, _tenant, _ = alice
    a = client.post("/api/v1/endpoints/", {"url": "https://example.com/a"}, format="json")
    b = client.post("/api/v1/endpoints/", {"url": "https://example.com/b"}, format="json")
    events = [
        client.post("/api/v1/events/", {"event_type": "t", "payload": {"i": i}}, format="json")
        for i in range(4)
    ]
    newest_first = [e.json()["id"] for e in reversed(events)]

    listed = client.get("/api/v1/deliveries/").json()["results"]
    assert [d["event_id"] for d in listed[::2]] == newest_first
    assert [d["event_id"] for d in listed[1::2]] == newest_first
    only_b = client.get("/api/v1/deliveries/", {"endpoint_id": b.json()["id"]}).json()
    assert [d["event_id"] for d in only_b["results"]] == newest_first
    assert {d["endpoint_id"] for d in only_b["results"]} == {b.json()["id"]}
    assert a.json()["id"] != b.json()["id"]


@pytest.mark.django_db(transaction=True)
def test_deleting_an_endpoint_deletes_its_deliveries_and_leaves_the_others(receiver):
    client, _tenant, _ = client_for("carol")
    gone = client.post("/api/v1/endpoints/", {"url": receiver.url("/ok")}, format="json").json()
    kept = client.post("/api/v1/endpoints/", {"url": receiver.url("/ok")}, format="json").json()
    for i in range(3):
        client.post("/api/v1/events/", {"event_type": "t", "payload": {"i": i}}, format="json")
    drain()  # attempts recorded against both endpoints

    assert client.delete(f"/api/v1/endpoints/{gone['id']}/").status_code == 204

    assert not Endpoint.objects.filter(id=gone["id"]).exists()
    assert not Delivery.objects.filter(endpoint_id=gone["id"]).exists()
    assert not DeliveryListing.objects.filter(endpoint_id=gone["id"]).exists()
    assert not Attempt.objects.filter(endpoint_id=gone["id"]).exists()
    left = client.get("/api/v1/deliveries/").json()["results"]
    assert len(left) == 3 and {d["endpoint_id"] for d in left} == {kept["id"]}
    assert Attempt.objects.filter(endpoint_id=kept["id"]).count() == 3


def test_any_deletion_of_endpoints_deletes_their_deliveries_through_the_listing(alice):
    """Not only the API's: a queryset's delete too (models.cascade_to_deliveries), and
    every foreign key holds at the end."""
    client, _tenant, _ = alice
    for url in ("https://example.com/a", "https://example.com/b"):
        client.post("/api/v1/endpoints/", {"url": url}, format="json")
    client.post("/api/v1/events/", {"event_type": "t", "payload": {}}, format="json")
    assert DeliveryListing.objects.count() == Delivery.objects.count() == 2

    _, per_model = Endpoint.objects.all().delete()
    connection.check_constraints()

    assert per_model["deliveries.Delivery"] == per_model["deliveries.DeliveryListing"] == 2
    assert not Delivery.objects.exists() and not DeliveryListing.objects.exists()


def test_deleting_a_tenant_deletes_its_deliveries_with_its_events():
    client, tenant, _ = client_for("dave")
    client.post("/api/v1/endpoints/", {"url": "https://example.com/a"}, format="json")
    client.post("/api/v1/events/", {"event_type": "t", "payload": {}}, format="json")
    other, _ = services.tenant_create(name="erin")

    tenant.delete()
    connection.check_constraints()

    assert not Delivery.objects.exists() and not DeliveryListing.objects.exists()
    assert Tenant.objects.get() == other


def test_bulk_recovery_replays_dead_deliveries_since_a_time(alice):
    client, _tenant, _ = alice
    client.post("/api/v1/endpoints/", {"url": "https://example.com/h"}, format="json")
    for _i in range(3):
        client.post("/api/v1/events/", {"event_type": "t", "payload": {}}, format="json")
    from django.utils import timezone

    Delivery.objects.update(state="dead", finished_at=timezone.now())
    since = (timezone.now() - timezone.timedelta(hours=1)).isoformat()
    r = client.post("/api/v1/deliveries/recover/", {"since": since}, format="json")
    assert r.status_code == 202 and r.json() == {"count": 3}
    assert Delivery.objects.filter(state="pending").count() == 3
    too_old = (timezone.now() - timezone.timedelta(days=30)).isoformat()
    r = client.post("/api/v1/deliveries/recover/", {"since": too_old}, format="json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "since_too_old"


# --- Authentication -------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [None, "Bearer", "Bearer ", "Bearer whk_nope", "Basic abc", "bearer whk_x", "Token x"],
)
def test_missing_malformed_and_unknown_keys_are_401_with_one_shape(header):
    client = APIClient()
    if header is not None:
        client.credentials(HTTP_AUTHORIZATION=header)
    r = client.get("/api/v1/endpoints/")
    assert r.status_code == 401
    assert set(r.json()) == {"error"}
    assert r["WWW-Authenticate"] == "Bearer"


def test_a_revoked_key_stops_working(alice):
    client, tenant, _ = alice
    assert client.get("/api/v1/events/").status_code == 200
    from django.utils import timezone

    ApiKey.objects.filter(tenant=tenant).update(revoked_at=timezone.now())
    assert client.get("/api/v1/events/").status_code == 401


def test_requests_past_the_per_key_rate_get_429_with_retry_after(alice, settings):
    from django.core.cache import cache

    cache.clear()
    settings.API_THROTTLE_RATE = "3/min"
    try:
        client, _, _ = alice
        codes = [client.get("/api/v1/events/").status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        r = client.get("/api/v1/events/")
        assert r.json()["error"]["code"] == "throttled"
        assert int(r["Retry-After"]) > 0
    finally:
        cache.clear()


# --- Tenant isolation, over every route -----------------------------------------------


def api_routes() -> list[str]:
    """Every /api/v1/ URL pattern that takes an object id, from the resolver itself, so a
    new route is covered without editing this test."""
    found = set()

    def walk(patterns, prefix=""):
        for p in patterns:
            if hasattr(p, "url_patterns"):
                walk(p.url_patterns, prefix + str(p.pattern))
            else:
                found.add(prefix + str(p.pattern))

    walk(get_resolver().url_patterns)
    return sorted(r for r in found if r.startswith("^api/") or r.startswith("api/"))


def object_routes():
    routes = []
    for r in api_routes():
        if "(?P<pk>" not in r or "\\.(?P<format>" in r:
            continue
        path = r.lstrip("^").replace("(?P<pk>[^/]+)", "{id}").replace("/?$", "/").rstrip("$")
        path = path.replace("\\", "").replace("^", "")
        routes.append("/" + path)
    return sorted(set(routes))


def backfill_run_of(tenant):
    """A backfill run of a poll source that belongs to ``tenant`` (ingest's route)."""
    from datetime import UTC, datetime

    from ingest.backfill import backfill_run_create
    from ingest.poll_sources import poll_source_create

    poll_source_create(
        slug=f"crm-{tenant.id}",
        config={"url": "https://example.com/records"},
        tenant=tenant,
        schedule=False,
    )
    return backfill_run_create(
        slug=f"crm-{tenant.id}",
        since=datetime(2024, 1, 1, tzinfo=UTC),
        until=datetime(2024, 2, 1, tzinfo=UTC),
        rate=1,
    )


def test_the_api_root_lists_every_collection_of_every_app(alice):
    client, _, _ = alice
    r = client.get("/api/v1/")
    assert r.status_code == 200
    assert {name: url.split("/api/v1/")[1] for name, url in r.json().items()} == {
        "endpoints": "endpoints/",
        "events": "events/",
        "deliveries": "deliveries/",
        "backfill-runs": "backfill-runs/",
        "event-types": "event-types/",
    }
    # The root names routes only, as the public schema does; the collections need a key.
    anonymous = APIClient()
    assert anonymous.get("/api/v1/").json() == r.json()
    for url in r.json().values():
        assert client.get(url).status_code == 200, url
        assert anonymous.get(url).status_code == 401, url


def test_the_route_list_covers_every_object_route():
    assert object_routes() == [
        "/api/v1/backfill-runs/{id}/",
        "/api/v1/deliveries/{id}/",
        "/api/v1/deliveries/{id}/attempts/",
        "/api/v1/deliveries/{id}/replay/",
        "/api/v1/endpoints/{id}/",
        "/api/v1/endpoints/{id}/pause/",
        "/api/v1/endpoints/{id}/resume/",
        "/api/v1/endpoints/{id}/rotate-secret/",
        "/api/v1/endpoints/{id}/test/",
        "/api/v1/events/{id}/",
        "/api/v1/jobs/{id}/",
    ]


@pytest.mark.parametrize("route", object_routes())
@pytest.mark.parametrize("method", ["get", "post", "patch", "delete"])
def test_another_tenants_id_is_404_exactly_like_a_random_id(route, method, alice, bob):
    alice_client, _alice_tenant, _ = alice
    bob_client, bob_tenant, _ = bob
    endpoint, _ = services.endpoint_create(tenant=bob_tenant, url="https://example.com/b")
    event = services.publish_event(tenant=bob_tenant, event_type="t", payload={})
    delivery = Delivery.objects.get(event=event)
    collection = route.split("/")[3]
    ids = {"endpoints": endpoint.id, "events": event.id, "deliveries": delivery.id}
    if collection == "backfill-runs":
        ids[collection] = backfill_run_of(bob_tenant).id
    if collection == "jobs":
        ids[collection] = enqueue("test.noop", tenant=bob_tenant).id
    bob_id = ids[collection]

    def call(client, object_id):
        return getattr(client, method)(route.format(id=object_id), {}, format="json")

    theirs = call(alice_client, bob_id)
    random_ = call(alice_client, uuid.uuid4())
    garbage = call(alice_client, "not-a-uuid")
    if random_.status_code == 405:
        assert theirs.status_code == 405
        return
    assert theirs.status_code == random_.status_code == garbage.status_code == 404
    assert theirs.json() == random_.json() == garbage.json()
    # And nothing of Bob's changed.
    delivery.refresh_from_db()
    endpoint.refresh_from_db()
    assert delivery.state == "pending" and endpoint.enabled and endpoint.paused_at is None
    assert bob_client.get(route.format(id=bob_id)).status_code in (200, 405)


# The query parameters each list reads besides its cursor.
READS = {
    "endpoints": {"limit"},
    "events": {"limit", "event_type", "entity_id", "created_after", "created_before"},
    "deliveries": {
        "limit",
        "state",
        "endpoint_id",
        "event_id",
        "event_type",
        "created_after",
        "created_before",
    },
    "backfill-runs": {"limit"},
}


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"state": "pending"},
        {"endpoint_id": "X"},
        {"event_id": "X"},
        {"event_type": "t"},
        {"limit": 1},
    ],
)
@pytest.mark.parametrize("collection", ["endpoints", "events", "deliveries", "backfill-runs"])
def test_lists_never_show_another_tenants_rows(collection, params, alice, bob):
    alice_client, _alice_tenant, _ = alice
    _, bob_tenant, _ = bob
    backfill_run_of(bob_tenant)
    endpoint, _ = services.endpoint_create(tenant=bob_tenant, url="https://example.com/b")
    event = services.publish_event(tenant=bob_tenant, event_type="t", payload={})
    params = {
        k: (str(endpoint.id) if k == "endpoint_id" else str(event.id)) if v == "X" else v
        for k, v in params.items()
    }
    page = alice_client.get(f"/api/v1/{collection}/", params)
    unread = set(params) - READS[collection]
    if unread:  # refused, never ignored (an ignored filter would answer the whole list)
        assert page.status_code == 400
        assert page.json()["error"]["code"] == "unknown_parameter"
        assert page.json()["error"]["details"]["unknown"] == sorted(unread)
        return
    assert page.status_code == 200
    body = page.json()
    assert body["results"] == []
    for _ in range(3):  # follow every cursor too
        if not body.get("next"):
            break
        body = alice_client.get(body["next"]).json()
        assert body["results"] == []


# --- Idempotency-Key (Stripe's semantics) ---------------------------------------------


def post_event(client, body, key):
    return client.post("/api/v1/events/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def test_the_same_key_and_body_returns_the_same_answer_and_creates_nothing(alice):
    client, _, _ = alice
    body = {"event_type": "t", "payload": {"a": 1}}
    first = post_event(client, body, "k1")
    second = post_event(client, body, "k1")
    assert first.status_code == second.status_code == 201
    assert first.json() == second.json()
    assert second["Idempotent-Replayed"] == "true"
    assert Event.objects.count() == 1


def test_the_same_key_with_another_body_is_422(alice):
    client, _, _ = alice
    post_event(client, {"event_type": "t", "payload": {"a": 1}}, "k1")
    r = post_event(client, {"event_type": "t", "payload": {"a": 2}}, "k1")
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "idempotency_key_reused"
    assert Event.objects.count() == 1


def test_keys_are_scoped_per_tenant(alice, bob):
    body = {"event_type": "t", "payload": {}}
    assert post_event(alice[0], body, "same").status_code == 201
    r = post_event(bob[0], body, "same")
    assert r.status_code == 201
    assert "Idempotent-Replayed" not in r
    assert Event.objects.count() == 2


def test_a_request_that_fails_validation_stores_nothing(alice):
    client, _, _ = alice
    bad = post_event(client, {"payload": {}}, "k1")
    assert bad.status_code == 400
    good = post_event(client, {"event_type": "t", "payload": {}}, "k1")
    assert good.status_code == 201
    assert "Idempotent-Replayed" not in good


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_requests_with_one_key_one_executes_the_other_gets_409():
    client_a, tenant, _key = client_for("dave")
    # Hold the key's lock as a first request still running would.
    from django.db import transaction

    started, release = threading.Event(), threading.Event()
    results = {}

    def first():
        try:
            with transaction.atomic():
                _event, replayed = services.event_publish_idempotent(
                    tenant=tenant,
                    idempotency_key="k",
                    event_type="t",
                    payload={},
                    request_hash=services.request_fingerprint({"event_type": "t", "payload": {}}),
                )
                started.set()
                release.wait(10)
            results["first"] = replayed
        finally:
            connection.close()

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(10)
    second = post_event(client_a, {"event_type": "t", "payload": {}}, "k")
    release.set()
    t.join()
    assert second.status_code == 409
    assert second.json()["error"]["code"] == "idempotency_key_in_use"
    assert results["first"] is False
    assert Event.objects.count() == 1
    # Once the first finished, the same request is a replay.
    again = post_event(client_a, {"event_type": "t", "payload": {}}, "k")
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"


def test_openapi_schema_is_served(alice):
    r = APIClient().get("/api/schema/")
    assert r.status_code == 200
    assert b"/api/v1/deliveries/" in r.content
