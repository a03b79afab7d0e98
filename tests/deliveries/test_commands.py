"""The management commands as real processes: cron-style --once runs, run records,
SIGTERM finishing in-flight work, create_tenant and delivery_status output."""

import gc
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from deliveries import services
from deliveries.jobs.models import LoopRun, QueueMessage
from deliveries.models import ApiKey, Attempt, Delivery
from deliveries.services import hash_api_key
from tests.conftest import drain, manage, queue_for_slow_endpoint, subprocess_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.sqlite]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def workers_process():
    """Start ``run_workers`` as a real process; whatever a failed assertion leaves running
    is killed, so it cannot go on writing to the test database."""
    started: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "run_workers", *args],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_create_tenant_prints_the_key_alone_on_the_last_line():
    result = manage("create_tenant", "globex", env=subprocess_env())
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip().splitlines()[-1]
    assert key.startswith("whk_") and " " not in key
    stored = ApiKey.objects.get(tenant__name="globex")
    assert stored.key_hash == hash_api_key(key)
    assert key not in stored.prefix + stored.key_hash

    again = manage("create_tenant", "globex", env=subprocess_env())
    assert again.returncode != 0
    assert "exists" in again.stderr


def test_once_runs_record_what_they_did(tenant):
    services.endpoint_create(tenant=tenant, url="http://127.0.0.1:9/x")
    services.publish_event(tenant=tenant, event_type="t", payload={})

    result = manage("run_scheduler", "--once", env=subprocess_env())

    assert result.returncode == 0, result.stderr
    assert "enqueued=1" in result.stdout
    run = LoopRun.objects.get(kind="scheduler")
    assert run.finished_at is not None
    assert run.counts["enqueued"] == 1


def test_a_loop_process_freezes_its_start_up_heap_and_collects_less_often():
    code = (
        "import gc, django; django.setup();"
        "from deliveries.jobs.loop import GC_YOUNG_THRESHOLD, settle_heap;"
        "before = gc.get_freeze_count(); settle_heap();"
        "print(before, gc.get_freeze_count(), gc.get_threshold()[0] == GC_YOUNG_THRESHOLD)"
    )
    env = subprocess_env(DJANGO_SETTINGS_MODULE="project.settings")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )

    assert result.returncode == 0, result.stderr
    before, after, tuned = result.stdout.split()
    assert int(before) == 0
    assert int(after) > 10_000  # Django, the models and the settings, out of the GC's sight
    assert tuned == "True"


def test_once_and_until_idle_runs_leave_the_collector_alone(tenant):
    # They are what tests and cron call; a test process must not freeze its heap.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        call_command("run_scheduler", "--once")
        call_command("run_relay", "--until-idle")
        call_command("run_workers", "--until-idle")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    assert (gc.get_threshold(), gc.get_freeze_count()) == (thresholds, frozen)


@pytest.mark.parametrize("flag", ["--lanes", "--batch-size", "--concurrency"])
def test_run_workers_refuses_a_count_below_one_before_it_records_a_run(flag):
    with pytest.raises(CommandError, match=f"{flag} must be at least 1, not 0"):
        call_command("run_workers", "--once", flag, "0")
    assert not LoopRun.objects.exists()


def test_delivery_status_explains_a_delivery(tenant):
    services.endpoint_create(tenant=tenant, url="http://127.0.0.1:9/x")
    event = services.publish_event(tenant=tenant, event_type="t", payload={})
    delivery = Delivery.objects.get(event=event)

    result = manage("delivery_status", str(delivery.id), env=subprocess_env())
    assert result.returncode == 0, result.stderr
    assert "no scheduler is running" in result.stdout
    assert str(delivery.id) in result.stdout

    missing = manage("delivery_status", "not-an-id", env=subprocess_env())
    assert missing.returncode != 0 and "no delivery" in missing.stderr


def test_sigterm_lets_workers_finish_and_record_the_requests_in_flight(
    tenant, receiver, workers_process
):
    queue_for_slow_endpoint(tenant, receiver, deliveries=3, seconds=1.5)

    proc = workers_process(env=subprocess_env())
    receiver.wait_for(3, timeout=20)
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    _, err = proc.communicate(timeout=30)

    assert proc.returncode == 0, err
    assert time.monotonic() - started < 10
    assert Delivery.objects.filter(state="succeeded").count() == 3
    assert Delivery.objects.filter(state="leased").count() == 0


def test_sigterm_past_the_grace_gives_the_leases_back_and_strands_nothing(
    tenant, receiver, workers_process
):
    # Each request takes far longer than the grace; the worker sends two at a time and
    # leases one more ahead (prefetch: half its concurrency), so at SIGTERM two requests
    # are in flight, one delivery waits for a slot and three wait in the queue.
    queue_for_slow_endpoint(tenant, receiver, deliveries=6, seconds=15)

    proc = workers_process("--concurrency", "2", env=subprocess_env(WORKER_SHUTDOWN_GRACE="1"))
    receiver.wait_for(2, timeout=20)
    # The ceiling: two requests out, three leases held; the other three in the queue.
    assert Delivery.objects.filter(state="leased").count() == 3
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    out, err = proc.communicate(timeout=30)

    assert proc.returncode == 0, err
    # The grace (1 s), not the receiver (15 s), decided when the worker stopped.
    assert time.monotonic() - started < 8
    assert "released=3" in out
    assert len(receiver.received) == 2
    # Every lease was given back at once: pending, due, the attempt not counted, and the
    # spent broker messages acknowledged. Nothing waits for a lease to run out; the
    # three never taken are still queued.
    assert Delivery.objects.filter(state="leased").count() == 0
    due = Delivery.objects.filter(state="pending", next_attempt_at__lte=timezone.now())
    assert due.count() == 3
    assert Delivery.objects.filter(state="enqueued").count() == 3
    assert set(Delivery.objects.values_list("attempt_count", "policy_attempts")) == {(0, 0)}
    assert Attempt.objects.count() == 0
    assert QueueMessage.objects.count() == 3

    receiver.delays["/slow"] = 0
    drain()

    deliveries = {str(d.id): d for d in Delivery.objects.all()}
    assert {d.state for d in deliveries.values()} == {"succeeded"}
    assert all(d.attempt_count == 1 for d in deliveries.values())
    copies = Counter(r.webhook_id for r in receiver.requests_to("/slow"))
    # Each delivery reached the receiver under its own single webhook-id: the two cut
    # off mid-request twice, the one that waited for a slot and the three never taken
    # once.
    assert set(copies) == set(deliveries)
    assert sorted(copies.values()) == [1, 1, 1, 1, 2, 2]
