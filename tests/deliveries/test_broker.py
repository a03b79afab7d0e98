"""The queue transports: the database broker's batch claim and visibility timeout, and
django-q2's Redis broker driving the same pipeline."""

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.conf import Conf
from django_q.signing import SignedPackage
from django_q.tasks import async_task

from deliveries import services, state
from deliveries.jobs import brokers as broker
from deliveries.jobs.brokers import Message
from deliveries.jobs.brokers.database import DatabaseBroker
from deliveries.jobs.brokers.redis import RedisBroker as Redis
from deliveries.jobs.models import QueueMessage
from deliveries.jobs.relay import relay_tick
from deliveries.models import Delivery
from deliveries.scheduler import scheduler_tick
from tests.conftest import drain, run_workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


def test_database_broker_hands_each_message_to_one_consumer_until_it_times_out(settings):
    settings.QUEUE_VISIBILITY_TIMEOUT = 60
    b = DatabaseBroker(list_key="t")
    ids = b.enqueue_many(["a", "b", "c"], priorities=[0, 5, 0])

    first = b.dequeue(2)
    second = b.dequeue(10)
    assert [p for _, p in first] == ["b", "a"]  # priority first, then age
    assert [p for _, p in second] == ["c"]
    assert b.dequeue(10) == []
    assert b.queue_size() == 0 and b.lock_size() == 3

    # Unacknowledged messages come back after the visibility timeout.
    QueueMessage.objects.filter(id__in=ids[:2]).update(visible_at=timezone.now())
    again = b.dequeue(10)
    assert sorted(p for _, p in again) == ["a", "b"]
    assert QueueMessage.objects.get(payload="a").receives == 2

    b.acknowledge_many([i for i, _ in again + second])
    assert QueueMessage.objects.count() == 0


def test_a_take_spends_some_messages_and_hides_the_rest_in_the_callers_transaction(settings):
    settings.QUEUE_VISIBILITY_TIMEOUT = 60
    b = DatabaseBroker(list_key="take")
    ids = b.enqueue_many(["spent", "hidden", "left"], priorities=[0, 0, 0])

    with pytest.raises(RuntimeError, match="inside a transaction"):
        b.lock(10)
    with transaction.atomic():
        taken = b.lock(2)
        assert [p for _, p in taken] == ["spent", "hidden"]
        b.settle(spent=[ids[0]], hidden=[ids[1]])

    assert dict(QueueMessage.objects.values_list("payload", "receives")) == {
        "hidden": 1,
        "left": 0,
    }
    assert b.queue_size() == 1 and b.lock_size() == 1
    assert [p for _, p in b.dequeue(10)] == ["left"]


def test_a_take_that_rolls_back_leaves_its_messages_visible_at_once():
    b = DatabaseBroker(list_key="rollback")
    b.enqueue_many(["a", "b"], priorities=[0, 0])

    with pytest.raises(RuntimeError, match="died"), transaction.atomic():
        b.settle(spent=[i for i, _ in b.lock(1)], hidden=[])
        raise RuntimeError("the worker died before its lease committed")

    assert sorted(QueueMessage.objects.values_list("payload", flat=True)) == ["a", "b"]
    assert b.queue_size() == 2


def test_takes_in_two_transactions_at_once_never_share_a_message():
    """A take holds its messages locked until it commits: a second take meanwhile skips
    them (SKIP LOCKED on PostgreSQL; on SQLite the IMMEDIATE transaction waits)."""
    if connection.vendor != "postgresql":
        pytest.skip("SKIP LOCKED is PostgreSQL's")
    b = DatabaseBroker(list_key="concurrent")
    b.enqueue_many(["a", "b", "c"], priorities=[0, 0, 0])
    with transaction.atomic():
        first = b.lock(2)
        other = ThreadPoolExecutor(1).submit(_take_in_a_thread, b)
        second = other.result(timeout=30)
        b.settle(spent=[i for i, _ in first], hidden=[])
    assert [p for _, p in first] == ["a", "b"]
    assert [p for _, p in second] == ["c"]
    assert list(QueueMessage.objects.values_list("payload", flat=True)) == ["c"]


def _take_in_a_thread(b: DatabaseBroker) -> list:
    try:
        return b.dequeue(10)
    finally:
        connection.close()


def test_database_broker_stores_payloads_byte_for_byte_in_order():
    """The batch enqueue sends its payloads as one JSON array: quotes, backslashes,
    braces, commas, control characters and non-ASCII text come back unchanged, each
    with its own priority, ids in the order given."""
    payloads = ['{"a": "b"}', 'back\\slash "quoted"', "{1,2}", "tab\tnew\nline", "naïve ✓", ""]
    b = DatabaseBroker(list_key="bytes")
    ids = b.enqueue_many(payloads, priorities=[1, 2, 3, 4, 5, 6])

    assert ids == sorted(ids)
    stored = dict(QueueMessage.objects.filter(id__in=ids).values_list("id", "payload"))
    priorities = dict(QueueMessage.objects.filter(id__in=ids).values_list("id", "priority"))
    assert [stored[i] for i in ids] == payloads
    assert [priorities[i] for i in ids] == [1, 2, 3, 4, 5, 6]


def test_messages_round_trip():
    m = Message(uuid.uuid4(), 3, priority=2)
    assert Message.decode(m.encode()) == m
    assert Message.decode(m.encode().encode()) == m


@pytest.fixture
def redis_broker():
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail("the local Redis server is not running (make test expects it)")
    b = Redis(list_key=f"test-{uuid.uuid4().hex}")
    yield b
    b.delete_queue()


@pytest.mark.redis
def test_the_pipeline_runs_on_django_q2_redis_broker(tenant, receiver, redis_broker):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    for i in range(5):
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i})

    scheduler_tick()
    assert relay_tick(b=redis_broker).counts["published"] == 5
    assert redis_broker.queue_size() == 5
    assert QueueMessage.objects.count() == 0  # nothing went through the database queue
    counts = run_workers(queue=redis_broker, lanes=1)

    assert counts["succeeded"] == 5
    assert Delivery.objects.filter(state="succeeded").count() == 5
    assert len({r.webhook_id for r in receiver.received}) == 5
    assert redis_broker.queue_size() == 0


@pytest.mark.redis
def test_on_the_redis_broker_a_message_for_a_paused_endpoint_is_spent_unsent(
    tenant, receiver, redis_broker
):
    """Enqueued before the pause, taken after it: the delivery goes back to pending
    unattempted, and its message is used up, not left to come round again."""
    endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    relay_tick(b=redis_broker)
    services.endpoint_pause(endpoint=endpoint)

    assert run_workers(queue=redis_broker, lanes=1)["messages"] == 1
    assert redis_broker.queue_size() == 0
    d = Delivery.objects.get()
    assert (d.state, d.attempt_count, receiver.received) == ("pending", 0, [])

    services.endpoint_resume(endpoint=endpoint)
    scheduler_tick()
    relay_tick(b=redis_broker)
    run_workers(queue=redis_broker, lanes=1)
    d.refresh_from_db()
    assert (d.state, d.attempt_count, d.dispatch_count) == ("succeeded", 1, 2)
    assert [r.webhook_id for r in receiver.received] == [str(d.id)]


@pytest.mark.redis
def test_the_redis_broker_publishes_a_page_and_hands_out_batches_in_order(redis_broker):
    messages = [Message(uuid.uuid4(), 1) for _ in range(5)]
    broker.publish(redis_broker, messages)
    assert redis_broker.queue_size() == 5

    first = broker.receive(redis_broker, 3)
    second = broker.receive(redis_broker, 10)

    # A batch, not django-q2's one message per dequeue; oldest first; each message once.
    assert [Message.decode(p) for _, p in first] == messages[:3]
    assert [Message.decode(p) for _, p in second] == messages[3:]
    assert redis_broker.queue_size() == 0
    broker.publish(redis_broker, [])  # an empty page is not an error
    assert redis_broker.queue_size() == 0


@pytest.mark.redis
def test_a_message_the_redis_broker_lost_is_recovered_by_the_scheduler(
    tenant, receiver, redis_broker
):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    relay_tick(b=redis_broker)
    # A worker popped it and died: django-q2's Redis broker has no acknowledgement.
    assert broker.receive(redis_broker, 10)
    assert run_workers(queue=redis_broker, lanes=1)["messages"] == 0

    Delivery.objects.update(enqueued_at=timezone.now() - timezone.timedelta(hours=1))
    assert scheduler_tick().counts["transport_lost"] == 1
    relay_tick(b=redis_broker)
    run_workers(queue=redis_broker, lanes=1)

    d = Delivery.objects.get()
    assert d.state == "succeeded" and d.dispatch_count == 2
    assert [r.webhook_id for r in receiver.received] == [str(d.id)]


def test_messages_carry_the_format_version_and_read_every_version_still_queued():
    job = uuid.uuid4()
    data = json.loads(
        Message(job, 1, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01").encode()
    )
    assert data["v"] == broker.MESSAGE_VERSION == 2
    # Version 1, written by the release before message versions: no "v", no "tp".
    old = Message.decode(json.dumps({"d": job.hex, "n": 4, "p": 1}))
    assert (old.job_id, old.dispatch, old.priority, old.kind, old.version) == (
        job,
        4,
        1,
        "delivery",
        1,
    )
    assert old.traceparent == ""
    inbound = Message.decode(json.dumps({"d": job.hex, "n": 1, "k": "inbound"}))
    assert inbound.kind == "inbound"
    for unreadable in ('{"v": 99, "d": "x", "n": 1}', "not json", '{"v": 2, "n": 1}', "[]"):
        with pytest.raises(broker.UnreadableMessage):
            Message.decode(unreadable)


def test_a_version_1_message_still_in_the_queue_is_delivered(tenant, receiver):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    delivery = Delivery.objects.get()
    # What the previous release's relay wrote for this dispatch.
    DatabaseBroker(list_key=settings.QUEUE_NAME).enqueue(
        json.dumps({"d": delivery.id.hex, "n": delivery.dispatch_count, "p": 0})
    )

    counts = run_workers()

    assert counts["succeeded"] == 1
    assert [r.webhook_id for r in receiver.received] == [str(delivery.id)]
    assert QueueMessage.objects.count() == 0


def test_a_message_from_a_newer_release_is_left_for_it_and_its_delivery_recovered(
    tenant, receiver, caplog
):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    relay_tick()
    delivery = Delivery.objects.get()
    # A rollback left the delivery's message in a format this release cannot read: it
    # is the only one there is (the outbox row is published).
    QueueMessage.objects.all().delete()
    DatabaseBroker(list_key=settings.QUEUE_NAME).enqueue(
        json.dumps({"v": 3, "d": delivery.id.hex, "n": delivery.dispatch_count})
    )

    run_workers()

    assert receiver.received == []
    assert QueueMessage.objects.get().receives == 1  # not acknowledged: not lost
    assert any(getattr(r, "action", "") == "workers.unreadable_message" for r in caplog.records)
    # The lost-dispatch sweep re-dispatches the delivery in this release's format.
    state.recover_lost_dispatches(now=timezone.now(), older_than=0, limit=10)
    drain()
    delivery.refresh_from_db()
    assert delivery.state == "succeeded"
    assert delivery.dispatch_count == 2  # the sweep's dispatch, not the first one
    assert [r.webhook_id for r in receiver.received] == [str(delivery.id)]


def test_a_workers_take_spends_what_it_can_handle_and_hides_the_rest(tenant, receiver):
    """With the database broker a worker's take deletes the messages it handles (its
    deliveries, leased in the same transaction, and registered job kinds) and hides,
    unacknowledged, those it cannot read or whose kind it does not know."""
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    relay_tick()
    b = DatabaseBroker(list_key=settings.QUEUE_NAME)
    b.enqueue_many(
        [Message(uuid.uuid4(), 1, kind="from-the-future").encode(), "not a message"],
        priorities=[0, 0],
    )

    counts = run_workers()

    assert counts["succeeded"] == 1
    left = dict(QueueMessage.objects.values_list("payload", "receives"))
    assert len(left) == 2 and set(left.values()) == {1}  # taken once, not acknowledged
    assert "not a message" in left
    assert [Message.decode(p).kind for p in left if p != "not a message"] == ["from-the-future"]
    assert b.queue_size() == 0  # hidden for the visibility timeout


REDIS_TESTS_URL = "redis://127.0.0.1:6379/12"


@pytest.fixture(params=["database", pytest.param("redis", marks=pytest.mark.redis)])
def both_brokers(request, monkeypatch, settings):
    """The pipeline's broker and django-q2's (what a qcluster reads), on the database
    broker and on django-q2's Redis broker: the configured class, as both sides get it."""
    if request.param == "redis":
        monkeypatch.setattr(Conf, "BROKER_CLASS", "django_q.brokers.redis_broker.Redis")
        monkeypatch.setattr(Conf, "REDIS", REDIS_TESTS_URL)
        settings.QUEUE_BROKER_CLASS = "deliveries.jobs.brokers.redis.RedisBroker"
    pipeline, tasks = broker.get_broker(), get_broker()
    yield pipeline, tasks
    pipeline.purge_queue()
    tasks.purge_queue()


def test_the_pipeline_and_django_q2_never_read_each_others_messages(tenant, both_brokers):
    pipeline, tasks = both_brokers
    services.endpoint_create(tenant=tenant, url="http://127.0.0.1:9/x")
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    relay_tick(b=pipeline)
    # What a qcluster's scheduler enqueues for a schedule, on django-q2's default broker.
    task_id = async_task("deliveries.schedules.alerts_pass", broker=tasks)

    assert pipeline.list_key != tasks.list_key
    taken = broker.receive(pipeline, 10)
    assert [Message.decode(p).job_id for _, p in taken] == [Delivery.objects.get().id]
    pulled = tasks.dequeue()
    assert [SignedPackage.loads(p)["id"] for _, p in pulled] == [task_id]
    assert broker.receive(pipeline, 10) == [] and not tasks.dequeue()


def test_django_q2s_pusher_waits_its_poll_interval_on_an_empty_queue_and_workers_never(
    monkeypatch,
):
    # django-q2's pusher calls dequeue() in a loop with no limit; the workers pass theirs.
    monkeypatch.setattr(Conf, "POLL", 1.0)
    b = DatabaseBroker(list_key="idle")

    began = time.monotonic()
    assert b.dequeue() == []
    pusher_waited = time.monotonic() - began
    began = time.monotonic()
    assert b.dequeue(10) == []
    worker_waited = time.monotonic() - began

    assert pusher_waited >= 1.0
    assert worker_waited < 1.0
