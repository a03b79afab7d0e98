"""Django's Tasks API on the job machinery (deliveries.jobs.tasks.JobsBackend, the
project's TASKS): ``@task`` of the django-tasks backport enqueued as a job in the
caller's transaction, run by the real worker and ``run_jobs`` (found by its module
path), read back with ``get_result``; what maps to what, the OPTIONS and per-task
options, and the refusals."""

import subprocess
import sys
import uuid
from datetime import timedelta
from functools import partial

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from django_tasks import default_task_backend, task
from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch

from deliveries.alerts import dead_job_check
from deliveries.jobs.background import (
    JOB_TYPES,
    Fail,
    LeaseExpired,
    enqueue,
    job,
)
from deliveries.jobs.background.sweeps import jobs_schedule
from deliveries.jobs.models import Job, JobRun, JobState, RecurringJob
from deliveries.jobs.services import recurring_job_save
from deliveries.jobs.tasks import InvalidTask, InvalidTaskBackend, JobsBackend, ResultRefused
from tests.conftest import scrape, subprocess_env, value
from tests.deliveries.jobs import sample_jobs, sample_tasks
from tests.deliveries.jobs.sample_jobs import marks
from tests.deliveries.jobs.test_api import client_for
from tests.deliveries.jobs.test_background import make_due, poll, state_of, work

pytestmark = pytest.mark.django_db(transaction=True)
both = pytest.mark.sqlite  # the tests whose guarantee holds on SQLite too

BACKEND = "deliveries.jobs.tasks.JobsBackend"
PATH = "tests.deliveries.jobs.sample_tasks"


@pytest.fixture(autouse=True)
def _marks_table(db):
    sample_jobs.ensure_marks()


def job_of(result) -> Job:
    return Job.objects.get(id=result.id)


# --- Enqueue and run ----------------------------------------------------------------


@both
def test_a_rolled_back_task_leaves_nothing_and_a_committed_one_runs_once():
    with pytest.raises(RuntimeError), transaction.atomic():
        sample_tasks.mark.enqueue("rolled back")
        raise RuntimeError("the caller's transaction fails")
    assert not Job.objects.exists()

    with transaction.atomic():
        result = sample_tasks.mark.enqueue("committed")
        assert (result.status, result.attempts, result.errors) == ("READY", 0, [])
    row = job_of(result)
    assert (row.type, row.queue, row.priority, row.state) == (
        f"{PATH}.mark",
        "default",
        10,
        JobState.PENDING,
    )
    assert row.payload == {"args": ["committed"], "kwargs": {}}
    work()
    work()  # nothing left: it ran once
    assert [m[2] for m in marks()] == ["committed"]

    result.refresh()
    assert result.status == "SUCCESSFUL" and result.is_finished
    assert result.return_value == {"label": "committed"}
    assert result.attempts == 1 and len(result.worker_ids) == 1
    assert result.enqueued_at == row.created_at
    assert result.started_at <= result.finished_at
    again = sample_tasks.mark.get_result(result.id)
    assert (again.args, again.kwargs, again.backend) == (["committed"], {}, "default")
    assert again.task.func is sample_tasks.mark.func


@both
def test_a_failing_task_retries_then_ends_dead_with_its_masked_traceback():
    result = sample_tasks.explode.enqueue(label="boom")
    assert job_of(result).max_attempts == 2  # @task(max_attempts=2)
    work()
    result.refresh()
    assert (result.status, result.attempts, len(result.errors)) == ("READY", 1, 1)
    make_due()  # the test's clock: skip the policy's wait
    work()
    result.refresh()
    assert result.status == "FAILED" and result.attempts == 2
    assert [e.exception_class for e in result.errors] == [ValueError, ValueError]
    trace = result.errors[-1].traceback
    assert "Traceback (most recent call last)" in trace and "boom went wrong" in trace
    assert "whsec_abcdefghijkl" not in trace and "[redacted]" in trace
    with pytest.raises(ValueError, match="failed"):
        result.return_value  # noqa: B018
    row = job_of(result)
    assert row.state == JobState.DEAD
    assert row.dead_reason.startswith("attempts exhausted (2): ValueError")
    assert len(marks("boom")) == 2


@both
def test_fail_raised_in_a_task_ends_it_dead_at_once():
    result = sample_tasks.refuse.enqueue(42)
    work()
    result.refresh()
    assert (result.status, result.attempts) == ("FAILED", 1)
    assert result.errors[0].exception_class is Fail
    assert job_of(result).dead_reason == "invoice 42 does not exist"


@both
def test_priority_queue_and_run_after_map_onto_the_job():
    soon = timezone.now() + timedelta(hours=1)
    tasks = {
        "QUEUES": ["default", "bulk"],
        "BACKEND": BACKEND,
    }
    with override_settings(TASKS={"default": tasks}):
        low = sample_tasks.mark.using(priority=-5).enqueue("low")
        high = sample_tasks.mark.using(priority=50).enqueue("high")
        bulk = sample_tasks.mark.using(queue_name="bulk").enqueue("bulk")
        later = sample_tasks.mark.using(run_after=soon).enqueue("later")
        with pytest.raises(InvalidTask, match="Queue 'emails' is not valid"):
            sample_tasks.mark.using(queue_name="emails")
    assert [job_of(r).priority for r in (low, high)] == [-5, 50]
    assert (job_of(bulk).queue, job_of(later).run_at) == ("bulk", soon)

    work(concurrency=1)  # one at a time: the order of the claims
    assert [m[2] for m in marks()] == ["high", "low"]  # not bulk's queue, not later's time
    work(queues=["bulk"])
    make_due()
    work()
    assert [m[2] for m in marks()] == ["high", "low", "bulk", "later"]


@both
def test_enqueue_on_commit_as_django_documents_it():
    with transaction.atomic():
        transaction.on_commit(partial(sample_tasks.mark.enqueue, "on commit"))
        assert not Job.objects.exists()  # not before the commit
    with pytest.raises(RuntimeError), transaction.atomic():
        transaction.on_commit(partial(sample_tasks.mark.enqueue, "rolled back"))
        raise RuntimeError("the caller's transaction fails")
    [row] = Job.objects.all()
    assert row.payload["args"] == ["on commit"]
    work()
    assert [m[2] for m in marks()] == ["on commit"]


@both
def test_a_recurring_job_can_enqueue_a_task():
    now = timezone.now()
    row = recurring_job_save(
        recurring_job=RecurringJob(
            name="tick",
            job_type=f"{PATH}.mark",
            cron="* * * * *",
            payload={"args": ["tick"], "kwargs": {}},
        )
    )
    RecurringJob.objects.filter(id=row.id).update(next_tick_at=now - timedelta(seconds=1))
    assert jobs_schedule(now, 100)[0]["recurring_enqueued"] == 1
    work()
    assert [m[2] for m in marks()] == ["tick"]


@both
def test_an_async_task_runs_on_the_workers_loop_and_aget_result_reads_it():
    result = sample_tasks.async_mark.enqueue("async")
    assert JOB_TYPES[f"{PATH}.async_mark"].is_async
    work()
    read = async_to_sync(default_task_backend.aget_result)(result.id)
    assert (read.status, read.return_value) == ("SUCCESSFUL", ["async", "job-loop"])
    assert [m[2] for m in marks()] == ["async"]


@both
def test_a_task_that_takes_context_gets_its_result_id_and_attempt():
    result = sample_tasks.with_context.enqueue("ctx")
    work()
    result.refresh()
    assert result.return_value == {"id": result.id, "attempt": 1}


# --- Refusals ---------------------------------------------------------------------------


@both
@pytest.mark.django_db  # nothing is committed: no worker runs
@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((timezone.now(),), {}, r"args\[0\] is a datetime"),
        (([1, (2, 3)],), {}, r"args\[0\]\[1\] is a tuple"),
        ((), {"totals": {1: "a"}}, r"kwargs\['totals'\] has the key 1, a int"),
        ((b"bytes",), {}, r"args\[0\] is a bytes"),
        ((float("nan"),), {}, r"args has a number out of range"),
        (("nul\x00",), {}, r"args has a string that holds a NUL character"),
    ],
)
def test_arguments_that_do_not_round_trip_through_json_are_refused_at_enqueue(args, kwargs, match):
    with pytest.raises(TypeError, match=match):
        sample_tasks.returns.enqueue(*args, **kwargs)
    assert not Job.objects.exists()
    fine = {"nested": [[1, 2.5], {"ü": None, "ok": True}], "n": -3}
    assert sample_tasks.returns.enqueue(fine).args == [fine]


@both
def test_a_return_value_json_cannot_hold_or_over_the_cap_ends_dead_at_once():
    not_json = sample_tasks.returns.enqueue("a set")
    with override_settings(
        TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": {"RESULT_MAX_BYTES": 100}}}
    ):
        small = sample_tasks.returns.enqueue("x" * 50)
        large = sample_tasks.returns.enqueue("x" * 200)
        work()
    nothing = sample_tasks.plain.enqueue()
    work()
    for result, cause in ((not_json, "<class 'set'>"), (large, "202 bytes, more than")):
        result.refresh()
        assert (result.status, result.attempts) == ("FAILED", 1)
        assert result.errors[0].exception_class is ResultRefused
        assert cause in job_of(result).dead_reason
        assert job_of(result).result is None
    small.refresh()
    assert (small.status, small.return_value) == ("SUCCESSFUL", "x" * 50)
    nothing.refresh()
    assert (nothing.status, nothing.return_value) == ("SUCCESSFUL", None)


@both
@pytest.mark.django_db
def test_get_result_of_no_task_raises_the_frameworks_errors():
    for missing in (str(uuid.uuid4()), "not-a-uuid", str(enqueue("test.noop").id)):
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(missing)
    added = sample_tasks.add.enqueue(1, 2)
    with pytest.raises(TaskResultMismatch):
        sample_tasks.mark.get_result(added.id)


@pytest.mark.django_db
def test_a_task_whose_path_is_a_job_types_name_is_refused():
    name = f"{PATH}.not_a_task"
    job(name)(sample_tasks.not_a_task)
    try:
        with pytest.raises(InvalidTask, match="@job type already"):
            task(sample_tasks.not_a_task)
    finally:
        del JOB_TYPES[name]


# --- Options ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_backend_options_are_checked_and_become_the_jobs_defaults():
    bad = JobsBackend(
        "x",
        {"OPTIONS": {"MAX_ATTEMPTS": 0, "TIMEOUT": -1, "RETRY_SCHEDULE": ["soon"], "TYPO": 1}},
    )
    errors = list(bad.check())
    assert {e.id for e in errors} == {"deliveries.E050"}
    assert len(errors) == 4
    with pytest.raises(InvalidTaskBackend, match="OPTIONS"):  # no task runs on it
        bad.validate_task(sample_tasks.add)

    good = JobsBackend(
        "x", {"OPTIONS": {"MAX_ATTEMPTS": 3, "TIMEOUT": None, "RETRY_SCHEDULE": [0, 7]}}
    )
    assert list(good.check()) == []
    spec = good._job_type(sample_tasks.add)
    assert (spec.max_attempts, spec.timeout, spec.retry.schedule) == (3, None, (0.0, 7.0))
    # Per task (@task on the backport, or task_options under Django's @task) wins.
    optioned = good._job_type(sample_tasks.optioned)
    assert (optioned.max_attempts, optioned.timeout) == (1, 0.5)
    assert optioned.lock(["k"], {}) == "opt:k"


@both
def test_max_attempts_and_retry_schedule_from_options_end_a_failing_task_dead():
    options = {"MAX_ATTEMPTS": 2, "RETRY_SCHEDULE": [0]}
    with override_settings(TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": options}}):
        result = sample_tasks.add.enqueue("a", 1)  # "a" + 1: a TypeError each run
        work()
        work()
    result.refresh()
    assert (result.status, result.attempts) == ("FAILED", 2)
    assert [e.exception_class for e in result.errors] == [TypeError, TypeError]


@both
def test_per_task_lock_and_timeout_apply_to_the_job():
    result = sample_tasks.optioned.enqueue(key="k")
    row = job_of(result)
    assert (row.lock_key, row.max_attempts) == ("opt:k", 1)
    later = sample_tasks.crashable.using(run_after=timezone.now() + timedelta(hours=1))
    assert job_of(later.enqueue("c", "invoice:7")).lock_key == "invoice:7"  # not run here
    work()
    result.refresh()
    assert result.status == "FAILED"
    assert result.errors[0].exception_class is TimeoutError


@both
@pytest.mark.django_db
def test_using_job_gives_a_tenant_an_idempotency_key_and_a_deadline():
    tenant, deadline = uuid.uuid4(), timezone.now() + timedelta(hours=1)
    keyed = sample_tasks.mark.using_job(tenant=tenant, idempotency_key="inv-1", deadline=deadline)
    first = keyed.enqueue("once")
    again = keyed.enqueue("twice")
    assert again.id == first.id and again.args == ["once"]
    row = job_of(first)
    assert (row.tenant_id, row.idempotency_key, row.deadline) == (tenant, "inv-1", deadline)
    assert Job.objects.count() == 1


# --- Like any job ----------------------------------------------------------------------


def test_tasks_show_in_the_admin_metrics_alerts_and_rest_route_like_any_job(admin_client, settings):
    settings.METRICS_ALLOW_IPS = ["127.0.0.1"]
    client, tenant = client_for("alice")
    result = sample_tasks.explode.using_job(tenant=tenant).enqueue(label="shown")
    name = f"{PATH}.explode"
    before = scrape()
    work()
    make_due()
    work()
    after = scrape()

    errors = {"type": name, "outcome": "error"}
    runs = [value(s, "webhooks_job_runs_total", **errors) for s in (before, after)]
    assert runs[1] - runs[0] == 2
    assert value(after, "webhooks_jobs_dead", type=name) == 1
    [signal] = dead_job_check(timezone.now() + timedelta(seconds=1))
    assert signal.details["types"] == {name: 1}

    body = client.get(f"/api/v1/jobs/{result.id}/").json()
    assert (body["id"], body["type"], body["state"], body["attempts"]) == (
        result.id,
        name,
        "dead",
        2,
    )
    assert client_for("bob")[0].get(f"/api/v1/jobs/{result.id}/").status_code == 404

    listed = admin_client.get("/admin/trusty_jobs/job/", {"type": name}).context["cl"]
    assert [str(j.id) for j in listed.result_list] == [result.id]
    page = admin_client.get(f"/admin/trusty_jobs/job/{result.id}/change/").content.decode()
    assert "shown went wrong" in page and "ValueError" in page
    assert "whsec_abcdefghijkl" not in page


# --- run_jobs as a process -------------------------------------------------------------


@both
def test_kill_9_of_run_jobs_mid_task_runs_it_again_after_its_lease(commands):
    # No JOBS_MODULES: the worker finds the task by its module path. Timeout 3 s: a
    # lease of 4 s with JOBS_LEASE_MARGIN=1.
    result = sample_tasks.crashable.enqueue("k", key="invoice:9")
    worker = commands("run_jobs", env=subprocess_env(JOBS_LEASE_MARGIN="1"))
    poll(lambda: marks("k:start"), timeout=60, what="the first run started")
    worker.kill()  # SIGKILL: no cleanup
    result.refresh()
    assert (result.status, result.attempts) == ("RUNNING", 1)

    poll(
        lambda: jobs_schedule(timezone.now(), 100)[0]["lease_expired"] == 1,
        timeout=30,
        every=0.2,
        what="the lease expired",
    )
    result.refresh()
    assert (result.status, result.attempts) == ("READY", 1)
    assert [e.exception_class for e in result.errors] == [LeaseExpired]

    def done() -> bool:  # its dead holder's entity lock expires with the lease
        work()
        return state_of(result).state == JobState.DONE

    poll(done, timeout=30, every=0.1, what="the task done")
    result.refresh()
    assert (result.status, result.attempts, result.return_value) == ("SUCCESSFUL", 2, "k")
    assert [m[2] for m in marks()] == ["k:start", "k:start", "k"]
    assert list(JobRun.objects.values_list("outcome", flat=True).order_by("id")) == [
        "lost",
        "done",
    ]


@pytest.mark.django_db
def test_the_backend_module_imports_without_the_backport_and_says_what_to_install(tmp_path):
    code = (
        "import sys; sys.modules['django_tasks'] = None\n"
        "import django; django.setup()\n"
        "import deliveries.jobs.tasks as t\n"
        "try:\n"
        "    t.JobsBackend('default', {})\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    env = subprocess_env(
        DJANGO_SETTINGS_MODULE="tests.host_settings", HOST_SQLITE_PATH=str(tmp_path / "h.db")
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "ImproperlyConfigured" in done.stdout
    assert "trusty-webhooks[tasks]" in done.stdout
