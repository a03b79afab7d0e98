"""The job a worker runs now: ``current_job()`` for the job's own code, and the calls
that set it around the job's function."""

import contextvars
from dataclasses import dataclass

from .registry import JobType


@dataclass
class RunningJob:
    """What ``current_job()`` gives a running job: its ``id`` (the same on every run: the
    idempotency key to give third parties), ``attempt`` (1 on the first run) and
    ``progress(done, total)``, which the worker writes to the row within a second or so
    and at the end of the run."""

    id: object
    type: str
    attempt: int
    tenant_id: object = None
    # The run_jobs process running it (its LoopRun id), when it has one.
    run_id: object = None
    done: int | None = None
    total: int | None = None
    # Set by progress(); the worker writes it with the next lease renewal.
    reported: bool = False

    def progress(self, done: int, total: int | None = None) -> None:
        self.done, self.total, self.reported = int(done), total, True


_current: contextvars.ContextVar[RunningJob | None] = contextvars.ContextVar(
    "deliveries_current_job", default=None
)


def current_job() -> RunningJob:
    """The job this code runs in; raises ``LookupError`` outside a job."""
    running = _current.get()
    if running is None:
        raise LookupError("current_job() is only available inside a running job")
    return running


def call_sync(spec: JobType, running: RunningJob, payload: dict):
    """Run a plain job function with ``current_job()`` set (in a worker thread)."""
    token = _current.set(running)
    try:
        return spec.fn(**payload)
    finally:
        _current.reset(token)


async def call_async(spec: JobType, running: RunningJob, payload: dict):
    """Run a coroutine job on the worker's loop with ``current_job()`` set. Its timeout
    is the worker's to enforce: it cancels the task there, as ``asyncio.timeout`` would,
    with one timer for the coroutines a claim started (``runner.Deadline``)."""
    _current.set(running)  # this task's own context
    return await spec.fn(**payload)
