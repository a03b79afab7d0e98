"""Alerts as data: incidents recorded as OperationalEvent rows, one message each, by
webhook (through the delivery pipeline, to a real local receiver) and by email (Django's
locmem backend)."""

import json
import threading
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.core import mail
from django.test import Client
from django.utils import timezone
from standardwebhooks.webhooks import Webhook

from deliveries import services
from deliveries.alerts import alerts_check, notify_pending
from deliveries.models import Event, OperationalEvent, Tenant
from ingest.schemes import get_scheme
from ingest.sources import source_create
from tests.conftest import drain
from tests.receiver import always

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


@pytest.fixture
def ops(settings, receiver):
    """The operators' tenant, with an endpoint on the local receiver; email on."""
    settings.ALERTS_TENANT = "operations"
    settings.ALERTS_EMAIL_TO = ["oncall@example.com"]
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    tenant = Tenant.objects.create(name="operations")
    _, secret = services.endpoint_create(tenant=tenant, url=receiver.url("/ops"))
    return secret


def ops_messages(receiver) -> list[dict]:
    return [json.loads(r.body) for r in receiver.requests_to("/ops")]


def kill_deliveries(tenant, receiver, n: int) -> None:
    """n deliveries that die at once (400 is permanent)."""
    receiver.behaviours["/bad"] = always(400)
    endpoint = tenant.endpoints.filter(url=receiver.url("/bad")).first()
    if endpoint is None:
        endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/bad"))
    for _ in range(n):
        services.publish_event(
            tenant=tenant, event_type="t", payload={}, endpoint_ids=[endpoint.id]
        )
    drain()


def test_growing_dead_letters_open_one_incident_and_send_one_message(
    tenant, receiver, ops, settings
):
    kill_deliveries(tenant, receiver, 2)

    counts = alerts_check()
    assert counts["opened"] == 1 and counts["notified"] == 1
    incident = OperationalEvent.objects.get()
    assert incident.kind == "dead_letters" and incident.details["count"] == 2
    assert incident.notification["email"] == "sent"
    assert incident.notification["webhook"].startswith("event ")
    [email] = mail.outbox
    assert email.to == ["oncall@example.com"] and "dead-lettered" in email.subject
    drain()
    [message] = ops_messages(receiver)
    assert message["kind"] == "dead_letters" and message["incident_id"] == incident.id
    last = receiver.requests_to("/ops")[-1]
    assert Webhook(ops).verify(last.body, last.headers)["summary"] == incident.summary

    # More dead letters while the incident is open: recorded, not sent again.
    kill_deliveries(tenant, receiver, 1)
    counts = alerts_check()
    assert counts["refreshed"] == 1 and counts["notified"] == 0
    drain()
    incident.refresh_from_db()
    assert incident.occurrences == 2 and incident.resolved_at is None
    assert len(mail.outbox) == 1 and len(ops_messages(receiver)) == 1

    # Quiet for ALERTS_RESOLVE_AFTER: resolved. Growing again later is a new incident.
    OperationalEvent.objects.update(
        last_seen_at=timezone.now() - timedelta(seconds=settings.ALERTS_RESOLVE_AFTER + 1)
    )
    assert alerts_check()["resolved"] == 1
    kill_deliveries(tenant, receiver, 1)
    assert alerts_check()["opened"] == 1
    drain()
    assert OperationalEvent.objects.count() == 2
    assert len(mail.outbox) == 2 and len(ops_messages(receiver)) == 2


def test_the_operator_endpoints_own_dead_letters_do_not_alert(receiver, ops, settings):
    operations = Tenant.objects.get(name="operations")
    kill_deliveries(operations, receiver, 1)
    assert alerts_check()["opened"] == 0
    assert not OperationalEvent.objects.exists()


def test_an_endpoint_the_worker_disables_is_an_incident(tenant, receiver, ops):
    receiver.behaviours["/gone"] = always(410)
    endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/gone"))
    services.publish_event(tenant=tenant, event_type="t", payload={}, endpoint_ids=[endpoint.id])
    drain()

    incident = OperationalEvent.objects.get(kind="endpoint_disabled")
    assert incident.key == str(endpoint.id) and incident.severity == "critical"
    assert "410" in incident.details["reason"]
    alerts_check()
    assert len([m for m in mail.outbox if "disabled" in m.subject]) == 1
    alerts_check()
    assert len([m for m in mail.outbox if "disabled" in m.subject]) == 1


def test_a_spike_of_verification_failures_is_an_incident(settings):
    settings.ALERTS_VERIFICATION_FAILURE_THRESHOLD = 3
    settings.ALERTS_EMAIL_TO = ["oncall@example.com"]
    source_create(slug="spiky", scheme="stripe", secrets=["whsec_spiky_secret"])

    def bad_posts(n: int) -> None:
        body = json.dumps({"id": "evt_1", "object": "event", "type": "x"}).encode()
        signed = get_scheme("stripe").sign(body=body, secret="whsec_wrong")
        signed.pop("content-type", None)
        headers = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in signed.items()}
        for _ in range(n):
            r = Client().post("/ingest/spiky/", body, content_type="application/json", **headers)
            assert r.status_code == 401

    bad_posts(5)
    alerts_check()  # the first check takes the baseline: old failures are not a spike
    assert not OperationalEvent.objects.filter(kind="verification_failures").exists()

    bad_posts(2)
    alerts_check()
    assert not OperationalEvent.objects.filter(kind="verification_failures").exists()

    bad_posts(3)
    alerts_check()
    incident = OperationalEvent.objects.get(kind="verification_failures")
    assert incident.key == "spiky" and incident.details["reasons"] == {"bad_signature": 3}
    assert len(mail.outbox) == 1 and "spiky" in mail.outbox[0].subject


def test_concurrent_notifiers_send_one_message(tenant, receiver, ops):
    kill_deliveries(tenant, receiver, 1)
    from deliveries.alerts import dead_letter_check, operational_event_record

    [signal] = dead_letter_check(timezone.now())
    operational_event_record(signal=signal, now=timezone.now())
    start = threading.Barrier(4)
    sent = []

    def notify():
        from django.db import connection

        start.wait()
        sent.append(notify_pending(now=timezone.now()))
        connection.close()

    threads = [threading.Thread(target=notify) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(sent) == 4  # every thread answered (one that raised appends nothing)
    assert sum(sent) == 1
    assert len(mail.outbox) == 1
    assert Event.objects.filter(event_type="operations.alert").count() == 1


def test_operational_events_are_visible_in_the_admin(tenant, receiver, ops):
    kill_deliveries(tenant, receiver, 1)
    alerts_check()
    User.objects.create_superuser("admin", "a@example.com", "pw-admin-123")
    client = Client()
    client.login(username="admin", password="pw-admin-123")
    page = client.get("/admin/deliveries/operationalevent/")
    assert page.status_code == 200
    assert b"dead-lettered" in page.content
    incident = OperationalEvent.objects.get()
    detail = client.get(f"/admin/deliveries/operationalevent/{incident.id}/change/")
    assert detail.status_code == 200 and b"notification" in detail.content
