"""inbound_event_stored: once per stored event, after commit; not for copies, rejected
bodies or a rolled-back poll page."""

import pytest
from django.db import transaction

from ingest.models import InboundEvent
from ingest.receiving import NewEvent, inbound_store_many
from ingest.signals import inbound_event_stored
from tests.ingest.test_receive import post, stripe_event

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


@pytest.fixture
def stored():
    seen: list = []

    def record(sender, instance, **kwargs):
        seen.append(instance)

    inbound_event_stored.connect(record, weak=False)
    yield seen
    inbound_event_stored.disconnect(record)


def test_a_received_event_is_announced_once_and_its_copies_not_at_all(stripe, stored):
    for _ in range(3):
        assert post(stripe_event("evt_1")).status_code == 200
    assert post(b"not json").status_code == 400  # stored as rejected, not announced
    [event] = stored
    assert (event.event_id, event.state) == ("evt_1", "enqueued")
    assert InboundEvent.objects.count() == 2


def test_a_polled_page_is_announced_after_its_commit_and_not_on_rollback(stripe, stored):
    page = [NewEvent(f"rec_{i}", "record.updated", f"r{i}", None, b"{}") for i in range(3)]
    with transaction.atomic():
        assert inbound_store_many(source=stripe, events=page) == (3, 0)
        assert stored == []
    assert sorted(e.event_id for e in stored) == ["rec_0", "rec_1", "rec_2"]

    later = [NewEvent("rec_9", "record.updated", "r9", None, b"{}"), page[0]]
    with pytest.raises(RuntimeError), transaction.atomic():
        assert inbound_store_many(source=stripe, events=later) == (1, 1)
        raise RuntimeError("the cursor write failed")
    assert len(stored) == 3
    assert not InboundEvent.objects.filter(event_id="rec_9").exists()
