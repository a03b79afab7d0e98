"""The database broker's take: the committed outbox row is the queue entry. Workers claim
outbox rows directly, with no relay, and the claim records their publication in the
transaction that leases the deliveries. The crash boundaries of that take, in the style
of test_crash_boundaries.py: the real ``run_workers`` killed at a named point, then the
pipeline runs on with no relay at all."""

import uuid

import pytest
from django.db import transaction
from django.utils import timezone

from deliveries import services
from deliveries.jobs.brokers.database import DatabaseBroker
from deliveries.jobs.loop import start_run
from deliveries.jobs.models import Outbox, QueueMessage
from deliveries.jobs.outbox import outbox_write
from deliveries.jobs.relay import relay_tick
from deliveries.models import Attempt, Delivery
from deliveries.scheduler import scheduler_tick
from deliveries.selectors import delivery_explain
from tests.conftest import make_due, run_workers
from tests.deliveries.test_crash_boundaries import (
    assert_one_terminal_delivery,
    crash,
    time_passes,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


@pytest.fixture
def published(tenant, receiver):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    event = services.publish_event(tenant=tenant, event_type="t", payload={"n": 1})
    return Delivery.objects.get(event=event)


def drain_without_relay(rounds: int = 20) -> None:
    """Scheduler and workers in turn, no relay, until nothing is due or in flight now."""
    for _ in range(rounds):
        scheduler_tick()
        run_workers()
        if scheduler_tick().idle:
            return
    raise AssertionError("the pipeline did not drain")


def test_workers_deliver_from_the_outbox_with_no_relay(published, receiver):
    scheduler_tick()
    outbox = Outbox.objects.get(ref_id=published.id)
    assert outbox.published_at is None

    counts = run_workers(lanes=1)

    assert counts["messages"] == 1
    outbox.refresh_from_db()
    assert outbox.published_at is not None  # the claim recorded the publication
    assert_one_terminal_delivery(published, receiver, copies=1)


@pytest.mark.slow
def test_an_unclaimed_row_waits_for_a_worker(published):
    scheduler_tick()
    published.refresh_from_db()
    stalled = delivery_explain(published)
    assert stalled.kind == "stalled"
    assert stalled.sentence.endswith("but none is running: start run_workers.")
    start_run("workers")  # a running loop: fresh heartbeat
    waiting = delivery_explain(published)
    assert waiting.kind == "outbox"
    assert "waiting for a worker." in waiting.sentence


@pytest.mark.slow
def test_worker_killed_between_the_claim_and_its_commit_changes_nothing(published, receiver):
    scheduler_tick()
    crash("run_workers", "--once", "--lanes", "1", point="worker.before_take_commit")

    # The claim and the lease rolled back together: the row is unclaimed, the delivery
    # enqueued, and nothing to wait out.
    outbox = Outbox.objects.get(ref_id=published.id)
    assert outbox.published_at is None and outbox.claimed_until is None
    published.refresh_from_db()
    assert published.state == "enqueued" and published.attempt_count == 0
    assert receiver.received == []
    assert run_workers(lanes=1)["messages"] == 1

    assert Attempt.objects.filter(delivery=published).count() == 1
    assert_one_terminal_delivery(published, receiver, copies=1)


@pytest.mark.slow
def test_worker_killed_after_the_claim_committed_leaves_a_lease_to_run_out(published, receiver):
    scheduler_tick()
    crash("run_workers", "--once", "--lanes", "1", point="worker.after_lease")

    published.refresh_from_db()
    assert published.state == "leased"
    assert Outbox.objects.get(ref_id=published.id).published_at is not None
    assert receiver.received == []
    # The claim is the only entry there was: no second copy anywhere, and while the
    # lease holds nobody sends the delivery.
    assert QueueMessage.objects.count() == 0
    assert run_workers()["messages"] == 0
    assert scheduler_tick().counts["lease_expired"] == 0

    time_passes()
    drain_without_relay()  # the scheduler expires the lease; a new dispatch, a new row
    make_due()
    drain_without_relay()

    published.refresh_from_db()
    assert published.lease_expiries == 1
    assert Outbox.objects.filter(ref_id=published.id, published_at__isnull=True).count() == 0
    assert_one_terminal_delivery(published, receiver, copies=1)


def test_a_relay_run_beside_the_workers_still_gets_its_messages_delivered(tenant, receiver):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    for n in range(3):
        services.publish_event(tenant=tenant, event_type="t", payload={"n": n})
    scheduler_tick()
    assert relay_tick().counts["published"] == 3  # onto the queue table
    for n in range(3, 5):
        services.publish_event(tenant=tenant, event_type="t", payload={"n": n})
    scheduler_tick()

    # One take: the two outbox rows claimed, the relay's three messages fill the batch.
    assert run_workers(lanes=1, batch_size=10)["messages"] == 5

    assert QueueMessage.objects.count() == 0
    assert not Outbox.objects.filter(published_at__isnull=True).exists()
    assert Delivery.objects.filter(state="succeeded").count() == 5
    seen = receiver.requests_to("/ok")
    assert len(seen) == 5
    assert len({r.webhook_id for r in seen}) == 5


def _outbox_rows(*rows: tuple[str, int]) -> dict:
    """Outbox rows of (kind, priority), one a second apart, oldest first; by message key."""
    now = timezone.now()
    written = {}
    for i, (kind, priority) in enumerate(rows):
        job_id = uuid.uuid4()
        (row,) = outbox_write(
            kind=kind, jobs=[(job_id, 1, priority)], now=now + timezone.timedelta(seconds=i)
        )
        written[job_id] = row
    return written


def test_the_take_claims_by_priority_then_age_only_the_kinds_it_is_asked_for():
    rows = _outbox_rows(("delivery", 0), ("delivery", 5), ("inbound", 0), ("other", 9))
    ids = list(rows)
    b = DatabaseBroker(list_key="pipeline")

    with transaction.atomic():
        taken, queued = b.take(2, kinds=["delivery", "inbound"])
    assert queued == []
    assert [(m.job_id, m.kind, m.priority) for m in taken] == [
        (ids[1], "delivery", 5),
        (ids[0], "delivery", 0),
    ]
    with transaction.atomic():
        taken, _ = b.take(10, kinds=["delivery", "inbound"])
    assert [(m.job_id, m.kind, m.dispatch) for m in taken] == [(ids[2], "inbound", 1)]

    at = dict(Outbox.objects.values_list("ref_id", "published_at"))
    assert all(at[i] is not None for i in ids[:3])
    assert at[ids[3]] is None  # a kind nobody asked for waits for a worker that knows it
    with transaction.atomic():
        assert b.take(10, kinds=["delivery", "inbound"]) == ([], [])


def test_a_take_that_rolls_back_leaves_the_rows_unclaimed():
    (job_id,) = _outbox_rows(("delivery", 0))
    b = DatabaseBroker(list_key="pipeline")

    with pytest.raises(RuntimeError, match="inside a transaction"):
        b.take(1, kinds=["delivery"])

    class Abandon(Exception):
        pass

    with pytest.raises(Abandon), transaction.atomic():
        assert [m.job_id for m in b.take(1, kinds=["delivery"])[0]] == [job_id]
        raise Abandon
    assert Outbox.objects.get().published_at is None
    with transaction.atomic():
        assert [m.job_id for m in b.take(1, kinds=["delivery"])[0]] == [job_id]


def test_a_row_a_relay_holds_a_claim_on_is_not_taken_until_the_claim_runs_out():
    (job_id,) = _outbox_rows(("delivery", 0))
    Outbox.objects.update(claimed_until=timezone.now() + timezone.timedelta(seconds=30))
    b = DatabaseBroker(list_key="pipeline")

    with transaction.atomic():
        assert b.take(1, kinds=["delivery"]) == ([], [])
    time_passes()
    with transaction.atomic():
        assert [m.job_id for m in b.take(1, kinds=["delivery"])[0]] == [job_id]
