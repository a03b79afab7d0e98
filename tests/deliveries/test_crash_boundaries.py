"""The crash boundaries of docs/architecture.md: the real commands are killed (os._exit, as kill -9)
at each named point, then the pipeline runs on. Each test ends with one terminal logical
delivery, and every copy the receiver saw carries the same webhook-id."""

import uuid

import pytest
from django.utils import timezone
from django_q.brokers.redis_broker import Redis

from deliveries import services
from deliveries.jobs.faults import CRASH_EXIT_CODE
from deliveries.jobs.models import Outbox, QueueMessage
from deliveries.jobs.relay import relay_tick
from deliveries.models import Attempt, Delivery, Event
from deliveries.scheduler import scheduler_tick
from tests.conftest import drain, make_due, manage, run_workers, subprocess_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.sqlite]


@pytest.fixture
def published(tenant, receiver):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    event = services.publish_event(tenant=tenant, event_type="t", payload={"n": 1})
    return Delivery.objects.get(event=event)


def crash(*command: str, point: str, redis_queue: str = "") -> None:
    """Run a command until it dies at ``point``; on that Redis queue, if one is named."""
    extra = {}
    if redis_queue:
        extra = {"QUEUE_BROKER_CLASS": f"{Redis.__module__}.Redis", "QUEUE_NAME": redis_queue}
    result = manage(*command, env=subprocess_env(FAULT_INJECT_AT=point, **extra))
    assert result.returncode == CRASH_EXIT_CODE, result.stderr


def time_passes() -> None:
    """The test's clock: every lease, claim and visibility timeout runs out."""
    past = timezone.now() - timezone.timedelta(seconds=1)
    Delivery.objects.filter(state="leased").update(lease_until=past)
    Outbox.objects.filter(published_at__isnull=True).update(claimed_until=past)
    QueueMessage.objects.update(visible_at=past)


def assert_one_terminal_delivery(delivery, receiver, copies):
    delivery.refresh_from_db()
    assert delivery.state == "succeeded"
    assert Delivery.objects.count() == 1
    seen = receiver.requests_to("/ok")
    assert len(seen) == copies
    assert {r.webhook_id for r in seen} == {str(delivery.id)}
    assert QueueMessage.objects.count() == 0


def test_a_process_killed_before_the_publish_commits_leaves_nothing(tenant, receiver):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    code = (
        "import os; from django.db import transaction; "
        "from deliveries.services import publish_event; from deliveries.models import Tenant\n"
        "with transaction.atomic():\n"
        "    publish_event(tenant=Tenant.objects.get(), event_type='t', payload={})\n"
        "    os._exit(137)\n"
    )
    result = manage("shell", "-c", code, env=subprocess_env())
    assert result.returncode == 137, result.stderr
    assert Event.objects.count() == 0
    assert Delivery.objects.count() == 0
    drain()
    assert receiver.received == []


# With the database broker (the default) the relay takes, publishes and marks a page in
# one transaction: a relay killed at either of its points leaves the page as it was.


def test_relay_killed_after_the_outbox_commit_before_publication(published, receiver):
    scheduler_tick()
    crash("run_relay", "--once", point="relay.before_publish")

    outbox = Outbox.objects.get(ref_id=published.id)
    assert outbox.published_at is None and outbox.claimed_until is None
    assert QueueMessage.objects.count() == 0
    # Nothing to wait out: the next relay publishes the row at once.
    assert relay_tick().counts["published"] == 1
    drain()

    assert_one_terminal_delivery(published, receiver, copies=1)


def test_relay_killed_after_publication_before_it_is_recorded(published, receiver):
    scheduler_tick()
    crash("run_relay", "--once", point="relay.after_publish")

    # The publication rolled back with the record of it: no copy on the queue.
    assert QueueMessage.objects.count() == 0
    outbox = Outbox.objects.get(ref_id=published.id)
    assert outbox.published_at is None and outbox.claimed_until is None
    assert relay_tick().counts["published"] == 1
    assert QueueMessage.objects.count() == 1
    drain()

    assert Attempt.objects.filter(delivery=published).count() == 1
    assert_one_terminal_delivery(published, receiver, copies=1)


# With a broker outside the database, publication and its record cannot share a
# transaction: the relay claims the page, publishes, then marks it published.


@pytest.fixture
def redis_queue():
    """django-q2's Redis broker on a queue of this test's own (``QUEUE_NAME``), as the
    commands build it."""
    name = f"test-{uuid.uuid4().hex}"
    b = Redis(list_key=name)
    b.name = name
    yield b
    b.delete_queue()


@pytest.mark.redis
def test_relay_on_redis_killed_before_publication_leaves_a_claim(published, receiver, redis_queue):
    scheduler_tick()
    crash("run_relay", "--once", point="relay.before_publish", redis_queue=redis_queue.name)

    outbox = Outbox.objects.get(ref_id=published.id)
    assert outbox.published_at is None and outbox.claimed_until is not None
    assert redis_queue.queue_size() == 0
    # Another relay cannot take the claimed rows until the claim runs out.
    assert relay_tick(b=redis_queue).counts["published"] == 0
    time_passes()
    assert relay_tick(b=redis_queue).counts["published"] == 1
    run_workers(queue=redis_queue, lanes=1)

    assert_one_terminal_delivery(published, receiver, copies=1)


@pytest.mark.redis
def test_relay_on_redis_killed_after_publication_publishes_again(published, receiver, redis_queue):
    scheduler_tick()
    crash("run_relay", "--once", point="relay.after_publish", redis_queue=redis_queue.name)

    assert redis_queue.queue_size() == 1
    assert Outbox.objects.get(ref_id=published.id).published_at is None
    time_passes()
    assert relay_tick(b=redis_queue).counts["published"] == 1
    assert redis_queue.queue_size() == 2
    run_workers(queue=redis_queue, lanes=1)

    # The relay published the message twice; the lease guard made it one attempt.
    assert Attempt.objects.filter(delivery=published).count() == 1
    assert_one_terminal_delivery(published, receiver, copies=1)
    assert redis_queue.queue_size() == 0


def test_worker_killed_after_the_receiver_accepted_before_success_is_recorded(published, receiver):
    scheduler_tick()
    relay_tick()
    crash("run_workers", "--once", "--lanes", "1", point="worker.after_send")

    published.refresh_from_db()
    assert published.state == "leased"
    assert len(receiver.requests_to("/ok")) == 1
    time_passes()
    drain()  # the scheduler expires the lease: pending, waiting a backoff step
    make_due()
    drain()

    published.refresh_from_db()
    assert published.lease_expiries == 1
    # The receiver got the same webhook-id twice: its idempotency key makes that safe.
    assert_one_terminal_delivery(published, receiver, copies=2)
    assert list(Attempt.objects.filter(delivery=published).values_list("number", flat=True)) == [2]


def test_worker_killed_during_a_lease_before_sending(published, receiver):
    scheduler_tick()
    relay_tick()
    crash("run_workers", "--once", "--lanes", "1", point="worker.after_lease")

    published.refresh_from_db()
    assert published.state == "leased"
    assert receiver.received == []
    # The take spent the message with the lease: the lease is the only record left, and
    # while it holds nobody sends the delivery.
    assert QueueMessage.objects.count() == 0
    assert run_workers()["messages"] == 0
    assert scheduler_tick().counts["lease_expired"] == 0
    assert receiver.received == []

    time_passes()
    drain()
    make_due()
    drain()

    assert_one_terminal_delivery(published, receiver, copies=1)
