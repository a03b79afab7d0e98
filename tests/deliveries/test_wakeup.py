"""Wake-ups on PostgreSQL (deliveries.jobs.wakeup): new due work wakes the scheduler at the
commit that makes it visible, and nothing else does."""

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from deliveries import services, state
from deliveries.jobs import wakeup
from deliveries.jobs.loop import SOON_WAIT, StopFlag, Tick, run_loop
from deliveries.models import Delivery
from deliveries.scheduler import SchedulerPasses, scheduler_tick
from tests.conftest import in_thread

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def listening(channel: str) -> Iterator[wakeup.Listener]:
    listener = wakeup.Listener(channel)
    listener.wait(0.01, threading.Event())  # LISTEN now, before the test's commits
    try:
        yield listener
    finally:
        listener.close()


@pytest.fixture
def due_listener():
    with listening(wakeup.DUE) as listener:
        yield listener


def woke(listener: wakeup.Listener, seconds: float = 0.5) -> bool:
    return listener.wait(seconds, threading.Event())


def test_a_committed_publish_wakes_the_scheduler_once_per_transaction(
    tenant, make_endpoint, receiver, due_listener
):
    make_endpoint(receiver.url("/ok"))
    with transaction.atomic():
        for i in range(3):
            services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
        assert not woke(due_listener, 0.2)  # not before the commit
    assert woke(due_listener)
    assert not woke(due_listener, 0.2)  # the three notifications were one


def test_no_wake_up_for_a_rolled_back_or_deferred_publish_or_one_with_no_deliveries(
    tenant, make_endpoint, receiver, due_listener
):
    with transaction.atomic():
        services.publish_event(tenant=tenant, event_type="t", payload={})
    assert not woke(due_listener, 0.2), "no endpoint subscribes: no delivery, no wake-up"

    make_endpoint(receiver.url("/ok"))
    with pytest.raises(RuntimeError), transaction.atomic():
        services.publish_event(tenant=tenant, event_type="t", payload={})
        raise RuntimeError("the caller's business write failed")
    assert not woke(due_listener, 0.2)

    services.publish_event(
        tenant=tenant,
        event_type="t",
        payload={},
        deliver_at=timezone.now() + timedelta(hours=1),
    )
    assert not woke(due_listener, 0.2), "due in an hour: the scheduler's own look finds it"
    assert Delivery.objects.count() == 1


def test_a_replay_wakes_the_scheduler(tenant, make_endpoint, receiver, due_listener):
    make_endpoint(receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    assert woke(due_listener)
    delivery = Delivery.objects.get()
    Delivery.objects.filter(id=delivery.id).update(state="dead", finished_at=timezone.now())

    assert state.replay(delivery_ids=[delivery.id], now=timezone.now()) == 1
    assert woke(due_listener)
    assert state.replay(delivery_ids=[], now=timezone.now()) == 0
    assert not woke(due_listener, 0.2)


def test_an_idle_scheduler_admits_a_publish_at_once_not_at_its_next_look(
    tenant, make_endpoint, receiver
):
    """With a 30 s interval, a scheduler that found nothing sleeps 30 s unless a
    notification ends the wait."""
    make_endpoint(receiver.url("/ok"))
    stop = StopFlag()
    errors: list[BaseException] = []

    thread = in_thread(
        lambda: run_loop(
            "scheduler",
            SchedulerPasses(),
            interval=30.0,
            stop=stop,
            listen=(wakeup.FREED, wakeup.DUE),
        ),
        errors,
    )
    try:
        time.sleep(1.0)  # its first pass found nothing; it now waits on the interval
        services.publish_event(tenant=tenant, event_type="t", payload={})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if Delivery.objects.filter(state="enqueued").exists():
                break
            time.sleep(0.05)
        assert Delivery.objects.get().state == "enqueued"
    finally:
        stop.event.set()
        wakeup.notify(wakeup.DUE)  # ends its wait, so that it sees the stop
        thread.join(35)
    assert not thread.is_alive()
    assert not errors


def test_a_lease_given_back_at_shutdown_wakes_the_scheduler(
    tenant, make_endpoint, receiver, due_listener
):
    make_endpoint(receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    assert woke(due_listener)
    scheduler_tick()
    delivery = Delivery.objects.get()
    assert delivery.state == "enqueued"
    now = timezone.now()
    leased, _skipped = state.lease(
        [(delivery.id, delivery.dispatch_count)], now=now, lease_seconds=60
    )
    assert len(leased) == 1
    assert not woke(due_listener, 0.2), "a lease is not new due work"

    assert state.release(leased, now=now) == 1
    assert woke(due_listener)


def test_while_work_flows_notifications_wait_for_the_pacing_instead_of_a_pass_each():
    """A loop that just did work looks again after SOON_WAIT. Cutting that wait short at
    every notification (one per publish) made a pass, a transaction and a wake-up of
    the next stage per event: at 1,000 events/s p50 latency rose by a third."""
    stop = StopFlag()
    errors: list[BaseException] = []
    passes: list[float] = []

    def unit() -> Tick:
        passes.append(time.monotonic())
        return Tick(soon=True)

    thread = in_thread(
        lambda: run_loop("scheduler", unit, interval=30.0, stop=stop, listen=(wakeup.DUE,)),
        errors,
    )
    try:
        time.sleep(0.3)  # listening by now
        sent_from = time.monotonic()
        for _ in range(100):
            wakeup.notify(wakeup.DUE)  # autocommit: delivered at once
            time.sleep(0.005)
        sent_until = time.monotonic()
    finally:
        stop.event.set()
        thread.join(5)
    assert not thread.is_alive()
    assert not errors
    during = [t for t in passes if sent_from <= t <= sent_until]
    # At most one pass per SOON_WAIT (and one for the wait under way at the start).
    assert len(during) <= (sent_until - sent_from) / SOON_WAIT + 2
    assert len(during) >= 2, "the loop kept passing while the notifications came"


def test_a_pause_the_unit_asks_for_is_kept_whatever_notifications_arrive(monkeypatch):
    """The scheduler's pause while the global ceiling is full (SchedulerPasses): the
    workers' FREED notifications, one a recording, must not cut it short, and are read
    meanwhile rather than left to pile up."""
    stop = StopFlag()
    errors: list[BaseException] = []
    passes: list[float] = []
    drained: list[int] = []
    real_drain = wakeup.Listener.drain
    monkeypatch.setattr(
        wakeup.Listener, "drain", lambda self: drained.append(real_drain(self)) or drained[-1]
    )

    def unit() -> Tick:
        if not passes:
            passes.append(0.0)
            return Tick(idle=True)  # one idle wait: the listener connects and LISTENs
        passes.append(time.monotonic())
        return Tick(soon=True, blocked=True, pause=0.3)

    thread = in_thread(
        lambda: run_loop("scheduler", unit, interval=30.0, stop=stop, listen=(wakeup.DUE,)),
        errors,
    )
    try:
        time.sleep(0.05)
        wakeup.notify(wakeup.DUE)  # ends the idle wait
        time.sleep(0.05)
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            wakeup.notify(wakeup.DUE)
            time.sleep(0.01)
    finally:
        stop.event.set()
        thread.join(5)
    assert not thread.is_alive()
    assert not errors
    passes = passes[1:]
    gaps = [b - a for a, b in itertools.pairwise(passes)]
    assert 3 <= len(passes) <= 5, passes
    assert min(gaps) >= 0.29, gaps
    assert sum(drained) >= 50, drained


def test_an_admission_pass_wakes_the_relay_only_when_it_wrote_outbox_rows(
    tenant, make_endpoint, receiver
):
    make_endpoint(receiver.url("/ok"))
    with listening(wakeup.OUTBOX) as relay:
        scheduler_tick()
        assert not woke(relay, 0.2), "nothing was due"
        for i in range(3):
            services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
        scheduler_tick(page_size=2)  # two of the three, then the third
        assert woke(relay)
        scheduler_tick(page_size=2)
        assert woke(relay)
        assert Delivery.objects.filter(state="enqueued").count() == 3
        scheduler_tick()
        assert not woke(relay, 0.2)


def test_drain_takes_what_is_here_without_waiting(due_listener):
    assert due_listener.drain() == 0
    for _ in range(5):
        wakeup.notify(wakeup.DUE)  # autocommit: five transactions, five notifications
    time.sleep(0.2)
    assert due_listener.drain() == 5
    assert not woke(due_listener, 0.2)


def test_a_loop_that_stays_busy_still_reads_its_notifications(monkeypatch):
    """Busy and pacing passes do not wait on the listener, so they must read it: left
    unread, a notification per publish would fill the connection and stall PostgreSQL's
    notification queue behind it."""
    stop = StopFlag()
    errors: list[BaseException] = []
    drained: list[int] = []
    real_drain = wakeup.Listener.drain
    monkeypatch.setattr(
        wakeup.Listener, "drain", lambda self: drained.append(real_drain(self)) or drained[-1]
    )
    passes = 0

    def unit() -> Tick:
        nonlocal passes
        passes += 1
        if passes == 1:
            return Tick(idle=True)  # one idle wait: the listener connects and LISTENs
        if passes > 40:
            stop.event.set()
        wakeup.notify(wakeup.DUE)  # a publish elsewhere, while this loop works
        time.sleep(0.005)
        return Tick(busy=passes % 2 == 0, soon=True)

    thread = in_thread(
        lambda: run_loop("scheduler", unit, interval=0.05, stop=stop, listen=(wakeup.DUE,)),
        errors,
    )
    thread.join(30)
    assert not thread.is_alive()
    assert not errors
    assert passes > 40
    assert sum(drained) >= 30, drained


def test_a_recording_wakes_the_scheduler_only_when_a_delivery_left_its_lease(
    tenant, make_endpoint, receiver
):
    from deliveries.core.retry import RetryPolicy
    from deliveries.policy import classify

    make_endpoint(receiver.url("/ok"))
    services.publish_event(tenant=tenant, event_type="t", payload={})
    scheduler_tick()
    d = Delivery.objects.get()
    [leased], _ = state.lease([(d.id, 1)], now=timezone.now(), lease_seconds=60)

    def result():
        return state.AttemptResult(
            leased=leased,
            classification=classify(status=200),
            started_at=timezone.now(),
            duration_ms=1.0,
            status_code=200,
        )

    policy = RetryPolicy(schedule=(30,), jitter=0)
    with listening(wakeup.FREED) as scheduler:
        with transaction.atomic():
            assert state.record([result()], now=timezone.now(), policy=policy).succeeded == 1
            assert not woke(scheduler, 0.2)  # not before the commit
        assert woke(scheduler)
        # The same result again: its lease is gone, nothing freed, no wake-up.
        assert state.record([result()], now=timezone.now(), policy=policy).stale == 1
        assert not woke(scheduler, 0.2)
