"""deliveries.client against the running service (pytest-django's live_server): a real
HTTP round trip for every call, the pipeline delivering to a real local receiver."""

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from deliveries import services
from deliveries.client import ApiError, WebhooksClient
from deliveries.models import EventType, EventTypeVersion
from deliveries.portal.links import portal_link_redeem
from tests.conftest import drain
from tests.receiver import fail_first

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def api(live_server, tenant):
    _, key = services.api_key_create(tenant=tenant)
    return WebhooksClient(live_server.url + "/api/v1/", key)


def test_the_whole_story_through_the_client(api, receiver, settings):
    settings.DELIVERY_RETRY_SCHEDULE = [3600]  # only a replay sends the failed one again
    receiver.behaviours["/hook"] = fail_first(1)
    endpoint = api.create_endpoint(receiver.url("/hook"), event_types=["invoice.*"])
    assert endpoint["secret"].startswith("whsec_")
    assert api.get_endpoint(endpoint["id"])["event_types"] == ["invoice.*"]
    assert [e["id"] for e in api.list_endpoints()] == [endpoint["id"]]

    event = api.publish("invoice.paid", {"n": 1}, idempotency_key="k-1")
    assert api.publish("invoice.paid", {"n": 1}, idempotency_key="k-1")["id"] == event["id"]
    drain()
    (delivery,) = api.list_deliveries(event_id=event["id"])
    assert delivery["state"] == "pending" and delivery["last_status_code"] == 500
    assert delivery["explanation"].startswith("Waiting by policy until")
    assert api.replay(delivery["id"]) == 1
    drain()
    assert api.get_delivery(delivery["id"])["state"] == "succeeded"
    assert [a["status_code"] for a in api.list_attempts(delivery["id"])] == [500, 200]
    assert {r.webhook_id for r in receiver.requests_to("/hook")} == {delivery["id"]}

    rotated = api.rotate_secret(endpoint["id"])
    assert rotated["secret"] != endpoint["secret"] and rotated["previous_secrets_expire_at"]
    assert api.pause(endpoint["id"], reason="deploy")["paused"] is True
    assert api.resume(endpoint["id"])["paused"] is False
    test_event = api.send_test(endpoint["id"])
    assert test_event["event_type"] == "webhook.test"
    assert api.recover(timezone.now() - timedelta(days=1)) == 0
    assert api.update_endpoint(endpoint["id"], description="billing")["description"] == "billing"
    api.delete_endpoint(endpoint["id"])
    assert list(api.list_endpoints()) == []


def test_lists_follow_every_page(api):
    for n in range(5):
        api.publish("t", {"n": n})
    assert [e["payload"]["n"] for e in api.list_events(limit=2)] == [4, 3, 2, 1, 0]
    assert [e["payload"]["n"] for e in api.list_events(event_type="t", limit=10)][:1] == [4]


def test_errors_raise_in_the_one_shape(api, live_server):
    with pytest.raises(ApiError) as missing:
        api.get_delivery("00000000-0000-0000-0000-000000000000")
    assert (missing.value.status, missing.value.code) == (404, "not_found")
    with pytest.raises(ApiError) as bad:
        api.create_endpoint("https://example.com/h", event_types=["inv*"])
    assert bad.value.code == "invalid" and "event_types" in bad.value.details
    with pytest.raises(ApiError) as unknown:
        api.request("GET", "events/", params={"page_size": 2})
    assert unknown.value.code == "unknown_parameter"
    with pytest.raises(ApiError) as refused:
        WebhooksClient(live_server.url + "/api/v1/", "whk_nope").get_event("x")
    assert refused.value.status == 401
    with pytest.raises(ValueError, match="aware datetime"):
        api.publish("t", {}, deliver_at=datetime(2030, 1, 1, 9))
    with pytest.raises(ValueError, match="not under"):
        api.request("GET", "https://elsewhere.example.com/api/v1/events/")
    assert "whk_" not in repr(api)


def test_the_catalogue_through_the_client(api):
    paid = EventType.objects.create(name="invoice.paid", description="Paid.")
    EventTypeVersion.objects.create(
        event_type=paid, schema={"type": "object"}, example={"invoice_id": "in_1"}
    )
    EventType.objects.create(name="customer.created")
    EventType.objects.filter(name__startswith="endpoint.").delete()  # migration 0030's
    assert [t["name"] for t in api.list_event_types()] == ["customer.created", "invoice.paid"]
    (listed,) = api.list_event_types(group="invoice")
    assert listed["versions"][0]["example"] == {"invoice_id": "in_1"}


def test_a_portal_link_through_the_client_opens_the_tenants_portal(api, live_server, tenant):
    link = api.portal_link(ttl=60)
    assert set(link) == {"url", "expires_at"}
    path, token = link["url"].removeprefix(live_server.url).split("#")
    assert path == "/portal/enter/" and token.startswith("whp_")
    expires = datetime.fromisoformat(link["expires_at"])
    assert timedelta(seconds=55) < expires - timezone.now() <= timedelta(seconds=60)
    assert portal_link_redeem(token=token) == tenant.id
    with pytest.raises(ApiError) as refused:
        api.portal_link(ttl=10**9)
    assert (refused.value.status, refused.value.code) == (400, "invalid_ttl")
