"""Time-ordered ids (UUID version 7) for the rows written at volume, made in Python and in
PostgreSQL with the same layout."""

import time
import uuid

import pytest
from django.db import connection

from deliveries import services
from deliveries.core.ids import UUID7_SQL, uuid7
from deliveries.models import Delivery
from ingest.models import InboundEvent
from ingest.receiving import NewEvent, inbound_store_many
from ingest.sources import source_create
from tests.ingest.test_receive import SECRET, post, stripe_event


def unix_ms(value: uuid.UUID) -> int:
    return value.int >> 80


def assert_version_7(value: uuid.UUID, *, not_before_ms: int, not_after_ms: int) -> None:
    assert value.version == 7, value
    assert value.variant == uuid.RFC_4122, value
    assert not_before_ms <= unix_ms(value) <= not_after_ms, value


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_uuid7_carries_the_time_and_sorts_by_it():
    before = now_ms()
    first = [uuid7() for _ in range(1000)]
    time.sleep(0.002)
    second = [uuid7() for _ in range(1000)]
    after = now_ms()

    for value in first + second:
        assert_version_7(value, not_before_ms=before, not_after_ms=after)
    assert len(set(first + second)) == 2000
    # Ids of a later millisecond sort after every id of an earlier one, as UUIDs and as
    # the text receivers see.
    assert max(first) < min(second)
    assert max(map(str, first)) < min(map(str, second))


@pytest.mark.django_db
def test_the_sql_expression_makes_the_same_layout():
    before = now_ms()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {UUID7_SQL} FROM generate_series(1, 1000)")
        values = [row[0] for row in cursor.fetchall()]
    after = now_ms()

    assert len(set(values)) == 1000
    for value in values:
        assert_version_7(value, not_before_ms=before, not_after_ms=after)


@pytest.mark.django_db(transaction=True)
def test_published_events_and_their_deliveries_get_time_ordered_ids(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/a")
    make_endpoint("http://127.0.0.1:9/b")
    before = now_ms()
    first = services.publish_event(tenant=tenant, event_type="t", payload={"n": 1})
    time.sleep(0.002)
    second = services.publish_event(tenant=tenant, event_type="t", payload={"n": 2})
    after = now_ms()

    for event in (first, second):
        assert_version_7(event.id, not_before_ms=before, not_after_ms=after)
        ids = list(Delivery.objects.filter(event=event).values_list("id", flat=True))
        assert len(ids) == 2
        for value in ids:
            assert_version_7(value, not_before_ms=before, not_after_ms=after)
    assert first.id < second.id
    assert max(Delivery.objects.filter(event=first).values_list("id", flat=True)) < min(
        Delivery.objects.filter(event=second).values_list("id", flat=True)
    )


@pytest.mark.django_db(transaction=True)
def test_inbound_events_get_time_ordered_ids_received_or_stored_in_pages():
    source = source_create(slug="stripe", scheme="stripe", secrets=[SECRET])
    before = now_ms()
    assert post(stripe_event("evt_received")).status_code == 200
    inbound_store_many(
        source=source,
        events=[
            NewEvent(
                event_id=f"evt_{i}", event_type="t", entity_id="", occurred_at=None, body=b"{}"
            )
            for i in range(3)
        ],
    )
    after = now_ms()

    ids = list(InboundEvent.objects.values_list("id", flat=True))
    assert len(ids) == 4
    for value in ids:
        assert_version_7(value, not_before_ms=before, not_after_ms=after)
