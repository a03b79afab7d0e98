"""Tenants told about their own endpoints: a mail through a real local SMTP server
(aiosmtpd) and an ``endpoint.disabled`` / ``endpoint.failing`` webhook through the normal
pipeline to a real local receiver; one incident, one message."""

import json
import socket
import time
from datetime import timedelta
from email import message_from_bytes

import pytest
from aiosmtpd.controller import Controller
from django.utils import timezone

from deliveries import services
from deliveries.alerts import alerts_check
from deliveries.models import Delivery, Endpoint, OperationalEvent
from tests.conftest import drain, scrape, value
from tests.receiver import always

pytestmark = pytest.mark.django_db(transaction=True)


class Mailbox:
    """aiosmtpd handler: every message the server accepted."""

    def __init__(self) -> None:
        self.messages = []

    async def handle_DATA(self, server, session, envelope):
        self.messages.append((list(envelope.rcpt_tos), message_from_bytes(envelope.content)))
        return "250 OK"

    def to(self, address: str) -> list:
        return [m for rcpt, m in self.messages if address in rcpt]

    def wait_for(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.messages) < count:
            assert time.monotonic() < deadline, f"{len(self.messages)} mails, wanted {count}"
            time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mailbox(settings):
    box = Mailbox()
    controller = Controller(box, hostname="127.0.0.1", port=free_port())
    controller.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", controller.port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_TIMEOUT = 5
    yield box
    controller.stop()


@pytest.fixture
def acme(tenant):
    tenant.notification_email = "ops@acme.example"
    tenant.save()
    return tenant


def test_a_disabled_endpoint_tells_its_tenant_once_by_mail_and_webhook(
    acme, receiver, mailbox, settings
):
    settings.ALERTS_EMAIL_TO = ["oncall@service.example"]
    receiver.behaviours["/gone"] = always(410)
    receiver.behaviours["/watch"] = always(200)
    receiver.behaviours["/all"] = always(200)
    gone, _ = services.endpoint_create(
        tenant=acme, url=receiver.url("/gone"), event_types=["invoice.*", "endpoint.*"]
    )
    watch, _ = services.endpoint_create(
        tenant=acme, url=receiver.url("/watch"), event_types=["endpoint.disabled"]
    )
    services.endpoint_create(tenant=acme, url=receiver.url("/all"))  # every type, not asked
    services.publish_event(tenant=acme, event_type="invoice.paid", payload={"n": 1})
    drain()  # the receiver answers 410: the worker disables the endpoint
    gone.refresh_from_db()
    assert not gone.enabled and "410" in gone.disabled_reason

    alerts_check()
    drain()
    mailbox.wait_for(3)  # the tenant's; the operator's, of the endpoint and the dead letter
    (mail,) = mailbox.to("ops@acme.example")
    assert "disabled" in mail["Subject"] and "127.0.0.1" in mail["Subject"]
    body = mail.get_payload()
    assert "410 Gone" in body and str(gone.id) in body
    assert receiver.url("/gone") not in body  # the host, never the whole URL
    operator = [m["Subject"] for m in mailbox.to("oncall@service.example")]
    assert len([s for s in operator if "disabled" in s]) == 1  # the operator's own mail

    (notice,) = receiver.requests_to("/watch")
    payload = json.loads(notice.body)
    assert payload["endpoint_id"] == str(gone.id) and payload["enabled"] is False
    assert payload["reason"] == "the endpoint answered 410 Gone"
    delivery = Delivery.objects.get(id=notice.webhook_id)
    assert delivery.event.event_type == "endpoint.disabled"
    assert delivery.endpoint_id == watch.id
    assert len(receiver.requests_to("/gone")) == 1  # the invoice; never its own notice
    assert receiver.requests_to("/all") == [receiver.requests_to("/all")[0]]  # the invoice

    incident = OperationalEvent.objects.get(kind="endpoint_disabled")
    assert incident.notification["tenant_email"] == "sent"
    assert incident.notification["tenant_webhook"].endswith("to 1 endpoint(s)")
    # Seen again (more deliveries dead on it): the same incident, no new message.
    alerts_check()
    alerts_check()
    drain()
    assert len(mailbox.to("ops@acme.example")) == 1
    assert len(receiver.requests_to("/watch")) == 1


def test_an_endpoint_that_keeps_failing_tells_the_tenant_alone(acme, receiver, mailbox, settings):
    settings.ALERTS_EMAIL_TO = ["oncall@service.example"]
    settings.TENANT_NOTIFY_FAILING_AFTER = 3600
    receiver.behaviours["/down"] = always(503)
    receiver.behaviours["/watch"] = always(200)
    down, _ = services.endpoint_create(tenant=acme, url=receiver.url("/down"))
    services.endpoint_create(tenant=acme, url=receiver.url("/watch"), event_types=["endpoint.*"])
    services.publish_event(tenant=acme, event_type="invoice.paid", payload={"n": 1})
    drain()
    down.refresh_from_db()
    assert down.failing_since is not None and down.enabled
    before = value(
        scrape(),
        "webhooks_tenant_notifications_total",
        kind="endpoint_failing",
        channel="email",
        outcome="sent",
    )

    alerts_check()  # failing for seconds: not yet
    assert not OperationalEvent.objects.filter(kind="endpoint_failing").exists()
    # The clock: it has been failing for two hours.
    Endpoint.objects.filter(id=down.id).update(failing_since=timezone.now() - timedelta(hours=2))
    for _ in range(3):  # every minute while it fails: one incident
        alerts_check()
    drain()
    mailbox.wait_for(1)
    (mail,) = mailbox.to("ops@acme.example")
    assert "failing" in mail["Subject"]
    # Not the operator's, until it is disabled (the dead-letter alert is another matter).
    assert not [m for m in mailbox.to("oncall@service.example") if "failing" in m["Subject"]]
    (notice,) = receiver.requests_to("/watch")
    assert json.loads(notice.body)["endpoint_id"] == str(down.id)
    assert Delivery.objects.get(id=notice.webhook_id).event.event_type == "endpoint.failing"
    incident = OperationalEvent.objects.get(kind="endpoint_failing")
    assert incident.occurrences == 3 and "webhook" not in incident.notification
    after = value(
        scrape(),
        "webhooks_tenant_notifications_total",
        kind="endpoint_failing",
        channel="email",
        outcome="sent",
    )
    assert after == before + 1


def test_a_tenant_with_no_address_and_no_subscriber_is_sent_nothing(tenant, mailbox):
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/h")
    services.endpoint_disable(endpoint=endpoint, reason="the endpoint answered 410 Gone")
    from deliveries.alerts import endpoint_disabled_signal

    endpoint_disabled_signal([endpoint.id])
    alerts_check()
    incident = OperationalEvent.objects.get(kind="endpoint_disabled")
    assert incident.notification["tenant_email"] == "off"
    assert incident.notification["tenant_webhook"] == "no endpoint subscribed"
    assert mailbox.messages == []
    assert not Delivery.objects.exists()


def test_an_smtp_failure_is_recorded_and_not_sent_again(acme, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", free_port()  # nothing listens
    settings.EMAIL_TIMEOUT = 2
    endpoint, _ = services.endpoint_create(tenant=acme, url="https://example.com/h")
    services.endpoint_disable(endpoint=endpoint, reason="failing for more than 5 days")
    from deliveries.alerts import endpoint_disabled_signal

    endpoint_disabled_signal([endpoint.id])
    alerts_check()
    incident = OperationalEvent.objects.get(kind="endpoint_disabled")
    assert incident.notification["tenant_email"].startswith("failed: ")
    assert incident.notified_at is not None
    assert alerts_check()["notified"] == 0
