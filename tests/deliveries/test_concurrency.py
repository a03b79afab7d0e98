"""Two schedulers, two relays and three workers at once, as real threads against the
real database (PostgreSQL, or SQLite's file, whose writers take turns); and four
``run_workers`` processes with nothing but the database between them: every delivery is
attempted exactly once (no lease expires in these tests, so a second copy would be a
double delivery within a lease)."""

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from django.db import connection

from deliveries import services
from deliveries import worker as worker_module
from deliveries.jobs.loop import StopFlag, run_loop
from deliveries.jobs.models import LoopRun
from deliveries.jobs.relay import relay_tick
from deliveries.models import Attempt, Delivery
from deliveries.scheduler import scheduler_tick
from deliveries.worker import Worker
from tests.conftest import in_thread, queue_for_slow_endpoint, subprocess_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.sqlite]

EVENTS = 400


def test_concurrent_schedulers_relays_and_workers_deliver_each_delivery_once(
    tenant, receiver, settings
):
    settings.SCHEDULER_PAGE_SIZE = 50  # small pages, so the loops really interleave
    settings.RELAY_PAGE_SIZE = 50
    settings.WORKER_BATCH_SIZE = 20
    for path in ("/a", "/b"):
        services.endpoint_create(tenant=tenant, url=receiver.url(path))
    for i in range(EVENTS):
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
    expected = Delivery.objects.count()
    assert expected == 2 * EVENTS

    stop = StopFlag()
    loops: list = []
    errors: list[BaseException] = []

    threads = [
        in_thread(lambda: run_loop("scheduler", scheduler_tick, interval=0.01, stop=stop), errors),
        in_thread(lambda: run_loop("scheduler", scheduler_tick, interval=0.01, stop=stop), errors),
        in_thread(lambda: run_loop("relay", relay_tick, interval=0.01, stop=stop), errors),
        in_thread(lambda: run_loop("relay", relay_tick, interval=0.01, stop=stop), errors),
    ]
    for _ in range(3):

        def work():
            async def main():
                loop = asyncio.get_running_loop()
                stopper = asyncio.Event()
                loops.append((loop, stopper))
                await Worker(lanes=2).run(stop=stopper, idle_sleep=0.01)

            asyncio.run(main())

        threads.append(in_thread(work, errors))

    # A guard against a hang, not a speed test (speed lives in bench/): on a machine whose
    # Python ran ten to twenty times slower than usual, with a second suite beside it,
    # the 800 deliveries took more than 90 s.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if Delivery.objects.filter(state="succeeded").count() == expected:
            break
        time.sleep(0.1)
    stop.event.set()
    for loop, stopper in loops:
        loop.call_soon_threadsafe(stopper.set)
    for t in threads:
        t.join(30)

    assert errors == []
    assert_each_delivered_once(receiver, expected)


def assert_each_delivered_once(receiver, expected: int) -> None:
    assert Delivery.objects.filter(state="succeeded").count() == expected
    copies = Counter(r.webhook_id for r in receiver.received)
    assert len(copies) == expected
    assert max(copies.values()) == 1
    assert Attempt.objects.count() == expected


SPREAD_WORKERS = 4


def test_four_worker_processes_divide_the_deliveries_and_send_each_once(tenant, receiver):
    """The real commands as processes: one scheduler, one relay, four run_workers. Each
    worker holds at most 20 requests (and 10 leased ahead) and every answer takes 0.1 s,
    so no process can take all 400 deliveries before the others: each must take a share,
    and none may take what another took."""
    root = Path(__file__).resolve().parents[2]
    env = subprocess_env(LOG_LEVEL="WARNING")
    worker = ["run_workers", "--concurrency", "20", "--batch-size", "10"]
    commands = [["run_scheduler"], ["run_relay"]] + [worker] * SPREAD_WORKERS
    receiver.delays["/spread"] = 0.1
    services.endpoint_create(tenant=tenant, url=receiver.url("/spread"))
    procs = [
        subprocess.Popen(
            [sys.executable, str(root / "manage.py"), *command],
            env=env,
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for command in commands
    ]
    try:
        # Every process running (its run recorded) before the first event is published.
        deadline = time.monotonic() + 120
        while LoopRun.objects.filter(finished_at=None).count() < len(procs):
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            assert time.monotonic() < deadline, "the processes did not start"
            time.sleep(0.1)
        for i in range(EVENTS):
            services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
        deadline = time.monotonic() + 300  # a guard against a hang, not a speed test
        while Delivery.objects.filter(state="succeeded").count() < EVENTS:
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            assert time.monotonic() < deadline, "the deliveries were not all sent"
            time.sleep(0.1)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in procs]

    assert codes == [0] * len(procs)
    assert_each_delivered_once(receiver, EVENTS)
    # An attempt records its worker as host:pid.
    by_pid = Counter(
        int(w.rpartition(":")[2]) for w in Attempt.objects.values_list("worker", flat=True)
    )
    shares = [by_pid[p.pid] for p in procs[2:]]
    assert sum(shares) == EVENTS, by_pid
    assert min(shares) > 0, shares


def test_the_concurrency_ceiling_holds_across_lanes_that_take_at_once(tenant, receiver):
    """Four lanes start together with every slot free: each must reserve its room before
    it waits for the database, or all four lease a full batch and the worker sends four
    times its ceiling."""
    queue_for_slow_endpoint(tenant, receiver, deliveries=12, seconds=3)

    async def main() -> None:
        stop = asyncio.Event()
        worker = Worker(lanes=4, concurrency=2, batch_size=2, shutdown_grace=0)
        running = asyncio.create_task(worker.run(stop=stop, idle_sleep=0.01))
        await asyncio.sleep(1.5)  # every lane has had its turn; the first answers are 3 s off
        stop.set()
        await running

    asyncio.run(main())
    assert len(receiver.received) == 2
    assert Delivery.objects.filter(state="succeeded").count() == 0
    assert Delivery.objects.filter(state="leased").count() == 0


def test_a_worker_leases_half_its_concurrency_ahead_and_sends_no_more_than_it(tenant, receiver):
    """Prefetch: while its requests are out, a worker leases up to PREFETCH times its concurrency
    more deliveries, which wait in the process for a request slot; the receiver never
    sees more than the concurrency at once. Stopping past the grace gives every lease
    back, the waiting ones included."""
    queue_for_slow_endpoint(tenant, receiver, deliveries=12, seconds=3)
    seen: dict = {}

    def leased() -> int:
        try:
            return Delivery.objects.filter(state="leased").count()
        finally:
            connection.close()

    async def main() -> None:
        stop = asyncio.Event()
        worker = Worker(lanes=2, concurrency=4, batch_size=10, shutdown_grace=0)
        running = asyncio.create_task(worker.run(stop=stop, idle_sleep=0.01))
        await asyncio.sleep(1.5)  # the first answers are 3 s off
        seen["leased"] = await asyncio.to_thread(leased)
        seen["requests"] = len(receiver.received)
        stop.set()
        await running

    asyncio.run(main())
    assert seen == {"leased": 6, "requests": 4}
    assert len(receiver.received) == 4
    # The six leases went back to pending (due now, the attempt not counted); the
    # other six were never taken.
    assert Delivery.objects.filter(state="leased").count() == 0
    assert Delivery.objects.filter(state="pending", attempt_count=0).count() == 6
    assert Delivery.objects.filter(state="enqueued").count() == 6


def test_a_notification_during_an_empty_take_ends_the_idle_wait(tenant, receiver, monkeypatch):
    """The relay enqueues while a lane's take is running and finds nothing. The
    notification must end the lane's idle wait; cleared after the take, it left the lane
    asleep for a whole LISTEN_POLL with the message waiting."""
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()  # in the outbox, not yet on the broker
    real_take = worker_module._take
    relayed_at: list[float] = []

    def take(*args):
        taken = real_take(*args)
        if not relayed_at:
            time.sleep(0.5)  # the listener thread is listening by now
            relay_tick()  # NOTIFY webhooks_queue at its commit
            relayed_at.append(time.time())  # the receiver's clock
            time.sleep(0.3)  # and the notification reaches the lane meanwhile
        return taken

    monkeypatch.setattr(worker_module, "_take", take)

    async def main() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(Worker(lanes=1).run(stop=stop))
        deadline = time.monotonic() + 10
        while not receiver.received and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stop.set()
        await running

    asyncio.run(main())
    assert len(receiver.received) == 1
    assert receiver.received[0].at - relayed_at[0] < worker_module.LISTEN_POLL * 0.7
