"""Django tasks (``@task`` of the django-tasks backport) for the Tasks backend's tests,
on the project's ``TASKS`` (deliveries.jobs.tasks.JobsBackend). The processes the tests
start find them by their module path, as any worker does. Runs that the tests must see
write a mark (sample_jobs.marks)."""

import asyncio
import threading
import time

from asgiref.sync import sync_to_async
from django_tasks import task

from deliveries.jobs.background import Fail, current_job
from deliveries.jobs.tasks import task_options
from tests.deliveries.jobs.sample_jobs import _mark, _mark_and_close


@task
def add(a, b):
    return a + b


@task(priority=10, queue_name="default")
def mark(label, seconds=0.0):
    started = time.time()
    time.sleep(seconds)
    _mark(label, started)
    return {"label": label}


@task
async def async_mark(label):
    started = time.time()
    await asyncio.sleep(0.01)
    await sync_to_async(_mark_and_close)(label, started)
    return [label, threading.current_thread().name]  # the worker's loop: "job-loop"


@task(max_attempts=2)
def explode(label):
    _mark(label, time.time())
    raise ValueError(f"{label} went wrong (token whsec_abcdefghijkl)")


@task
def refuse(invoice_id):
    raise Fail(f"invoice {invoice_id} does not exist")


@task(takes_context=True)
def with_context(context, label):
    _mark(label, time.time())
    return {"id": context.task_result.id, "attempt": context.attempt}


@task(timeout=3, lock=lambda label, key: key)
def crashable(label, key):
    """Hangs on its first run (the test kills the worker meanwhile), returns after."""
    _mark(f"{label}:start", time.time())
    if current_job().attempt == 1:
        time.sleep(60)
    _mark(label, time.time())
    return label


def not_a_task(label):
    """A module-level function the tests make a task of (or refuse to)."""
    return label


@task
def returns(value):
    return {"set": set(value)} if value == "a set" else value


@task
@task_options(max_attempts=1, timeout=0.5, lock=lambda key: f"opt:{key}")
def optioned(key):
    time.sleep(1)


@task
def plain():
    return None
