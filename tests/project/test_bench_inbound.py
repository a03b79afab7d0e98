"""bench/run.py's inbound backlog: the events stored at once, each of an entity of its
own and with its processing job, as the inbound scenario's rate assumes."""

import pytest

from bench import run
from deliveries.jobs.models import Outbox
from ingest.models import InboundEvent, Source

pytestmark = pytest.mark.django_db


def test_the_backlog_is_n_events_of_distinct_entities_each_with_its_job():
    run.store_backlog(7)

    events = InboundEvent.objects.all()
    assert events.count() == 7
    assert len({e.entity_id for e in events}) == 7
    assert {e.source.slug for e in events} == {run.INBOUND_SLUG}
    assert Outbox.objects.filter(published_at__isnull=True).count() == 7


def test_a_second_backlog_replaces_the_first_and_reuses_the_source():
    run.store_backlog(3)
    # The bench commits each step; in the test's one transaction the deferred foreign-key
    # checks of the first store must run before the second one's TRUNCATE.
    run.ob.sql("SET CONSTRAINTS ALL IMMEDIATE")
    run.store_backlog(5)

    assert InboundEvent.objects.count() == 5
    assert Source.objects.filter(slug=run.INBOUND_SLUG).count() == 1
