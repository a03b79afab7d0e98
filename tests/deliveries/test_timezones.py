"""Time zones: the service runs on UTC; a tenant's own zone turns "09:00 where the
tenant is" into a UTC instant per occurrence, right across daylight-saving changes, and
scheduled publishing (deliver_at) holds a delivery until that instant."""

import time as wallclock
from datetime import UTC, date, datetime, time, timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone
from rest_framework.test import APIClient

from deliveries import admission, services
from deliveries.core.timezones import next_local_time, validate_time_zone
from deliveries.models import Delivery, Tenant
from tests.conftest import drain

pytestmark = pytest.mark.sqlite

NINE = time(9, 0)


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


def last_sunday(year: int, month: int) -> date:
    """The EU switches clocks on the last Sunday of March and of October."""
    day = date(year, month, 31)
    return day - timedelta(days=(day.weekday() + 1) % 7)


def test_nine_in_berlin_is_eight_utc_in_winter_and_seven_in_summer():
    # Clocks go forward on 2026-03-29: the day before, 09:00 is 08:00 UTC; from that
    # day on, 07:00 UTC.
    assert next_local_time("Europe/Berlin", NINE, after=utc(2026, 3, 27, 12)) == utc(2026, 3, 28, 8)
    assert next_local_time("Europe/Berlin", NINE, after=utc(2026, 3, 28, 12)) == utc(2026, 3, 29, 7)
    # Clocks go back on 2026-10-25: 07:00 UTC the day before, 08:00 UTC that day.
    assert next_local_time("Europe/Berlin", NINE, after=utc(2026, 10, 23, 12)) == utc(
        2026, 10, 24, 7
    )
    assert next_local_time("Europe/Berlin", NINE, after=utc(2026, 10, 24, 12)) == utc(
        2026, 10, 25, 8
    )


def test_a_daily_schedule_keeps_the_local_time_across_the_change():
    after = utc(2026, 3, 26, 12)
    runs = []
    for _ in range(5):
        after = next_local_time("Europe/Berlin", NINE, after=after)
        runs.append(after)
    assert [r.hour for r in runs] == [8, 8, 7, 7, 7]
    assert [r.day for r in runs] == [27, 28, 29, 30, 31]
    assert {r.astimezone(_berlin()).time() for r in runs} == {NINE}


def _berlin():
    import zoneinfo

    return zoneinfo.ZoneInfo("Europe/Berlin")


def test_the_next_occurrence_is_strictly_later():
    at_nine = utc(2026, 3, 29, 7)
    assert next_local_time("Europe/Berlin", NINE, after=at_nine) == utc(2026, 3, 30, 7)
    assert next_local_time("UTC", NINE, after=utc(2026, 3, 29, 8, 59)) == utc(2026, 3, 29, 9)


def test_a_time_in_the_skipped_hour_moves_forward_and_a_repeated_one_happens_once():
    # 02:30 does not exist in Berlin on 2026-03-29: it runs at 03:30 CEST (01:30 UTC).
    skipped = next_local_time("Europe/Berlin", time(2, 30), after=utc(2026, 3, 28, 12))
    assert skipped == utc(2026, 3, 29, 1, 30)
    assert skipped.astimezone(_berlin()).time() == time(3, 30)
    # 02:30 happens twice on 2026-10-25: the first time (CEST, 00:30 UTC) counts, and
    # the next occurrence after it is the next day's.
    repeated = next_local_time("Europe/Berlin", time(2, 30), after=utc(2026, 10, 24, 12))
    assert repeated == utc(2026, 10, 25, 0, 30)
    assert next_local_time("Europe/Berlin", time(2, 30), after=repeated) == utc(2026, 10, 26, 1, 30)


def test_other_zones_and_directions():
    # New York moves on 2026-03-08: 09:00 EST is 14:00 UTC, 09:00 EDT is 13:00 UTC.
    assert next_local_time("America/New_York", NINE, after=utc(2026, 3, 7, 0)).hour == 14
    assert next_local_time("America/New_York", NINE, after=utc(2026, 3, 8, 0)).hour == 13
    # Sydney's summer is the other way round: 09:00 AEDT (UTC+11) until 2026-04-05.
    assert next_local_time("Australia/Sydney", NINE, after=utc(2026, 4, 3, 0)) == utc(
        2026, 4, 3, 22
    )
    assert next_local_time("Australia/Sydney", NINE, after=utc(2026, 4, 5, 0)) == utc(
        2026, 4, 5, 23
    )


def test_time_zone_names_are_validated():
    validate_time_zone("Europe/Berlin")
    validate_time_zone("UTC")
    for bad in ("Mars/Olympus_Mons", "europe/berlin", "+02:00", "", "../../etc/passwd"):
        with pytest.raises(ValidationError):
            validate_time_zone(bad)
    with pytest.raises(ValueError, match="aware"):
        next_local_time("UTC", NINE, after=datetime(2026, 1, 1))


@pytest.mark.django_db
def test_a_tenant_has_a_validated_time_zone_defaulting_to_utc():
    tenant, _ = services.tenant_create(name="plain")
    assert tenant.time_zone == "UTC"
    berlin, _ = services.tenant_create(name="berlin", time_zone="Europe/Berlin")
    berlin.refresh_from_db()
    assert berlin.time_zone == "Europe/Berlin"
    with pytest.raises(services.DomainError) as err:
        services.tenant_create(name="nowhere", time_zone="Nowhere/Land")
    assert err.value.code == "invalid_time_zone"
    assert not Tenant.objects.filter(name="nowhere").exists()
    with pytest.raises(ValidationError):
        Tenant(name="x", time_zone="Nowhere/Land").full_clean()


@pytest.mark.django_db
def test_a_naive_deliver_at_is_refused(tenant):
    with pytest.raises(services.DomainError) as err:
        services.publish_event(
            tenant=tenant,
            event_type="t",
            payload={},
            deliver_at=datetime(2030, 1, 1, 9),
        )
    assert err.value.code == "invalid_deliver_at"


@pytest.mark.django_db
def test_nine_local_is_admitted_at_its_utc_instant_on_both_sides_of_the_change(tenant):
    Tenant.objects.filter(id=tenant.id).update(time_zone="Europe/Berlin")
    tenant.refresh_from_db()
    services.endpoint_create(tenant=tenant, url="http://127.0.0.1:9/x")
    year = timezone.now().year + 1
    limits = admission.Limits(100, 100, 100)
    expected_utc_hours = []
    for switch in (last_sunday(year, 3), last_sunday(year, 10)):
        for day in (switch - timedelta(days=1), switch):
            after = datetime.combine(day - timedelta(days=1), time(12), tzinfo=UTC)
            deliver_at = next_local_time(tenant.time_zone, NINE, after=after)
            event = services.publish_event(
                tenant=tenant, event_type="daily.report", payload={}, deliver_at=deliver_at
            )
            delivery = Delivery.objects.get(event=event)
            assert delivery.next_attempt_at == deliver_at
            expected_utc_hours.append(deliver_at.hour)
            before = deliver_at - timedelta(seconds=1)
            assert admission.admit_due(now=before, page_size=100, limits=limits).admitted == 0
            assert admission.admit_due(now=deliver_at, page_size=100, limits=limits).admitted == 1
            delivery.refresh_from_db()
            assert delivery.state == "enqueued"
    # 09:00 in Berlin: 08:00 UTC in winter, 07:00 UTC in summer.
    assert expected_utc_hours == [8, 7, 7, 8]


@pytest.mark.django_db(transaction=True)
def test_a_scheduled_delivery_is_not_sent_before_its_time_but_is_sent_after(tenant, receiver):
    services.endpoint_create(tenant=tenant, url=receiver.url("/later"))
    deliver_at = timezone.now() + timedelta(seconds=1.5)
    event = services.publish_event(
        tenant=tenant, event_type="t", payload={"n": 1}, deliver_at=deliver_at
    )
    drain()
    assert receiver.requests_to("/later") == []
    assert Delivery.objects.get(event=event).state == "pending"

    deadline = wallclock.monotonic() + 10
    while timezone.now() < deliver_at and wallclock.monotonic() < deadline:
        wallclock.sleep(0.05)
    drain()

    [copy] = receiver.requests_to("/later")
    delivery = Delivery.objects.get(event=event)
    assert delivery.state == "succeeded"
    assert copy.webhook_id == str(delivery.id)
    assert copy.at >= deliver_at.timestamp()


@pytest.mark.django_db
def test_the_rest_api_takes_deliver_at():
    tenant, key = services.tenant_create(name="api", time_zone="Europe/Berlin")
    services.endpoint_create(tenant=tenant, url="http://127.0.0.1:9/x")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    when = next_local_time(tenant.time_zone, NINE, after=timezone.now())
    r = client.post(
        "/api/v1/events/",
        {"event_type": "t", "payload": {}, "deliver_at": when.isoformat()},
        format="json",
    )
    assert r.status_code == 201, r.content
    assert Delivery.objects.get(event_id=r.json()["id"]).next_attempt_at == when
    bad = client.post(
        "/api/v1/events/",
        {"event_type": "t", "payload": {}, "deliver_at": "tomorrow at nine"},
        format="json",
    )
    assert bad.status_code == 400
    assert "deliver_at" in bad.json()["error"]["details"]
