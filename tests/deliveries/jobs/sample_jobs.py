"""Job types for the background jobs' tests, registered on import (the processes the
tests start load them with JOBS_MODULES=tests.deliveries.jobs.sample_jobs).

Runs that must be seen from the test write a mark to ``test_job_marks``, a table of the
tests' own (made by ``ensure_marks``): the job's id, attempt, a label, the process and
the start and end times of the run."""

import asyncio
import os
import time

from asgiref.sync import sync_to_async
from django.db import connection

from deliveries.jobs.background import Fail, Retry, current_job, job

MARKS = "test_job_marks"


def ensure_marks() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {MARKS} (job_id varchar(40), attempt integer, "
            "label varchar(100), pid integer, started double precision, ended double precision)"
        )
        cursor.execute(f"DELETE FROM {MARKS}")


def marks(label: str | None = None) -> list[tuple]:
    """(job_id, attempt, label, pid, started, ended) of every run, by start time."""
    sql = f"SELECT job_id, attempt, label, pid, started, ended FROM {MARKS}"
    with connection.cursor() as cursor:
        if label is None:
            cursor.execute(sql + " ORDER BY started")
        else:
            cursor.execute(sql + " WHERE label = %s ORDER BY started", [label])
        return list(cursor.fetchall())


def _mark(label: str, started: float) -> None:
    running = current_job()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {MARKS} VALUES (%s, %s, %s, %s, %s, %s)",
            [str(running.id), running.attempt, label, os.getpid(), started, time.time()],
        )


@job("test.noop")
def noop(**_):
    return None


@job("test.async_noop")
async def async_noop(**_):
    return None


@job("test.mark", lock=lambda key="", **_: key, timeout=30)
def mark(label="", seconds=0.0, key=""):
    started = time.time()
    time.sleep(seconds)
    _mark(label, started)


def _mark_and_close(label: str, started: float) -> None:
    # asgiref's executor thread outlives the job: its connection must not.
    try:
        _mark(label, started)
    finally:
        connection.close()


@job("test.overrun", lock=lambda key="", **_: key, timeout=0.3, max_attempts=1)
def overrun(label="", seconds=0.0, key=""):
    """Runs past its timeout, under an entity lock."""
    started = time.time()
    time.sleep(seconds)
    _mark(label, started)


@job("test.long", timeout=None)
def long(label="", seconds=0.0):
    """No timeout: its lease is renewed while it runs."""
    started = time.time()
    time.sleep(seconds)
    _mark(label, started)


@job("test.async_mark")
async def async_mark(label="", seconds=0.0):
    started = time.time()
    await asyncio.sleep(seconds)
    await sync_to_async(_mark_and_close)(label, started)


@job("test.flaky", max_attempts=3, retry={"schedule": (0.2, 0.2), "jitter": 0.0})
def flaky(label="", succeed_on=99):
    _mark(label, time.time())
    if current_job().attempt < succeed_on:
        raise ValueError("upstream said no (token whsec_abcdefghijkl)")


@job("test.retry_after")
def retry_after(label="", after=1.0):
    _mark(label, time.time())
    if current_job().attempt == 1:
        raise Retry(after=after)


@job("test.fail")
def fail(label=""):
    _mark(label, time.time())
    raise Fail("invoice 42 does not exist")


@job("test.slow", timeout=60)
def slow(label="", seconds=5.0):
    started = time.time()
    current_job().progress(0, 2)
    time.sleep(seconds / 2)
    current_job().progress(1, 2)
    time.sleep(seconds / 2)
    _mark(label, started)


@job("test.crashable", timeout=3, lock=lambda key="", **_: key)
def crashable(label="", key=""):
    """Hangs on its first run (the test kills the worker meanwhile), returns after."""
    _mark(f"{label}:start", time.time())
    if current_job().attempt == 1:
        time.sleep(60)
    _mark(label, time.time())


@job("test.timeout", timeout=0.3, max_attempts=1)
def times_out(seconds=2.0):
    time.sleep(seconds)


@job("test.async_timeout", timeout=0.3, max_attempts=1)
async def async_times_out(label="", seconds=2.0):
    """A coroutine past its timeout (when ``seconds`` > 0.3): it is cancelled there. A
    cancelled run says so in the marks, with the time it was cut off."""
    started = time.time()
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        await sync_to_async(_mark_and_close)(f"{label}:cancelled", started)
        raise
    await sync_to_async(_mark_and_close)(label, started)


@job("test.versioned", version=2)
def versioned(label="", amount_cents=0):
    _mark(f"{label}:{amount_cents}", time.time())


@versioned.reads(1)
def _versioned_from_v1(payload: dict) -> dict:
    return {"label": payload["label"], "amount_cents": int(payload["amount"] * 100)}


@job("test.unversioned_reader_missing", version=3)
def needs_reader(**_):
    return None
