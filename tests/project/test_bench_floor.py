"""bench/floor.py, the throughput benchmark's statements floor, does the service's work:
the same rows end in the same states, with the same evidence, and the receiver gets the
same signed requests. Otherwise its ratio to the bare loop would not bound the service's."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from standardwebhooks.webhooks import Webhook

from deliveries import services
from deliveries.jobs.models import Outbox, QueueMessage
from deliveries.models import Attempt, Delivery, EndpointSecret
from tests.conftest import subprocess_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EVENTS = 40


@pytest.mark.parametrize("worker_options", [[], ["--egress", "--db-thread"]])
def test_the_floor_leaves_what_the_service_leaves(tenant, receiver, worker_options):
    endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/floor"))
    secret = EndpointSecret.objects.get(endpoint=endpoint).secret
    for i in range(EVENTS):
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
    ids = {str(i) for i in Delivery.objects.values_list("id", flat=True)}
    assert len(ids) == EVENTS
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "floor.py"), *role],
            env=subprocess_env(),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for role in (
            ["scheduler"],
            ["worker", "--lanes", "2", "--batch", "8", *worker_options],
        )
    ]
    try:
        deadline = time.monotonic() + 60
        while Delivery.objects.filter(state="succeeded").count() < EVENTS:
            for p in procs:
                assert p.poll() is None, p.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the floor did not drain"
            time.sleep(0.1)
    finally:
        hung = []
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                hung.append(p.args[2])
    assert not hung, f"{hung} did not stop within 10 s of SIGTERM"

    deliveries = Delivery.objects.filter(event__tenant=tenant)
    assert {str(d.id) for d in deliveries} == ids
    assert all(
        d.state == "succeeded" and d.attempt_count == 1 and d.last_outcome == "success"
        for d in deliveries
    )
    attempts = Attempt.objects.filter(delivery__in=deliveries)
    assert sorted(str(a.delivery_id) for a in attempts) == sorted(ids)
    assert all(a.recorded and a.number == 1 and a.status_code == 200 for a in attempts)
    assert not Outbox.objects.filter(published_at__isnull=True).exists()
    assert Outbox.objects.count() == EVENTS
    assert not QueueMessage.objects.exists()

    received = receiver.requests_to("/floor")
    assert sorted(r.webhook_id for r in received) == sorted(ids)
    for r in received:
        assert r.headers["idempotency-key"] == r.webhook_id
        Webhook(secret).verify(r.body, r.headers)  # raises if the signature is wrong
