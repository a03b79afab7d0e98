"""Head-of-line isolation: an endpoint that sleeps 30 s per request and one that answers
500 to everything do not hold up a healthy endpoint's deliveries.

The real scheduler, relay and worker run as processes with their default settings; the
slow and failing endpoints get a backlog first, then healthy events are published at a
steady pace and the receiver clocks each one from publication to arrival. The bound is
documented in docs/reliability.md; the test prints the figures it measured.
"""

import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deliveries import services
from deliveries.models import Delivery, Event
from tests.conftest import subprocess_env
from tests.receiver import always

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SLOW_SECONDS = 30
SLOW_BACKLOG = 600
FAIL_BACKLOG = 200
# The documented bound (docs/reliability.md): a healthy endpoint's p99 delivery latency,
# publication to arrival, with the pipeline's idle pacing (loops look again within
# 0.5 s) and a slow and a failing endpoint saturated beside it.
HEALTHY_P99_BOUND = 5.0
HEALTHY_MAX_BOUND = 10.0


def start(*command: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), *command],
        env=subprocess_env(LOG_LEVEL="WARNING"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_a_slow_and_a_failing_endpoint_do_not_delay_a_healthy_one(tenant, receiver):
    receiver.delays["/slow"] = SLOW_SECONDS
    receiver.behaviours["/fail"] = always(500)
    slow, _ = services.endpoint_create(
        tenant=tenant, url=receiver.url("/slow"), event_types=["slow"], timeout=30
    )
    services.endpoint_create(tenant=tenant, url=receiver.url("/fail"), event_types=["fail"])
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"), event_types=["ok"])
    # More slow deliveries than the endpoint's concurrency ceiling (500) admits: the rest
    # wait in `pending`, held back. The 500 in flight take 500 of the worker's 512
    # request slots for 30 s; everything else goes through what is left.
    for i in range(SLOW_BACKLOG):
        services.publish_event(tenant=tenant, event_type="slow", payload={"i": i})
    for i in range(FAIL_BACKLOG):
        services.publish_event(tenant=tenant, event_type="fail", payload={"i": i})

    procs = [start("run_scheduler"), start("run_relay"), start("run_workers")]
    try:
        # The backlog is in flight: the slow endpoint's requests hang, the failing one's
        # are answered 500 and wait for their retry.
        deadline = time.monotonic() + 30
        while (
            len(receiver.requests_to("/slow")) < 400
            or len(receiver.requests_to("/fail")) < FAIL_BACKLOG
        ):
            assert time.monotonic() < deadline, "the backlog did not reach the receiver"
            time.sleep(0.1)
        healthy = []
        for i in range(100):
            healthy.append(
                services.publish_event(tenant=tenant, event_type="ok", payload={"i": i}).id
            )
            time.sleep(0.1)
        deadline = time.monotonic() + 60
        while Delivery.objects.filter(event_id__in=healthy, state="succeeded").count() < 100:
            assert time.monotonic() < deadline, "healthy deliveries did not finish"
            time.sleep(0.1)
        still_hanging = Delivery.objects.filter(endpoint=slow, state="leased").count()
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait(10)

    published = dict(Event.objects.filter(id__in=healthy).values_list("id", "created_at"))
    arrived = {}
    for r in receiver.requests_to("/ok"):
        event_id = Delivery.objects.get(id=r.webhook_id).event_id
        arrived.setdefault(event_id, r.at)
    latencies = sorted(arrived[e] - published[e].timestamp() for e in healthy)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"\nhead-of-line: healthy p50 {statistics.median(latencies):.3f} s, p99 {p99:.3f} s, "
        f"max {latencies[-1]:.3f} s; slow requests hanging {still_hanging}, "
        f"failing answered {len(receiver.requests_to('/fail'))}"
    )
    assert still_hanging > 0, "the slow endpoint was not holding requests during the test"
    assert p99 < HEALTHY_P99_BOUND, latencies[-10:]
    assert latencies[-1] < HEALTHY_MAX_BOUND, latencies[-10:]
