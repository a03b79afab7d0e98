"""The soak's background jobs (loaded with JOBS_MODULES=tests.chaos.jobs, by the driver,
which enqueues them, and by the ``run_jobs`` processes it kills).

Every run writes two lines to the file named by ``SOAK_JOB_LOG`` (one file per process
start, chosen by the driver): ``start`` when the function is entered and ``end`` just
before it returns or raises, each with the wall clock. A line is written with one
``write`` to a file opened ``O_APPEND``: once the call returns it is the kernel's, and a
``kill -9`` of the process cannot take it back. A run with a ``start`` and no ``end``
was cut short by its process's death, whose time the driver records; so each run's
interval is known exactly (the end, or the death), without asking the database, which
the soak restarts. The ledger checks those intervals per entity lock key for overlap.

The functions do no work of their own but sleep for the payload's ``ms``: what is under
test is the machinery that claims, locks, retries and records them.
"""

import json
import os
import threading
import time
from contextlib import contextmanager

from deliveries.jobs.background import Fail, Retry, current_job, job

LOG_ENV = "SOAK_JOB_LOG"
FAIL_REASON = "soak: designed to fail"
EXHAUST_ATTEMPTS = 3
# Seconds a run may take: far above what these take, so a timeout means a stall. With
# the soak's JOBS_LEASE_MARGIN of 3 s, a killed worker's job comes back after 8 s.
TIMEOUT = 5.0
# High enough that the kills (each costs the jobs in flight an attempt) never spend the
# attempts of a job that is meant to succeed.
MAX_ATTEMPTS = 12
SHORT_RETRIES = {"schedule": (0.2, 0.5, 1.0), "jitter": 0.2}

_write_lock = threading.Lock()
_fd: int | None = None


def entity_key(entity=None, **_) -> str:
    """The entity lock of a job whose payload names an entity; none otherwise."""
    return "" if entity is None else f"soak-entity:{entity}"


def _log(**fields) -> None:
    global _fd
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = (json.dumps(fields, separators=(",", ":")) + "\n").encode()
    with _write_lock:
        if _fd is None:
            _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(_fd, line)


@contextmanager
def recorded_run(entity, ms: float):
    """Log the run's start, sleep ``ms``, run the body, log its end and outcome."""
    running = current_job()
    ids = {"job": str(running.id), "attempt": running.attempt, "key": entity_key(entity)}
    _log(ev="start", t=time.time(), **ids)
    outcome = "ok"
    try:
        time.sleep(ms / 1000)
        yield running
    except Retry:
        outcome = "retry"
        raise
    except Fail:
        outcome = "fail"
        raise
    except Exception:
        outcome = "error"
        raise
    finally:
        _log(ev="end", t=time.time(), outcome=outcome, **ids)


@job("soak.ok", lock=entity_key, timeout=TIMEOUT, max_attempts=MAX_ATTEMPTS)
def ok(i, entity=None, ms=0.0):
    with recorded_run(entity, ms):
        pass


@job(
    "soak.flaky",
    lock=entity_key,
    timeout=TIMEOUT,
    max_attempts=MAX_ATTEMPTS,
    retry=SHORT_RETRIES,
)
def flaky(i, entity=None, ms=0.0, succeed_on=3):
    """Fails (an exception, retried by its policy) until attempt ``succeed_on``."""
    with recorded_run(entity, ms) as running:
        if running.attempt < succeed_on:
            raise ValueError(f"soak: flaky until attempt {succeed_on}")


@job("soak.retry_after", lock=entity_key, timeout=TIMEOUT, max_attempts=MAX_ATTEMPTS)
def retry_after(i, entity=None, ms=0.0, after=0.5):
    """Asks for a retry ``after`` seconds on its first attempt, then succeeds."""
    with recorded_run(entity, ms) as running:
        if running.attempt == 1:
            raise Retry(after=after)


@job("soak.fail", lock=entity_key, timeout=TIMEOUT, max_attempts=MAX_ATTEMPTS)
def fail(i, entity=None, ms=0.0):
    """Dead at once with FAIL_REASON."""
    with recorded_run(entity, ms):
        raise Fail(FAIL_REASON)


@job(
    "soak.exhaust",
    lock=entity_key,
    timeout=TIMEOUT,
    max_attempts=EXHAUST_ATTEMPTS,
    retry={"schedule": (0.2,), "jitter": 0.0},
)
def exhaust(i, entity=None, ms=0.0):
    """Always raises: dead once its EXHAUST_ATTEMPTS are spent."""
    with recorded_run(entity, ms):
        raise ValueError("soak: always fails")
