"""The worker of the host's background jobs (``manage.py run_jobs``).

One thread (the caller's) owns the database work: it claims up to the free slots in one
statement (``statements.CLAIM_JOBS``), takes the entity locks, starts the jobs, and
records whatever finished since its last pass in one statement (``RECORD_JOBS``): no
transaction is open while a job runs. Plain functions run in a pool of ``concurrency``
threads; coroutines on the worker's event loop, a thread of its own. A finished job, a
notification on ``webhooks_jobs`` or a timeout wakes the owner thread.

A sync job past its timeout is recorded as a failed attempt at once; Python cannot stop
its thread, which keeps its slot until the function returns (its result is then thrown
away). A coroutine past its timeout is cancelled.
"""

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from deliveries.core.conf import settings
from deliveries.core.text import mask_secrets

from .. import wakeup
from ..locks import entity_lock_acquire, entity_lock_release
from ..loop import DB_ERRORS, Backoff, StopFlag, reset_connection, with_db_retry
from ..metrics import count_runs
from ..models import JobOutcome
from .registry import JOB_TYPES, Fail, JobType, Retry, Unreadable, find_job_type
from .running import RunningJob, call_async, call_sync
from .state import DEAD, DONE, PENDING
from .statements import CLAIM_JOBS, RECORD_DEFAULTS, RECORD_JOBS, RENEW_JOBS, record_params

logger = logging.getLogger("deliveries.jobs")

# Longest wait of an idle worker between looks (notifications end it early on PostgreSQL).
IDLE_WAIT = 1.0
# The least time between two renewals of the leases and the progress of running jobs.
RENEW_EVERY = 0.5
TRACE_LIMIT = 8000


@dataclass
class Claimed:
    """A job this worker claimed, from the claim's row."""

    id: object
    type: str
    version: int
    payload: dict
    attempt: int
    token: object
    lock_key: str
    tenant_id: object
    deadline: datetime | None


@dataclass
class InFlight:
    job: Claimed
    spec: JobType | None
    running: RunningJob
    started: datetime
    t0: float
    timeout_at: float | None
    lease: float  # seconds a claim or a renewal holds it
    # When (time.monotonic) half the lease is spent: from then on a pass renews it.
    renew_at: float
    # Whether the outcome was taken (a result or a timeout): the other is thrown away.
    settled: bool = False
    future: object = None
    last_progress: tuple | None = None
    # Its entity lock was found taken over at a renewal (logged once).
    lock_lost: bool = False
    # A coroutine cancelled at its timeout (``Deadline``): its cancellation is a timeout.
    timed_out: bool = False


@dataclass
class Result:
    entry: InFlight
    outcome: str  # JobOutcome, or "" for a job given back without a run (lock busy)
    seconds: float = 0.0
    error: str = ""  # one line, for the job row
    trace: str = ""  # the traceback, secrets masked, for the run
    retry_after: float | None = None
    reason: str = ""
    # The function still runs: its entity lock stays until it returns (or expires).
    keep_lock: bool = False
    # The return value kept as JSON text (JobType.keep_result), "" for none.
    result: str = ""
    # The import path of the exception's class, "" for none.
    error_class: str = ""


def describe(exc: BaseException) -> tuple[str, str]:
    """(one line, traceback) of an exception, the service's secrets masked in both."""
    line = mask_secrets("".join(traceback.format_exception_only(exc)).strip())[:2000]
    trace = mask_secrets("".join(traceback.format_exception(exc)))[-TRACE_LIMIT:]
    return line, trace


def class_path(exc_type: type) -> str:
    """An exception class's import path, as Django's tasks record it."""
    return f"{exc_type.__module__}.{exc_type.__qualname__}"[:200]


def classify(
    entry: InFlight, exc: BaseException | None, seconds: float, value: object = None
) -> Result:
    """The outcome of a run that returned ``value`` or raised ``exc``. A return value
    the job's type keeps is turned into JSON here, in the thread that ran the job; one
    it refuses ends the run as that exception (``Fail``: dead at once)."""
    if exc is None:
        keep = entry.spec.keep_result if entry.spec is not None else None
        if keep is None:
            return Result(entry, JobOutcome.DONE, seconds)
        try:
            return Result(entry, JobOutcome.DONE, seconds, result=keep(value) or "")
        except Exception as refused:  # Fail: dead at once; anything else is an error
            exc = refused
    kind = class_path(type(exc))
    if isinstance(exc, Retry):
        return Result(
            entry,
            JobOutcome.RETRY,
            seconds,
            error=str(exc),
            retry_after=exc.after,
            error_class=kind,
        )
    if isinstance(exc, Fail):
        return Result(
            entry,
            JobOutcome.FAILED,
            seconds,
            error=exc.reason,
            reason=exc.reason,
            error_class=kind,
        )
    if isinstance(exc, TimeoutError) and entry.spec and entry.spec.is_async:
        return _timed_out(entry, seconds)
    line, trace = describe(exc)
    return Result(entry, JobOutcome.ERROR, seconds, error=line, trace=trace, error_class=kind)


def _timed_out(entry: InFlight, seconds: float, *, still_running: bool = False) -> Result:
    error = f"timed out after {entry.spec.timeout:g} s"
    return Result(
        entry,
        JobOutcome.TIMEOUT,
        seconds,
        error=error,
        trace=error,
        keep_lock=still_running,
        error_class=class_path(TimeoutError),
    )


class ThreadPool:
    """``size`` daemon threads running plain jobs: a job that never returns cannot hold
    the process's exit (a ThreadPoolExecutor joins its threads at exit)."""

    def __init__(self, size: int) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._work, name=f"job-{i}", daemon=True) for i in range(size)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, fn) -> None:
        self.tasks.put(fn)

    def _work(self) -> None:
        try:
            while (fn := self.tasks.get()) is not None:
                try:
                    fn()
                finally:
                    close_old_connections()  # what the job's own ORM calls opened
        finally:
            connection.close()

    def stop(self, *, wait: float = 2.0) -> None:
        """Let the threads end once the jobs queued are done; wait up to ``wait`` seconds
        (a job stuck past its timeout keeps its daemon thread)."""
        for _ in self.threads:
            self.tasks.put(None)
        deadline = time.monotonic() + wait
        for thread in self.threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0))


class Deadline:
    """The timeout of the coroutines a claim started with the same ``timeout``: one timer
    on the loop for them all instead of an ``asyncio.timeout`` each (a timer handle, its
    place in the loop's heap and its cancellation per job). At the timer, each still
    running is marked timed out and cancelled, as ``asyncio.timeout`` does; once all have
    ended the timer is cancelled, which lets go of their entries."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self.running: dict[asyncio.Task, InFlight] = {}
        self.handle = loop.call_later(seconds, self._expire)

    def _expire(self) -> None:
        for task, entry in self.running.items():  # cancel() runs no callback at once
            entry.timed_out = True
            task.cancel()

    def ended(self, task: asyncio.Task) -> None:
        self.running.pop(task, None)
        if not self.running:
            self.handle.cancel()


class EventLoopThread:
    """The worker's event loop, where coroutine jobs run, in a daemon thread. A claim's
    coroutines are handed over at once (one wake-up of the loop for the batch), with a
    ``Deadline`` per timeout among them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="job-loop", daemon=True)
        self.thread.start()

    def start_all(self, batch: list[tuple["InFlight", object]], done) -> None:
        """Run each (entry, coroutine) as a task; ``done(entry, task)`` in the loop when
        it ends."""

        def start() -> None:
            deadlines: dict[float, Deadline] = {}
            for entry, coro in batch:
                task = self.loop.create_task(coro)
                entry.future = task
                seconds = entry.spec.timeout
                if seconds is None:
                    task.add_done_callback(lambda t, e=entry: done(e, t))
                    continue
                deadline = deadlines.get(seconds)
                if deadline is None:
                    deadline = deadlines[seconds] = Deadline(self.loop, seconds)
                deadline.running[task] = entry
                task.add_done_callback(lambda t, e=entry, d=deadline: (d.ended(t), done(e, t)))

        self.loop.call_soon_threadsafe(start)

    def cancel(self, task) -> None:
        self.loop.call_soon_threadsafe(task.cancel)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class JobWorker:
    """Claims, runs and records the jobs of ``queues``, ``concurrency`` at a time.

    ``step()`` is one pass of the owner thread; ``run()`` repeats it until stopped, then
    lets the jobs in flight finish for ``grace`` seconds and gives back the others."""

    def __init__(
        self,
        *,
        queues: Sequence[str] = ("default",),
        concurrency: int | None = None,
        run_id=None,
        grace: float | None = None,
    ) -> None:
        self.queues = list(queues)
        self.concurrency = concurrency or settings.JOBS_CONCURRENCY
        self.run_id = run_id
        self.grace = settings.WORKER_SHUTDOWN_GRACE if grace is None else grace
        self.counts: Counter = Counter()
        self.in_flight: dict[object, InFlight] = {}
        self.finished: list[Result] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.abandon = threading.Event()
        self.pool: ThreadPool | None = None
        self.event_loop: EventLoopThread | None = None
        self.next_renew = 0.0

    # --- The owner thread's pass -----------------------------------------------------

    def step(self, *, claim: bool = True) -> tuple[int, int]:
        """Record what finished, renew leases, claim for the free slots and start what
        was claimed. Returns (recorded, claimed)."""
        self._time_out()
        recorded = self._record()
        self._renew()
        claimed = 0
        free = self.concurrency - len(self.in_flight)
        if claim and free > 0:
            claimed = self._claim(free)
            if claimed == free:
                claimed = -claimed  # a full claim: more may be due
        return recorded, claimed

    def run(self, *, once: bool = False, until_idle: bool = False) -> Counter:
        """Until ``request_stop`` (``once``: one claim, then its jobs; ``until_idle``: until nothing
        is due or running here), then the shutdown: the grace, then release."""
        listener = None if once else self._listen()
        backoff = Backoff()
        claiming = True
        stop = self.stopping
        try:
            while not stop.is_set():
                self.wake.clear()
                close_old_connections()
                try:
                    recorded, claimed = self.step(claim=claiming)
                    backoff.reset()
                except DB_ERRORS as exc:
                    logger.warning(
                        "database unavailable, retrying",
                        extra={
                            "action": "jobs.db_error",
                            "run_id": str(self.run_id),
                            "error": str(exc),
                        },
                    )
                    reset_connection()
                    stop.wait(backoff.next())
                    continue
                if once:
                    claiming = False
                settled = not self._unsettled()
                if settled and (once or (until_idle and not claimed)):
                    break
                if claimed < 0 or (recorded and claiming):
                    continue  # slots were freed or a full page came: look again at once
                self.wake.wait(self._wait_time())
        finally:
            self.shutdown()
            if listener is not None:
                listener.set()
        return self.counts

    def request_stop(self) -> None:
        """SIGTERM: stop claiming; a second one ends the grace."""
        if self.stopping.is_set():
            self.abandon.set()
        self.stopping.set()
        self.wake.set()

    def shutdown(self) -> None:
        """Let the jobs in flight finish within the grace, record them, and give back
        (``released``, not counted as an attempt) the leases of those still running."""
        deadline = time.monotonic() + self.grace
        backoff = Backoff()
        while self._unsettled() and time.monotonic() < deadline and not self.abandon.is_set():
            self.wake.clear()
            try:
                self.step(claim=False)
            except DB_ERRORS:
                reset_connection()
                time.sleep(backoff.next())
                continue
            self.wake.wait(min(self._wait_time(), max(deadline - time.monotonic(), 0)))
        with self.lock:
            for entry in self.in_flight.values():
                if not entry.settled:
                    entry.settled = True
                    self.finished.append(
                        Result(
                            entry,
                            JobOutcome.RELEASED,
                            time.monotonic() - entry.t0,
                            error="released at shutdown",
                            keep_lock=True,
                        )
                    )
                    if entry.future is not None and self.event_loop is not None:
                        self.event_loop.cancel(entry.future)
        with_db_retry(self._record, StopFlag(), attempts=5)
        if self.pool is not None:
            # Threads still in a job (past its timeout, or released) are left to die
            # with the process: they are daemons.
            self.pool.stop(wait=0.0 if self.in_flight else 2.0)
        if self.event_loop is not None:
            self.event_loop.stop()

    # --- Claim and start -----------------------------------------------------------------

    def _claim(self, free: int) -> int:
        now = timezone.now()
        types = list(JOB_TYPES)
        leases = {t: float(JOB_TYPES[t].lease_seconds) for t in types}
        default_lease = float(settings.JOBS_LEASE_MARGIN * 2)
        rows = CLAIM_JOBS(
            {
                "queues": self.queues,
                "now": now,
                "limit": free,
                "scan": min(free * 2, free + 500),
                "per_tenant": settings.JOBS_TENANT_CONCURRENCY,
                "types": types,
                "leases": list(leases.values()),
                "default_lease": default_lease,
            }
        )
        coroutines: list[tuple[InFlight, object]] = []
        for row in rows:
            claimed = Claimed(*row)
            if isinstance(claimed.payload, str):  # Django's psycopg setup loads jsonb as text
                claimed.payload = {} if claimed.payload == "{}" else json.loads(claimed.payload)
            self._start(claimed, now, leases.get(claimed.type), default_lease, coroutines)
        if coroutines:
            if self.event_loop is None:
                self.event_loop = EventLoopThread()
            self.event_loop.start_all(coroutines, self._async_done)
        self.counts["claimed"] += len(rows)
        return len(rows)

    def _start(
        self,
        job: Claimed,
        now: datetime,
        lease: float | None,
        default_lease: float,
        coroutines: list,
    ) -> None:
        """Start a claimed job: a plain function in the pool, a coroutine added to
        ``coroutines`` (started on the loop with the claim's others); or settle it at once
        (unreadable, or its entity lock held by another job). ``lease``: the seconds the
        claim gave its type, None for a type this process had not registered yet (the
        claim gave it ``default_lease``; it is found now, ``find_job_type``)."""
        running = RunningJob(
            id=job.id,
            type=job.type,
            attempt=job.attempt,
            tenant_id=job.tenant_id,
            run_id=self.run_id,
        )
        t0 = time.monotonic()
        entry = InFlight(
            job=job,
            spec=None,
            running=running,
            started=now,
            t0=t0,
            timeout_at=None,
            lease=lease or default_lease,
            renew_at=t0 + (lease or default_lease) / 2,
        )
        try:
            spec = entry.spec = find_job_type(job.type)
            payload = spec.read(job.version, job.payload)
        except Unreadable as exc:
            reason = str(exc)
            self._settle(
                entry,
                Result(
                    entry,
                    JobOutcome.UNREADABLE,
                    error=reason,
                    reason=reason,
                    error_class=class_path(Unreadable),
                ),
            )
            return
        if lease is None:
            # Renewals hold it for its own lease from the first one, due before the
            # claim's runs out; the entity lock is taken for the claim's.
            entry.lease = spec.lease_seconds
            entry.renew_at = t0 + min(default_lease, entry.lease) / 2
        if job.lock_key and not entity_lock_acquire(
            key=job.lock_key, owner=str(job.token), ttl=lease or default_lease, now=now
        ):
            self._settle(entry, Result(entry, ""))  # held by another job: back, not an attempt
            return
        if spec.timeout is not None:
            entry.timeout_at = entry.t0 + spec.timeout
        with self.lock:
            self.in_flight[job.id] = entry
        if spec.is_async:
            coroutines.append((entry, call_async(spec, running, payload)))
        else:
            if self.pool is None:
                self.pool = ThreadPool(self.concurrency)
            self.pool.submit(lambda e=entry, p=payload: self._run_sync(e, p))

    def _run_sync(self, entry: InFlight, payload: dict) -> None:
        exc = value = None
        try:
            value = call_sync(entry.spec, entry.running, payload)
        except BaseException as e:
            exc = e
        result = classify(entry, exc, time.monotonic() - entry.t0, value)
        if not self._finish(entry, result) and entry.job.lock_key:
            # Recorded at its timeout with the lock kept: the function is done now.
            with contextlib.suppress(DatabaseError):
                entity_lock_release(key=entry.job.lock_key, owner=str(entry.job.token))

    def _async_done(self, entry: InFlight, task) -> None:
        # Cancelled by the worker (a release), its outcome is settled already; cancelled
        # from within, it is an error like any other.
        exc = asyncio.CancelledError() if task.cancelled() else task.exception()
        if entry.timed_out and isinstance(exc, asyncio.CancelledError):
            exc = TimeoutError()  # its Deadline's cancellation, as asyncio.timeout says it
        value = task.result() if exc is None else None
        self._finish(entry, classify(entry, exc, time.monotonic() - entry.t0, value))

    def _finish(self, entry: InFlight, result: Result | None) -> bool:
        """The job's function returned: free its slot, and take ``result`` unless its
        outcome was settled already (a timeout, a release). Returns whether it was taken."""
        taken = False
        with self.lock:
            self.in_flight.pop(entry.job.id, None)
            if result is not None and not entry.settled:
                entry.settled = taken = True
                self.finished.append(result)
        self.wake.set()
        return taken

    def _settle(self, entry: InFlight, result: Result) -> None:
        with self.lock:
            entry.settled = True
            self.finished.append(result)

    def _unsettled(self) -> bool:
        with self.lock:
            return bool(self.finished) or any(not e.settled for e in self.in_flight.values())

    def _time_out(self) -> None:
        now = time.monotonic()
        with self.lock:
            for entry in self.in_flight.values():
                if entry.timeout_at is not None and now >= entry.timeout_at and not entry.settled:
                    if entry.spec.is_async and now < entry.timeout_at + 5:
                        continue  # its Deadline cancels it; this is for one that ignores that
                    entry.settled = True
                    self.finished.append(_timed_out(entry, now - entry.t0, still_running=True))

    def _wait_time(self) -> float:
        """Until the next thing to do: a timeout, or a lease (or the entity lock of a
        function past its timeout) due for renewal, that is half its length from its
        end: a lease shorter than two IDLE_WAITs would otherwise run out between two
        passes. Not sooner than ``_renew`` would renew again."""
        now = time.monotonic()
        soonest = now + IDLE_WAIT
        next_renew = max(self.next_renew, now + 0.01)
        with self.lock:
            for entry in self.in_flight.values():
                if entry.timeout_at is not None and not entry.settled:
                    soonest = min(soonest, max(entry.timeout_at, now + 0.01))
                if entry.running.reported:
                    soonest = min(soonest, now + RENEW_EVERY)
                if entry.spec is not None and (entry.job.lock_key or not entry.settled):
                    soonest = min(soonest, max(entry.renew_at, next_renew))
        return soonest - now

    # --- Record ----------------------------------------------------------------------

    def _record(self) -> int:
        with self.lock:
            results, self.finished = self.finished, []
        if not results:
            return 0
        now = timezone.now()
        try:
            moved = {row[0] for row in RECORD_JOBS(self._record_params(results, now))}
        except BaseException:
            with self.lock:  # not recorded: try again on the next pass
                self.finished[:0] = results
            raise
        for result in results:
            self._log(result, recorded=result.entry.job.id in moved)
        count_runs((r.entry.job.type, r.outcome, r.seconds) for r in results)
        return len(results)

    def _record_params(self, results: Iterable[Result], now: datetime) -> dict:
        rows, others = [], []
        for nth, r in enumerate(results, 1):
            job = r.entry.job
            state, run_at, reason, uncount = self._next_state(r, now)
            r.reason = reason
            running = r.entry.running
            rows.append(
                (job.id, job.token, job.attempt, r.entry.started, round(r.seconds * 1000, 3))
            )
            other = (  # RECORD_OTHER_FIELDS
                state,
                run_at if state == PENDING else None,
                r.error,
                reason[:500],
                uncount,
                running.reported,
                running.done or 0,
                -1 if running.total is None else running.total,
                r.outcome,
                r.trace or r.error,
                r.keep_lock,
                r.result,
                r.error_class,
            )
            if other != RECORD_DEFAULTS:
                others.append((nth, *other))
            self.counts[str(r.outcome or "lock_busy")] += 1
        return record_params(rows, others, now=now, run_id=self.run_id)

    def _next_state(self, r: Result, now: datetime) -> tuple[str, datetime, str, int]:
        """(state, run_at, dead reason, attempts given back) after a result."""
        job, spec = r.entry.job, r.entry.spec
        if r.outcome == "":
            return PENDING, now + timedelta(seconds=settings.JOBS_LOCK_RETRY), "", 1
        if r.outcome == JobOutcome.RELEASED:
            return PENDING, now, "", 1
        if r.outcome == JobOutcome.DONE:
            return DONE, now, "", 0
        if r.outcome in (JobOutcome.FAILED, JobOutcome.UNREADABLE):
            return DEAD, now, r.reason, 0
        if r.outcome == JobOutcome.RETRY:
            if job.attempt >= spec.max_attempts:
                return DEAD, now, f"attempts exhausted ({job.attempt}): {r.error}", 0
            return PENDING, now + timedelta(seconds=r.retry_after or 0.0), "", 0
        delay = spec.retry_delay(job.attempt)
        if delay is None:
            return DEAD, now, f"attempts exhausted ({job.attempt}): {r.error}", 0
        return PENDING, now + timedelta(seconds=delay), "", 0

    def _log(self, r: Result, *, recorded: bool) -> None:
        level = logging.DEBUG if r.outcome == JobOutcome.DONE and recorded else logging.INFO
        if not logger.isEnabledFor(level):
            return
        job = r.entry.job
        logger.log(
            level,
            "job run",
            extra={
                "action": "job.run",
                "job_type": job.type,
                "job_id": str(job.id),
                "tenant_id": str(job.tenant_id) if job.tenant_id else "",
                "attempt": job.attempt,
                "outcome": r.outcome or "lock_busy",
                "duration_ms": round(r.seconds * 1000, 1),
                "run_id": str(self.run_id) if self.run_id else "",
                # False: the lease was lost meanwhile (the sweep gave the job back).
                "recorded": recorded,
                **({"reason": r.reason[:200]} if r.reason else {}),
                **({"error": r.error[:200]} if r.error and r.outcome != JobOutcome.DONE else {}),
            },
        )

    # --- Leases and progress ---------------------------------------------------------

    def _renew(self) -> None:
        """Extend the leases ending within half their length, write reported progress,
        and renew the entity locks of the jobs renewed (in the same statement), and those
        of functions still running past their recorded timeout (so that no job on their
        entity starts before they return)."""
        clock = time.monotonic()
        if clock < self.next_renew:
            return
        self.next_renew = clock + RENEW_EVERY
        now = timezone.now()
        due: list[InFlight] = []
        overrunning: list[InFlight] = []
        with self.lock:
            for entry in self.in_flight.values():
                if entry.spec is None:
                    continue
                if entry.settled:
                    if entry.job.lock_key and clock >= entry.renew_at:
                        overrunning.append(entry)
                    continue
                report = (entry.running.done, entry.running.total)
                progressed = entry.running.reported and report != entry.last_progress
                if progressed or clock >= entry.renew_at:
                    due.append(entry)
        for entry in overrunning:
            entry.renew_at = clock + entry.lease / 2
            entity_lock_acquire(
                key=entry.job.lock_key,
                owner=str(entry.job.token),
                ttl=entry.lease,
                now=now,
            )
        if not due:
            return
        params = {"id": [], "token": [], "until": [], "reported": [], "done": [], "total": []}
        for entry in due:
            running = entry.running
            params["id"].append(entry.job.id)
            params["token"].append(entry.job.token)
            params["until"].append(now + timedelta(seconds=entry.lease))
            params["reported"].append(running.reported)
            params["done"].append(running.done or 0)
            params["total"].append(-1 if running.total is None else running.total)
        params["now"] = now
        held = dict(RENEW_JOBS(params))  # the lease and the entity lock in one statement
        for entry in due:
            entry.last_progress = (entry.running.done, entry.running.total)
            if entry.job.id not in held:
                logger.warning(
                    "job lease lost",
                    extra={"action": "job.lease_lost", "job_id": str(entry.job.id),
                           "job_type": entry.job.type},
                )  # fmt: skip
                continue
            entry.renew_at = clock + entry.lease / 2
            if not held[entry.job.id] and not entry.lock_lost:
                # The lock expired and another job took it: that job may be running on
                # the entity now. Nothing can undo that; this job runs on (its function
                # cannot be stopped) and the lock is not taken back (RENEW_JOBS).
                entry.lock_lost = True
                logger.warning(
                    "job entity lock lost",
                    extra={"action": "job.lock_lost", "job_id": str(entry.job.id),
                           "job_type": entry.job.type, "lock_key": entry.job.lock_key},
                )  # fmt: skip

    # --- Wake-ups --------------------------------------------------------------------

    def _listen(self):
        """A thread waiting for ``webhooks_jobs`` notifications (PostgreSQL): each wakes
        the owner thread. Returns the event that ends it, or None without notifications."""
        if not wakeup.available():
            return None
        listener = wakeup.Listener(wakeup.JOBS)
        done = threading.Event()

        def listen() -> None:
            try:
                while not done.is_set():
                    if listener.wait(IDLE_WAIT, done):
                        self.wake.set()
            finally:
                listener.close()

        threading.Thread(target=listen, name="job-listener", daemon=True).start()
        return done  # set: the thread ends within IDLE_WAIT, closing its connection
