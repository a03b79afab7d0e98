"""ingest.statements: each statement answers alike on both databases, including a
batch's bookkeeping and its versions' locking read, which the one-by-one path calls for
a batch of one."""

import json
import uuid
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from deliveries.jobs.models import EntityLock
from ingest.models import EntityVersion, HandlerRun, InboundEvent, Source
from ingest.receiving import NewEvent, inbound_store_many
from ingest.sources import source_create
from ingest.statements import COMPLETE, LEASE, LEASE_INLINE_BODY_BYTES, LOCK_VERSIONS, SOURCES

pytestmark = [pytest.mark.django_db, pytest.mark.sqlite]


@pytest.fixture
def events():
    source = source_create(slug="stripe", scheme="stripe", secrets=["whsec_test"])
    at = timezone.now() - timedelta(minutes=1)
    page = [NewEvent(f"evt_{i}", "invoice.paid", f"in_{i}", at, b'{"n": 1}') for i in range(2)]
    assert inbound_store_many(source=source, events=page) == (2, 0)
    return list(InboundEvent.objects.order_by("event_id"))


def lease(events, token, dispatches=None, inline_body_bytes=LEASE_INLINE_BODY_BYTES):
    with transaction.atomic():
        return LEASE(
            {
                "ids": [e.id for e in events],
                "dispatches": dispatches or [e.dispatch_count for e in events],
                "token": token,
                "until": timezone.now() + timedelta(minutes=1),
                "inline_body_bytes": inline_body_bytes,
            }
        )


def test_a_lease_returns_what_processing_reads_for_the_dispatch_named_only(events):
    first, second = events
    [row] = lease(events, uuid.uuid4(), dispatches=[1, 2])  # the second's is a stale copy
    assert row[:6] == (
        first.id, first.source_id, "evt_0", "invoice.paid", "in_0", first.occurred_at,
    )  # fmt: skip
    assert bytes(row[6]) == b'{"n": 1}'
    assert (row[7] if isinstance(row[7], dict) else json.loads(row[7])) == {}
    assert row[8] == 1  # the attempt this lease starts
    assert InboundEvent.objects.get(id=first.id).state == "processing"
    assert InboundEvent.objects.get(id=second.id).state == "enqueued"


def test_a_lease_leaves_out_a_body_over_the_inline_size(events):
    second = events[1]
    InboundEvent.objects.filter(id=second.id).update(body=b"x" * 9)
    rows = sorted(lease(events, uuid.uuid4(), inline_body_bytes=8), key=lambda r: r[2])
    assert [(r[2], None if r[6] is None else bytes(r[6])) for r in rows] == [
        ("evt_0", b'{"n": 1}'),  # 8 bytes: within
        ("evt_1", None),  # read when its event is applied
    ]


def test_a_batch_is_recorded_in_one_call_and_a_lost_lease_is_told(events):
    first, second = events
    token = uuid.uuid4()
    lease(events, token)
    now = timezone.now()
    EntityLock.objects.create(key="stripe:in_0", owner=str(token), expires_at=now)
    EntityVersion.objects.create(key="stripe:in_1", applied_at=now + timedelta(hours=1))
    params = {
        "now": now,
        "ids": [first.id, second.id],
        "states": ["processed", "skipped"],
        "token": token,
        "run_events": [first.id, second.id],
        "run_handlers": ["paid", ""],
        "run_attempts": [1, 1],
        "run_started": [now, now],
        "run_durations": [1.5, 0.0],
        "run_outcomes": ["ok", "no_handler"],
        "version_keys": ["stripe:in_0", "stripe:in_1"],
        "version_times": [first.occurred_at, second.occurred_at],
        "version_events": [first.id, second.id],
        "lock_keys": ["stripe:in_0"],
        "owner": str(token),
    }
    assert COMPLETE(params) == (2,)
    assert dict(InboundEvent.objects.values_list("event_id", "state")) == {
        "evt_0": "processed",
        "evt_1": "skipped",
    }
    assert sorted(HandlerRun.objects.values_list("handler", "outcome")) == [
        ("", "no_handler"),
        ("paid", "ok"),
    ]
    versions = dict(EntityVersion.objects.values_list("key", "event_id"))
    assert versions == {"stripe:in_0": first.id, "stripe:in_1": None}  # a newer one stays
    assert not EntityLock.objects.exists()
    assert COMPLETE(params) == (0,)  # neither is processing under this lease any more


def test_versions_are_read_in_key_order(events):
    # That they advance only forward is COMPLETE's (a newer version stays, above).
    first, _ = events
    now = timezone.now()
    for key in ("b", "a"):
        EntityVersion.objects.create(key=key, applied_at=now, event_id=first.id)
    with transaction.atomic():
        assert LOCK_VERSIONS({"keys": ["b", "a", "c"]}) == [("a", now), ("b", now)]


def test_sources_gives_what_processing_reads_of_the_sources_asked_for(events):
    source_id = events[0].source_id
    Source.objects.filter(id=source_id).update(options={"tolerance": 60})
    other = source_create(slug="github", scheme="github", secrets=["s"])
    [(found, slug, scheme, options)] = SOURCES({"ids": [source_id, other.id + 1]})
    assert (found, slug, scheme) == (source_id, "stripe", "stripe")
    assert (options if isinstance(options, dict) else json.loads(options)) == {"tolerance": 60}
