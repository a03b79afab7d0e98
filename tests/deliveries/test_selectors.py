"""deliveries.selectors: the reads that the portal, the admin and the API share."""

import html

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient
from standardwebhooks.webhooks import Webhook

from deliveries import services
from deliveries.core.headers import DROPPED, NOT_STORED, REDACTED
from deliveries.models import Attempt, Endpoint
from deliveries.selectors import attempt_request_headers
from tests.conftest import drain
from tests.deliveries.test_portal import enter
from tests.receiver import always

# What aiohttp adds to every request by itself (framing and its defaults): the HTTP
# client's, not the service's, and not shown.
HTTP_CLIENT_HEADERS = {"host", "content-length", "accept", "accept-encoding"}


@pytest.mark.django_db(transaction=True)
def test_an_attempts_request_headers_are_what_its_receiver_got_on_every_surface(
    tenant, receiver, admin_client
):
    receiver.behaviours["/hook"] = always(503, body=b"try later")
    endpoint, secret = services.endpoint_create(
        tenant=tenant,
        url=receiver.url("/hook"),
        headers={"X-Tenant": "t-1", "Authorization": "Bearer s3cret"},
    )
    # As a row written before the header rule would hold it: dropped at send time.
    Endpoint.objects.filter(id=endpoint.id).update(
        headers={"X-Tenant": "t-1", "Authorization": "Bearer s3cret", "Connection": "close"}
    )
    event = services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"n": 1})
    drain()

    [got] = receiver.requests_to("/hook")
    attempt = Attempt.objects.get(delivery__event=event)
    shown = attempt_request_headers(attempt)

    # Every header the request carried is listed, and nothing it did not carry but the
    # dropped one.
    sent = {name.lower() for name, value in shown.items() if value != DROPPED}
    assert sent == set(got.headers) - HTTP_CLIENT_HEADERS
    assert [name for name, value in shown.items() if value == DROPPED] == ["Connection"]
    assert "connection" not in sent
    # Each value is the one sent, or a marker where the attempt log keeps none.
    for name, value in shown.items():
        if value == REDACTED:
            assert got.headers[name.lower()] not in (REDACTED, "")
        elif value == NOT_STORED:
            assert name == "webhook-signature"
        elif value != DROPPED:
            assert got.headers[name.lower()] == value, name
    assert shown["X-Tenant"] == shown["Authorization"] == REDACTED
    assert shown["webhook-id"] == shown["idempotency-key"] == str(attempt.delivery_id)
    assert Webhook(secret).verify(got.body, got.headers)  # the signature not shown was valid
    assert "s3cret" not in repr(shown)

    # The portal, the admin and the API show the same list.
    lines = [f"{name}: {value}" for name, value in shown.items()]
    portal = enter(Client(), tenant).get(f"/portal/deliveries/{attempt.delivery_id}/")
    assert html.unescape(portal.content.decode()).count("\n".join(lines)) == 1
    change = reverse("admin:deliveries_delivery_change", args=[attempt.delivery_id])
    admin = html.unescape(admin_client.get(change).content.decode())
    assert "".join(f"<div><code>{line}</code></div>" for line in lines) in admin
    _, key = services.api_key_create(tenant=tenant)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    [listed] = api.get(f"/api/v1/deliveries/{attempt.delivery_id}/attempts/").json()["results"]
    assert listed["request_headers"] == shown
    assert list(listed["request_headers"]) == list(shown)  # in the order sent
    for page in (portal.content, admin.encode(), repr(listed).encode()):
        assert b"s3cret" not in page
