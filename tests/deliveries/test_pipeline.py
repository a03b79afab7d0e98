"""The outbound pipeline end to end: publish, schedule, relay, work."""

import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.utils import timezone
from standardwebhooks.webhooks import Webhook

from deliveries import services
from deliveries.jobs.models import Outbox, QueueMessage
from deliveries.models import Attempt, Delivery, DeliveryListing, Endpoint, Event
from tests.conftest import drain, make_due
from tests.receiver import always, fail_first

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


def test_publish_writes_one_pending_delivery_per_subscribed_endpoint(tenant, make_endpoint):
    a = make_endpoint("http://127.0.0.1:9/a", event_types=["invoice.paid"])
    b = make_endpoint("http://127.0.0.1:9/b")  # every type
    make_endpoint("http://127.0.0.1:9/c", event_types=["user.created"])
    make_endpoint("http://127.0.0.1:9/d", enabled=False)

    event = services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"n": 1})

    deliveries = Delivery.objects.filter(event=event)
    assert {d.endpoint_id for d in deliveries} == {a.id, b.id}
    assert {d.state for d in deliveries} == {"pending"}
    assert bytes(Event.objects.get(id=event.id).body) == b'{"n":1}'


def test_publish_writes_what_the_models_would(tenant, make_endpoint):
    """On PostgreSQL the event and its deliveries are written by one SQL statement; every
    column it leaves to a default must hold what the ORM would have written, and the
    returned event must equal the stored one. (On SQLite the ORM writes them.)"""
    endpoint = make_endpoint("http://127.0.0.1:9/a")
    other_tenant = services.tenant_create(name="other")[0]
    services.endpoint_create(tenant=other_tenant, url="http://127.0.0.1:9/other")

    before = timezone.now()
    event = services.publish_event(
        tenant=tenant, event_type="t", payload={"a": 1}, entity_id="cus_1", priority=3
    )
    after = timezone.now()

    def columns(instance) -> dict:
        values = {f.attname: getattr(instance, f.attname) for f in instance._meta.concrete_fields}
        return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in values.items()}

    assert columns(Event.objects.get(id=event.id)) == columns(event)
    delivery = Delivery.objects.get()  # the other tenant's endpoint got none
    expected = Delivery(
        id=delivery.id,
        event_id=event.id,
        endpoint_id=endpoint.id,
        tenant_id=tenant.id,
        priority=3,
        next_attempt_at=event.created_at,
        created_at=event.created_at,
        updated_at=event.created_at,
    )
    stamps = ("next_attempt_at", "created_at", "updated_at")
    assert all(before <= getattr(delivery, name) <= after for name in stamps)
    if connection.vendor != "postgresql":
        # The ORM stamps each row as it saves it (auto_now_add), microseconds apart; the
        # one statement writes the publish's one moment everywhere.
        for name in stamps:
            setattr(expected, name, getattr(delivery, name))
    assert columns(delivery) == columns(expected)
    # Its listing row, written by the same statement: whose the delivery is.
    listing = DeliveryListing.objects.get()
    assert (listing.delivery_id, listing.tenant_id, listing.endpoint_id) == (
        delivery.id,
        tenant.id,
        endpoint.id,
    )


def test_endpoint_ids_pick_enabled_endpoints_whatever_their_filters(tenant, make_endpoint):
    a = make_endpoint("http://127.0.0.1:9/a", event_types=["user.created"])
    make_endpoint("http://127.0.0.1:9/b")
    off = make_endpoint("http://127.0.0.1:9/off", enabled=False)

    event = services.publish_event(
        tenant=tenant, event_type="ping", payload={}, endpoint_ids=[a.id, off.id]
    )
    assert [d.endpoint_id for d in Delivery.objects.filter(event=event)] == [a.id]
    none = services.publish_event(tenant=tenant, event_type="ping", payload={}, endpoint_ids=[])
    assert not Delivery.objects.filter(event=none).exists()


def test_a_rolled_back_publish_leaves_nothing(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/a")

    with pytest.raises(RuntimeError), transaction.atomic():
        services.publish_event(tenant=tenant, event_type="x", payload={})
        raise RuntimeError("the caller's business write failed")

    assert Event.objects.count() == 0
    assert Delivery.objects.count() == 0
    assert DeliveryListing.objects.count() == 0


def test_delivery_is_signed_and_verifiable_by_the_standardwebhooks_package(tenant, receiver):
    _endpoint, secret = services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    event = services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"a": 1})

    drain()

    delivery = Delivery.objects.get(event=event)
    assert delivery.state == "succeeded"
    [request] = receiver.received
    assert request.body == b'{"a":1}'
    assert request.headers["content-type"] == "application/json"
    assert request.headers["webhook-id"] == str(delivery.id)
    assert request.headers["idempotency-key"] == str(delivery.id)
    verified = Webhook(secret).verify(request.body, request.headers)
    assert verified == {"a": 1}


def test_a_payload_of_model_values_goes_out_as_djangos_json_the_same_on_every_attempt(
    tenant, receiver
):
    # What a host's model gives: a DecimalField amount, a DateTimeField, a UUID key.
    receiver.behaviours["/flaky"] = fail_first(1)
    _endpoint, secret = services.endpoint_create(tenant=tenant, url=receiver.url("/flaky"))
    paid_at = datetime(2026, 3, 1, 9, 30, 15, 250000, tzinfo=UTC)
    invoice_id = uuid.UUID("0195e3b4-7c1d-7000-8000-0123456789ab")
    payload = {"invoice_id": invoice_id, "amount": Decimal("12.50"), "paid_at": paid_at}
    event = services.publish_event(tenant=tenant, event_type="invoice.paid", payload=payload)

    drain()
    make_due()
    drain()

    expected = (
        b'{"invoice_id":"0195e3b4-7c1d-7000-8000-0123456789ab","amount":"12.50",'
        b'"paid_at":"2026-03-01T09:30:15.250Z"}'
    )
    assert bytes(Event.objects.get(id=event.id).body) == expected
    copies = receiver.requests_to("/flaky")
    assert [c.body for c in copies] == [expected, expected]
    assert Webhook(secret).verify(copies[1].body, copies[1].headers)["amount"] == "12.50"


@pytest.mark.parametrize("number", [float("nan"), float("inf"), -float("inf")])
def test_a_payload_no_json_parser_reads_is_refused_and_writes_nothing(tenant, number):
    with pytest.raises(ValueError, match="JSON"):
        services.publish_event(tenant=tenant, event_type="t", payload={"ratio": number})
    assert not Event.objects.exists()


def test_a_body_at_the_size_limit_arrives_byte_for_byte_and_verifies(tenant, receiver, settings):
    # Bytes of every kind (the lease reads bodies in binary format), up to the limit.
    _endpoint, secret = services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    unit = "".join(chr(c) for c in range(32, 0x2FF))
    unit_bytes = len(services.encode_payload(unit)) - 2  # without the quotes
    payload = {"text": unit * ((settings.DELIVERY_MAX_PAYLOAD_BYTES - 100) // unit_bytes)}
    body = services.encode_payload(payload)
    assert (
        settings.DELIVERY_MAX_PAYLOAD_BYTES - 1024
        < len(body)
        <= (settings.DELIVERY_MAX_PAYLOAD_BYTES)
    )
    services.publish_event(tenant=tenant, event_type="t", payload=payload)

    drain()

    [request] = receiver.received
    assert request.body == body
    assert Webhook(secret).verify(request.body, request.headers) == payload


def test_a_delivery_that_fails_once_then_succeeds_keeps_its_identity(tenant, receiver):
    receiver.behaviours["/flaky"] = fail_first(1)
    _endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/flaky"))
    event = services.publish_event(tenant=tenant, event_type="t", payload={})

    drain()
    delivery = Delivery.objects.get(event=event)
    assert delivery.state == "pending"
    assert delivery.last_status_code == 500
    assert delivery.next_attempt_at > timezone.now()
    make_due()
    drain()

    delivery.refresh_from_db()
    assert delivery.state == "succeeded"
    assert delivery.attempt_count == 2
    copies = receiver.requests_to("/flaky")
    assert len(copies) == 2
    assert {c.webhook_id for c in copies} == {str(delivery.id)}
    # Each dispatch has its own outbox row; the delivery kept one identity.
    assert Outbox.objects.filter(ref_id=delivery.id).count() == 2
    outcomes = list(
        Attempt.objects.filter(delivery=delivery)
        .order_by("number")
        .values_list("number", "status_code", "outcome")
    )
    assert outcomes == [(1, 500, "retry"), (2, 200, "success")]
    assert QueueMessage.objects.count() == 0


def test_retry_after_is_honoured(tenant, receiver):
    receiver.behaviours["/busy"] = fail_first(1, status=429, headers={"Retry-After": "7"})
    services.endpoint_create(tenant=tenant, url=receiver.url("/busy"))
    event = services.publish_event(tenant=tenant, event_type="t", payload={})

    drain()

    delivery = Delivery.objects.get(event=event)
    attempt = Attempt.objects.get(delivery=delivery)
    assert delivery.state == "pending"
    # Not before 7 s after the attempt started (the first backoff step is 5 s ± 20 %).
    wait = (delivery.next_attempt_at - attempt.started_at).total_seconds()
    assert wait >= 7
    assert len(receiver.received) == 1


def test_410_kills_the_delivery_and_disables_the_endpoint(tenant, receiver):
    receiver.behaviours["/gone"] = always(410)
    endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/gone"))
    first = services.publish_event(tenant=tenant, event_type="t", payload={})

    drain()

    endpoint.refresh_from_db()
    assert Delivery.objects.get(event=first).state == "dead"
    assert Delivery.objects.get(event=first).last_outcome == "endpoint_gone"
    assert endpoint.enabled is False
    assert "410" in endpoint.disabled_reason


def test_other_4xx_is_permanent_unless_the_endpoint_retries_client_errors(tenant, receiver):
    receiver.behaviours["/bad"] = fail_first(1, status=400)
    strict, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/bad"))
    lenient, _ = services.endpoint_create(
        tenant=tenant, url=receiver.url("/bad"), retry_client_errors=True
    )
    event = services.publish_event(tenant=tenant, event_type="t", payload={})

    drain()

    assert Delivery.objects.get(event=event, endpoint=strict).state == "dead"
    assert Delivery.objects.get(event=event, endpoint=lenient).state == "pending"


def test_redirects_are_failures_and_never_followed(tenant, receiver):
    receiver.behaviours["/moved"] = always(302, {"Location": receiver.url("/ok")})
    services.endpoint_create(tenant=tenant, url=receiver.url("/moved"))
    event = services.publish_event(tenant=tenant, event_type="t", payload={})

    drain()

    delivery = Delivery.objects.get(event=event)
    assert delivery.state == "dead"
    assert delivery.last_outcome == "permanent"
    assert receiver.requests_to("/ok") == []


def test_a_loopback_endpoint_is_blocked_without_the_allow_list(tenant, receiver, settings):
    # Stored while the allow list admitted it (the services refuse it now), then the
    # allow list changed: the send-time guard is what stops it.
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    settings.EGRESS_ALLOW_NETWORKS = []
    event = services.publish_event(tenant=tenant, event_type="t", payload={})

    drain()

    delivery = Delivery.objects.get(event=event)
    attempt = Attempt.objects.get(delivery=delivery)
    assert delivery.state == "dead"
    assert attempt.outcome == "blocked"
    assert attempt.error_kind == "blocked"
    assert attempt.response_body == ""
    assert receiver.received == []


def test_the_schedule_runs_out_and_the_delivery_is_dead(tenant, receiver, settings):
    settings.DELIVERY_RETRY_SCHEDULE = [0, 0]
    receiver.behaviours["/down"] = always(503)
    services.endpoint_create(tenant=tenant, url=receiver.url("/down"))
    event = services.publish_event(tenant=tenant, event_type="t", payload={})

    drain()

    delivery = Delivery.objects.get(event=event)
    assert delivery.state == "dead"
    assert delivery.attempt_count == 3
    assert len({r.webhook_id for r in receiver.received}) == 1
    assert len(receiver.received) == 3


def test_an_endpoint_failing_past_the_window_is_disabled_and_one_success_resets(
    tenant, receiver, settings
):
    receiver.behaviours["/down"] = always(500)
    endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/down"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    drain()
    endpoint.refresh_from_db()
    assert endpoint.failing_since is not None and endpoint.enabled

    # A success clears the failure clock.
    receiver.behaviours["/down"] = always(200)
    make_due()
    drain()
    endpoint.refresh_from_db()
    assert endpoint.failing_since is None

    # Failing for longer than the window disables it.
    receiver.behaviours["/down"] = always(500)
    settings.DELIVERY_DISABLE_AFTER = 0
    services.publish_event(tenant=tenant, event_type="t", payload={})
    drain()
    services.publish_event(tenant=tenant, event_type="t", payload={})
    make_due()
    drain()
    endpoint.refresh_from_db()
    assert endpoint.enabled is False
    assert "failing" in endpoint.disabled_reason


def test_timeouts_are_ambiguous_and_retried_with_the_same_id(tenant, receiver):
    receiver.delays["/slow"] = 3
    services.endpoint_create(tenant=tenant, url=receiver.url("/slow"), timeout=0.5)
    event = services.publish_event(tenant=tenant, event_type="t", payload={})

    drain()

    delivery = Delivery.objects.get(event=event)
    attempt = Attempt.objects.get(delivery=delivery)
    assert delivery.state == "pending"
    assert attempt.error_kind == "timeout"
    assert attempt.ambiguous is True
    assert attempt.outcome == "retry"


def test_custom_headers_are_sent_but_never_logged(tenant, receiver):
    endpoint, _ = services.endpoint_create(
        tenant=tenant, url=receiver.url("/ok"), headers={"Authorization": "Bearer s3cret"}
    )
    # The services refuse a protocol header; a row can still hold one (written before).
    Endpoint.objects.filter(id=endpoint.id).update(
        headers={"Authorization": "Bearer s3cret", "webhook-id": "forged"}
    )
    event = services.publish_event(tenant=tenant, event_type="t", payload={})

    drain()

    delivery = Delivery.objects.get(event=event)
    [request] = receiver.received
    assert request.headers["authorization"] == "Bearer s3cret"
    assert request.headers["webhook-id"] == str(delivery.id)
    attempt = Attempt.objects.get(delivery=delivery)
    assert "s3cret" not in json.dumps(attempt.request_headers)


def test_a_disabled_endpoint_gets_no_request(tenant, receiver):
    endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    event = services.publish_event(tenant=tenant, event_type="t", payload={})
    Endpoint.objects.filter(id=endpoint.id).update(enabled=False)

    drain()

    delivery = Delivery.objects.get(event=event)
    assert delivery.state == "dead"
    assert delivery.last_outcome == "endpoint_disabled"
    assert receiver.received == []
