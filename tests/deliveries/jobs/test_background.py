"""The host's background jobs (deliveries.jobs.background, runner, job_queries): the
row written in the caller's transaction, the outcomes, the leases, the entity locks,
queues, priorities and fairness, and run_jobs as a real process killed and stopped."""

import itertools
import logging
import threading
import time
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.utils import timezone

from deliveries.alerts import dead_job_check
from deliveries.core.ids import uuid7
from deliveries.jobs.background import (
    JOB_TYPES,
    UnknownJobType,
    current_job,
    enqueue,
)
from deliveries.jobs.background.sweeps import jobs_schedule
from deliveries.jobs.background.worker import JobWorker
from deliveries.jobs.locks import entity_lock_acquire
from deliveries.jobs.models import EntityLock, Job, JobRun, JobState
from deliveries.scheduler import scheduler_tick
from tests.conftest import subprocess_env
from tests.deliveries.jobs import sample_jobs
from tests.deliveries.jobs.sample_jobs import marks

pytestmark = pytest.mark.django_db(transaction=True)
both = pytest.mark.sqlite  # the tests whose guarantee holds on SQLite too

JOBS_ENV = {
    "JOBS_MODULES": "tests.deliveries.jobs.sample_jobs",
    "JOBS_LEASE_MARGIN": "1",
    "JOBS_LOCK_RETRY": "0.05",
}


@pytest.fixture(autouse=True)
def _marks_table(db):
    sample_jobs.ensure_marks()


def work(*, queues=("default",), concurrency=4, grace=10.0):
    """The worker in this process until nothing is due or running."""
    return JobWorker(queues=queues, concurrency=concurrency, grace=grace).run(until_idle=True)


def make_due() -> int:
    """Skip the waits (the test's clock): pending jobs due now."""
    return Job.objects.filter(state=JobState.PENDING).update(run_at=timezone.now())


def poll(predicate, *, timeout: float = 30.0, every: float = 0.05, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(every)


def state_of(job) -> Job:
    return Job.objects.get(id=job.id)


# --- Enqueue ---------------------------------------------------------------------------


@both
def test_a_rolled_back_enqueue_leaves_nothing_and_a_committed_one_runs():
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue("test.mark", {"label": "rolled back"})
        raise RuntimeError("the caller's transaction fails")
    assert not Job.objects.exists()

    with transaction.atomic():
        kept = enqueue("test.mark", {"label": "committed"})
    work()
    assert state_of(kept).state == JobState.DONE
    assert [m[2] for m in marks()] == ["committed"]


@both
def test_a_payload_of_model_values_reaches_the_job_as_its_json():
    # What a host's model gives, stored with Django's encoder: the function gets the
    # strings back, and the entity lock is made from what it gets.
    invoice_id = uuid.UUID("0195e3b4-7c1d-7000-8000-0123456789ab")
    queued = enqueue(
        "test.mark",
        {"label": Decimal("12.50"), "key": invoice_id, "seconds": 0},
    )
    assert queued.payload == {"label": "12.50", "key": str(invoice_id), "seconds": 0}
    assert queued.lock_key == str(invoice_id)
    assert state_of(queued).payload == queued.payload
    work()
    assert state_of(queued).state == JobState.DONE
    assert [m[2] for m in marks()] == ["12.50"]
    with pytest.raises(ValueError, match="JSON"):
        enqueue("test.mark", {"seconds": float("nan")})
    assert Job.objects.count() == 1


@both
def test_an_unknown_type_is_refused_at_enqueue():
    with pytest.raises(UnknownJobType, match=r"billing\.nothing"):
        enqueue("billing.nothing", {})
    assert issubclass(UnknownJobType, LookupError)
    assert not Job.objects.exists()


@both
def test_a_second_enqueue_with_the_idempotency_key_returns_the_first_job():
    first = enqueue("test.mark", {"label": "a"}, idempotency_key="invoice-42")
    again = enqueue("test.mark", {"label": "b"}, idempotency_key="invoice-42")
    other_type = enqueue("test.noop", {}, idempotency_key="invoice-42")
    assert again.id == first.id
    assert again.payload == {"label": "a"}
    assert other_type.id != first.id
    assert Job.objects.count() == 2


def test_concurrent_enqueues_with_one_key_make_one_job():
    barrier = threading.Barrier(8)
    ids, errors = [], []

    def enqueue_one(i: int) -> None:
        try:
            barrier.wait()
            with transaction.atomic():
                ids.append(enqueue("test.mark", {"label": str(i)}, idempotency_key="k").id)
                time.sleep(0.05)  # hold the transaction: the others wait on the key
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=enqueue_one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(ids) == 8
    assert len(set(ids)) == 1
    assert Job.objects.count() == 1


# --- Outcomes --------------------------------------------------------------------------


@both
def test_sync_and_coroutine_jobs_both_run_with_the_same_job_id_on_every_run():
    sync = enqueue("test.mark", {"label": "sync"})
    coro = enqueue("test.async_mark", {"label": "async", "seconds": 0.01})
    flaky = enqueue("test.flaky", {"label": "flaky", "succeed_on": 3})
    for _ in range(3):
        work()
        make_due()
    assert state_of(sync).state == state_of(coro).state == JobState.DONE
    assert state_of(flaky).state == JobState.DONE
    runs = marks("flaky")
    assert [m[1] for m in runs] == [1, 2, 3]
    assert {m[0] for m in runs} == {str(flaky.id)}
    assert {m[0] for m in marks("async")} == {str(coro.id)}
    with pytest.raises(LookupError):
        current_job()  # outside a job


@both
def test_retry_after_is_honoured():
    job = enqueue("test.retry_after", {"label": "r", "after": 30})
    before = timezone.now()
    work()
    row = state_of(job)
    assert row.state == JobState.PENDING
    assert row.attempts == 1
    assert row.run_at >= before + timedelta(seconds=30)
    assert row.run_at <= timezone.now() + timedelta(seconds=31)
    assert list(JobRun.objects.values_list("outcome", flat=True)) == ["retry"]
    work()  # not due: nothing runs
    assert len(marks("r")) == 1
    make_due()
    work()
    assert state_of(job).state == JobState.DONE
    assert len(marks("r")) == 2


@both
def test_fail_is_dead_at_once_with_the_reason_and_alerts():
    job = enqueue("test.fail", {"label": "f"})
    work()
    row = state_of(job)
    assert row.state == JobState.DEAD
    assert row.attempts == 1
    assert row.dead_reason == "invoice 42 does not exist"
    assert row.finished_at is not None
    assert list(JobRun.objects.values_list("outcome", flat=True)) == ["failed"]
    [signal_] = dead_job_check(timezone.now() + timedelta(seconds=1))
    assert signal_.kind == "dead_jobs"
    assert signal_.details["types"] == {"test.fail": 1}
    assert signal_.details["latest"][0]["reason"] == "invoice 42 does not exist"


@both
def test_an_exception_is_retried_with_the_policys_backoff_then_dead():
    job = enqueue("test.flaky", {"label": "e"})  # max_attempts 3, steps of 0.2 s, no jitter
    work()
    row = state_of(job)
    assert row.state == JobState.PENDING
    run = JobRun.objects.get()
    assert 0.15 <= (row.run_at - run.started_at).total_seconds() - run.duration_ms / 1000 < 1.0
    assert row.last_error.startswith("ValueError: upstream said no")
    for _ in range(2):
        make_due()
        work()
    row = state_of(job)
    assert row.state == JobState.DEAD
    assert row.attempts == 3
    assert row.dead_reason.startswith("attempts exhausted (3): ValueError")
    errors = list(JobRun.objects.order_by("attempt").values_list("attempt", "outcome", "error"))
    assert [(a, o) for a, o, _ in errors] == [(1, "error"), (2, "error"), (3, "error")]
    # The traceback is kept, with the service's secrets masked.
    assert all("Traceback" in e and "whsec_[redacted]" in e for _, _, e in errors)
    assert not any("whsec_abcdefghijkl" in e for _, _, e in errors)
    assert "whsec_abcdefghijkl" not in row.last_error + row.dead_reason


@both
def test_a_timeout_is_a_failed_attempt():
    job = enqueue("test.timeout", {"seconds": 3})  # timeout 0.3 s, one attempt
    started = time.monotonic()
    work(grace=0)
    assert time.monotonic() - started < 2.5  # recorded at the timeout, not the return
    row = state_of(job)
    assert row.state == JobState.DEAD
    assert "timed out after 0.3 s" in row.dead_reason
    assert list(JobRun.objects.values_list("outcome", flat=True)) == ["timeout"]


@both
def test_a_coroutine_past_its_timeout_is_cancelled_there_and_its_batch_mates_are_not():
    late = enqueue("test.async_timeout", {"label": "late", "seconds": 5})
    quick = enqueue("test.async_timeout", {"label": "quick", "seconds": 0.01})
    started = time.monotonic()
    work(grace=0)
    assert time.monotonic() - started < 2.5  # cut off at 0.3 s, not at the 5 s return
    assert state_of(quick).state == JobState.DONE
    row = state_of(late)
    assert row.state == JobState.DEAD
    assert "timed out after 0.3 s" in row.dead_reason
    (cut,) = marks("late:cancelled")
    assert cut[0] == str(late.id) and 0.25 < cut[5] - cut[4] < 2.0
    assert not marks("late") and len(marks("quick")) == 1
    outcomes = dict(JobRun.objects.values_list("job_id", "outcome"))
    assert outcomes == {late.id: "timeout", quick.id: "done"}


@both
def test_payloads_a_worker_cannot_read_go_dead_with_the_reason():
    now = timezone.now()

    def row(type_, version, payload):
        return Job.objects.create(
            id=uuid7(), type=type_, version=version, payload=payload, run_at=now, created_at=now
        )

    unknown = row("test.gone", 1, {})
    newer = row("test.versioned", 3, {"label": "n"})
    no_reader = row("test.unversioned_reader_missing", 1, {})
    old = row("test.versioned", 1, {"label": "old", "amount": 12.5})
    current = enqueue("test.versioned", {"label": "new", "amount_cents": 7})
    work()
    reasons = dict(Job.objects.filter(state=JobState.DEAD).values_list("id", "dead_reason"))
    assert reasons == {
        unknown.id: "unknown job type 'test.gone'",
        newer.id: "payload version 3 is newer than 2",
        no_reader.id: "no reader for payload version 1",
    }
    assert state_of(old).state == state_of(current).state == JobState.DONE
    assert sorted(m[2] for m in marks()) == ["new:7", "old:1250"]
    assert Job.objects.count() == 5  # nothing is deleted
    assert JobRun.objects.filter(outcome="unreadable").count() == 3


@both
def test_a_job_past_its_deadline_is_never_run_and_goes_dead():
    now = timezone.now()
    late = enqueue("test.mark", {"label": "late"}, deadline=now - timedelta(seconds=1))
    on_time = enqueue("test.mark", {"label": "on time"}, deadline=now + timedelta(hours=1))
    work()
    assert state_of(late).state == JobState.PENDING  # not claimed
    counts = scheduler_tick().counts  # the "job" kind's sweep
    assert counts["job.deadline_passed"] == 1
    row = state_of(late)
    assert row.state == JobState.DEAD
    assert row.dead_reason == "deadline passed"
    assert row.attempts == 0
    assert [m[2] for m in marks()] == ["on time"]
    assert state_of(on_time).state == JobState.DONE


def in_background(worker: JobWorker, **options) -> threading.Thread:
    """``worker.run`` in a thread of its own until ``request_stop``."""

    def run() -> None:
        try:
            worker.run(**options)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@both
def test_progress_is_written_while_the_job_runs():
    job = enqueue("test.slow", {"label": "p", "seconds": 3})
    worker = JobWorker(concurrency=1)
    thread = in_background(worker)
    try:
        poll(
            lambda: Job.objects.filter(
                id=job.id, state=JobState.RUNNING, progress_done=1, progress_total=2
            ).exists(),
            timeout=10,
            what="the progress reported midway",
        )
    finally:
        worker.request_stop()
        thread.join()
    row = state_of(job)
    assert (row.state, row.progress_done, row.progress_total) == (JobState.DONE, 1, 2)


@both
def test_a_long_jobs_lease_is_renewed_while_it_runs(settings):
    # A job without a timeout: a lease of 3 s, renewed with 1.5 s left, which leaves a
    # busy machine 1.5 s to run the worker's pass; the job runs for over two leases.
    settings.JOBS_LEASE_MARGIN = 1.5
    job = enqueue("test.long", {"label": "long", "seconds": 7})
    worker = JobWorker(concurrency=1)
    thread = in_background(worker)
    expired, leases = 0, set()
    try:
        poll(lambda: state_of(job).state == JobState.RUNNING, what="the job running")
        while (row := state_of(job)).state == JobState.RUNNING:
            leases.add(row.lease_until)
            expired += jobs_schedule(timezone.now(), 100)[0]["lease_expired"]
            time.sleep(0.1)
    finally:
        worker.request_stop()
        thread.join()
    assert expired == 0
    # The claim's lease and at least two renewals: without them it would have expired.
    assert len(leases) >= 3, f"leases seen: {sorted(leases)}"
    row = state_of(job)
    assert (row.state, row.attempts) == (JobState.DONE, 1)


@both
def test_a_job_past_its_timeout_keeps_its_entity_lock_until_it_returns(settings):
    settings.JOBS_LOCK_RETRY = 0.05
    first = enqueue("test.overrun", {"label": "overrun", "seconds": 1.5, "key": "order:1"})
    second = enqueue("test.mark", {"label": "next", "key": "order:1"})
    work(concurrency=2)  # records the overrun's timeout at 0.3 s, then waits for "next"
    poll(lambda: marks("overrun"), timeout=10, what="the overrunning function returned")
    make_due()
    work(concurrency=2)
    assert state_of(first).state == JobState.DEAD
    assert state_of(second).state == JobState.DONE
    [(_, _, _, _, _, overrun_ended)] = marks("overrun")
    [(_, _, _, _, next_started, _)] = marks("next")
    assert next_started >= overrun_ended


@both
def test_run_jobs_once_runs_one_claim_of_the_named_queues():
    from django.core.management import call_command

    for queue in ("a", "b", "c", "other"):
        enqueue("test.mark", {"label": queue}, queue=queue)
    enqueue("test.mark", {"label": "a-later"}, queue="a")
    call_command("run_jobs", "--once", "--queue", "a,b", "--queue", "c", "--concurrency", "3")
    assert sorted(m[2] for m in marks()) == ["a", "b", "c"]
    assert Job.objects.filter(state=JobState.PENDING).count() == 2


@both
def test_progress_is_written_to_the_row():
    job = enqueue("test.slow", {"label": "p", "seconds": 0.02})
    work()
    row = state_of(job)
    assert (row.state, row.progress_done, row.progress_total) == (JobState.DONE, 1, 2)
    assert row.progress_updated_at is not None


def test_a_run_logs_its_ids_and_outcome_never_the_payload(caplog):
    job = enqueue("test.fail", {"label": "secret-payload-marker"})
    with caplog.at_level(logging.DEBUG, logger="deliveries.jobs"):
        work()
    [record] = [r for r in caplog.records if getattr(r, "action", "") == "job.run"]
    assert record.job_id == str(job.id)
    assert record.job_type == "test.fail"
    assert record.outcome == "failed"
    assert record.duration_ms >= 0
    assert not any("secret-payload-marker" in str(vars(r)) for r in caplog.records)


# --- Queues, priorities, fairness ------------------------------------------------------


@both
def test_a_high_priority_job_overtakes_a_backlog():
    for i in range(20):
        enqueue("test.mark", {"label": f"backlog-{i}"})
    enqueue("test.mark", {"label": "urgent"}, priority=10)
    work(concurrency=1)
    order = [m[2] for m in marks()]
    assert order[0] == "urgent"
    assert len(order) == 21


@both
def test_a_worker_serves_only_its_queues():
    bulk = [enqueue("test.mark", {"label": "export"}, queue="bulk") for _ in range(5)]
    emails = [enqueue("test.mark", {"label": "email"}, queue="emails") for _ in range(3)]
    work(queues=["emails"])
    assert all(state_of(j).state == JobState.DONE for j in emails)
    assert all(state_of(j).state == JobState.PENDING for j in bulk)
    work(queues=["bulk", "emails"])
    assert all(state_of(j).state == JobState.DONE for j in bulk)


@both
def test_one_tenants_flood_does_not_starve_another(settings):
    settings.JOBS_TENANT_CONCURRENCY = 2
    a, b = uuid7(), uuid7()
    for _ in range(40):
        enqueue("test.mark", {"label": "A", "seconds": 0.05}, tenant=a)
    for _ in range(4):
        enqueue("test.mark", {"label": "B", "seconds": 0.05}, tenant=b)
    work(concurrency=4)
    a_ends = sorted(m[5] for m in marks("A"))
    b_ends = sorted(m[5] for m in marks("B"))
    assert len(a_ends) == 40 and len(b_ends) == 4
    # B's four ran beside A's backlog, not after it: all done before A's tenth.
    assert b_ends[-1] < a_ends[9]


# --- Entity locks ----------------------------------------------------------------------


@both
def test_a_job_waits_for_its_entity_lock_without_spending_attempts_until_it_expires():
    assert entity_lock_acquire(key="invoice:7", owner="a worker that died", ttl=1.0)
    job = enqueue("test.mark", {"label": "locked", "key": "invoice:7"})
    work()
    row = state_of(job)
    assert (row.state, row.attempts) == (JobState.PENDING, 0)
    assert not JobRun.objects.exists()

    def ran() -> bool:
        make_due()
        work()
        return state_of(job).state == JobState.DONE

    poll(ran, timeout=15, every=0.2, what="the expired lock taken over")
    assert state_of(job).attempts == 1
    assert not EntityLock.objects.filter(key="invoice:7").exists()  # released after


def _overlaps(intervals: list[tuple[float, float]]) -> list:
    intervals = sorted(intervals)
    return [(x, y) for x, y in itertools.pairwise(intervals) if y[0] < x[1]]


@both
def test_jobs_with_one_entity_key_never_overlap_across_worker_processes(commands):
    env = subprocess_env(**JOBS_ENV)
    workers = [commands("run_jobs", "--concurrency", "4", env=env) for _ in range(2)]
    jobs = [
        enqueue("test.mark", {"label": "same", "seconds": 0.1, "key": "invoice:1"})
        for _ in range(10)
    ]
    jobs += [
        enqueue("test.mark", {"label": f"other-{i}", "key": f"invoice:{i + 100}"}) for i in range(6)
    ]
    poll(
        lambda: Job.objects.filter(state=JobState.DONE).count() == len(jobs),
        timeout=90,
        what="every job done",
    )
    for worker in workers:
        assert worker.stop() == 0, worker.output()
    same = [(m[4], m[5]) for m in marks("same")]
    assert len(same) == 10
    assert _overlaps(same) == []
    assert not EntityLock.objects.exists()


# --- run_jobs as a process -------------------------------------------------------------


@both
def test_a_killed_worker_s_job_runs_again_after_its_lease(commands):
    # Timeout 3 s: a lease (and entity lock) of 4 s with JOBS_LEASE_MARGIN=1.
    job = enqueue("test.crashable", {"label": "c", "key": "invoice:9"})
    worker = commands("run_jobs", env=subprocess_env(**JOBS_ENV))
    poll(lambda: marks("c:start"), timeout=60, what="the first run started")
    worker.kill()  # SIGKILL: no cleanup
    row = state_of(job)
    assert (row.state, row.attempts) == (JobState.RUNNING, 1)
    # The dead worker's entity lock holds until it expires: a job on the same entity
    # waits (not an attempt), then runs.
    same_entity = enqueue("test.mark", {"label": "after", "key": "invoice:9"})
    work()
    if EntityLock.objects.filter(key="invoice:9", expires_at__gt=timezone.now()).exists():
        assert (state_of(same_entity).state, state_of(same_entity).attempts) == (
            JobState.PENDING,
            0,
        )

    def expired() -> bool:
        return jobs_schedule(timezone.now(), 100)[0]["lease_expired"] == 1

    poll(expired, timeout=30, every=0.2, what="the lease expired")
    row = state_of(job)
    assert (row.state, row.attempts, row.last_error) == (JobState.PENDING, 1, "lease expired")
    assert list(JobRun.objects.values_list("outcome", flat=True)) == ["lost"]

    def both_done() -> bool:  # in either order: they share the entity's lock
        make_due()
        work()
        return {state_of(job).state, state_of(same_entity).state} == {JobState.DONE}

    poll(both_done, timeout=30, every=0.1, what="both jobs done")
    runs = [(m[0], m[1], m[2]) for m in marks() if m[2].startswith("c")]
    assert runs == [(str(job.id), 1, "c:start"), (str(job.id), 2, "c:start"), (str(job.id), 2, "c")]
    [after] = marks("after")
    assert after[4] > marks("c:start")[0][4] + 3  # not before the dead holder's lock expired


@both
def test_sigterm_lets_a_running_job_finish(commands):
    worker = commands("run_jobs", env=subprocess_env(**JOBS_ENV))
    job = enqueue("test.slow", {"label": "s", "seconds": 1.5})
    poll(lambda: state_of(job).state == JobState.RUNNING, timeout=60, what="the job running")
    assert worker.stop() == 0, worker.output()
    row = state_of(job)
    assert row.state == JobState.DONE
    assert len(marks("s")) == 1


@both
def test_sigterm_past_the_grace_gives_the_job_back(commands):
    env = subprocess_env(**JOBS_ENV, WORKER_SHUTDOWN_GRACE="0.5")
    worker = commands("run_jobs", env=env)
    job = enqueue("test.slow", {"label": "h", "seconds": 30})
    poll(lambda: state_of(job).state == JobState.RUNNING, timeout=60, what="the job running")
    started = time.monotonic()
    assert worker.stop(timeout=20) == 0, worker.output()
    assert time.monotonic() - started < 10
    row = state_of(job)
    assert (row.state, row.attempts, row.lease_token) == (JobState.PENDING, 0, None)
    assert list(JobRun.objects.values_list("outcome", flat=True)) == ["released"]
    assert marks("h") == []


def test_the_job_kind_is_registered_for_the_scheduler():
    from deliveries.jobs import kinds

    assert kinds.KINDS["job"].schedule is jobs_schedule
    assert "test.mark" in JOB_TYPES
