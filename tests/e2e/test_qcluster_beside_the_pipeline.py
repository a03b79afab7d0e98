"""A real django-q2 ``qcluster`` beside the real scheduler, relay and workers, on the
database broker and on Redis: deliveries arrive at their usual latency (seconds, not the
lost-dispatch sweep's ten minutes), the installed maintenance schedules run, and neither
side takes a message of the other's (a qcluster deletes what it cannot unpickle; the
workers hide what they cannot read)."""

import time
import uuid

import pytest
import redis
from django_q.models import Task

from deliveries import services
from deliveries.jobs.models import QueueMessage
from deliveries.models import Delivery
from deliveries.schedules import MAINTENANCE_SCHEDULES, install_schedules
from tests.conftest import subprocess_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

REDIS_TESTS_URL = "redis://127.0.0.1:6379/12"
DELIVERIES = 30
# Publication to arrival, with every loop idle between events: the workers wake on the
# queue's notification, so this is tens of milliseconds on an idle machine. The bound is
# for a busy 2-core one; a message a qcluster took would come back only after
# SCHEDULER_STALE_ENQUEUED_SECONDS (600 s).
LATENCY_BOUND = 5.0


@pytest.fixture(params=["database", pytest.param("redis", marks=pytest.mark.redis)])
def broker_env(request):
    if request.param == "database":
        yield {}
        return
    queue = f"qcluster-test-{uuid.uuid4().hex[:8]}"
    yield {
        "QUEUE_BROKER_CLASS": "django_q.brokers.redis_broker.Redis",
        "REDIS_URL": REDIS_TESTS_URL,
        "QUEUE_NAME": queue,
    }
    client = redis.Redis.from_url(REDIS_TESTS_URL)
    client.delete(f"django_q:{queue}:q", f"django_q:{queue}-tasks:q")


def test_a_qcluster_runs_the_schedules_beside_the_pipeline_and_takes_none_of_its_messages(
    tenant, receiver, commands, broker_env
):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    install_schedules()
    env = subprocess_env(**broker_env)
    qcluster = commands(
        "qcluster", env={**env, "DJANGO_SETTINGS_MODULE": "tests.e2e.qcluster_settings"}
    )
    loops = [commands(name, env=env) for name in ("run_scheduler", "run_relay", "run_workers")]
    # The qcluster is up once its scheduler has run the due schedules: it takes from its
    # queue from then on.
    deadline = time.monotonic() + 30
    while Task.objects.filter(group__in=MAINTENANCE_SCHEDULES).count() < 2:
        assert time.monotonic() < deadline, qcluster.output()[-3000:]
        time.sleep(0.1)

    published = {}
    for i in range(DELIVERIES):
        event = services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
        published[str(Delivery.objects.get(event=event).id)] = time.time()
        time.sleep(0.05)  # one at a time, each a message for the qcluster to get wrong
    received = receiver.wait_for(DELIVERIES, timeout=30)

    codes = [command.stop() for command in [*loops, qcluster]]
    latencies = {r.webhook_id: r.at - published[r.webhook_id] for r in received}
    print(f"latency max {max(latencies.values()):.3f} s over {len(latencies)} deliveries")
    assert sorted(latencies) == sorted(published)  # each once
    assert max(latencies.values()) < LATENCY_BOUND
    assert codes[:3] == [0, 0, 0], [c.output()[-2000:] for c in loops]
    deliveries = Delivery.objects.all()
    assert {(d.state, d.dispatch_count) for d in deliveries} == {("succeeded", 1)}
    # Both schedules ran as django-q2 tasks and succeeded; nothing failed.
    assert set(Task.objects.filter(success=True).values_list("group", flat=True)) == set(
        MAINTENANCE_SCHEDULES
    )
    assert not Task.objects.filter(success=False).exists()
    # Nothing read by the wrong side: no task the qcluster could not unpickle, no message
    # the workers could not read, and nothing left in either queue.
    assert "Failed to push task to queue" not in qcluster.output()
    assert "workers.unreadable_message" not in loops[2].output()
    assert QueueMessage.objects.count() == 0
    if broker_env:
        client = redis.Redis.from_url(REDIS_TESTS_URL)
        queue = broker_env["QUEUE_NAME"]
        assert client.llen(f"django_q:{queue}:q") == client.llen(f"django_q:{queue}-tasks:q") == 0
