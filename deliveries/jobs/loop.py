"""The loop runner: every long-running command is a "do one unit of work, say whether
there was work" function run by ``run_loop`` until told to stop, with a LoopRun row whose
heartbeat a thread of its own refreshes.

The loop survives database trouble: a dropped connection or a restarting server is
logged, the connection closed, and the unit tried again after a short backoff (the one
rule for it is ``Backoff``; ``with_db_retry`` for a single call). SIGTERM and SIGINT
finish the unit under way, then stop.
"""

import contextlib
import gc
import logging
import os
import signal
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
)
from django.utils import timezone

from deliveries.core.conf import settings

from . import wakeup
from .models import LoopRun

logger = logging.getLogger("deliveries")

SOON_WAIT = 0.02
BLOCKED_WAIT = 0.05


@dataclass
class Tick:
    """What one unit of work did. ``busy``: run again at once. ``soon``: it did some work,
    so look again shortly. ``blocked``: due work waits for a slot under a ceiling.
    ``idle``: nothing is left for this loop now (``--until-idle`` stops)."""

    counts: Counter = field(default_factory=Counter)
    busy: bool = False
    soon: bool = False
    blocked: bool = False
    idle: bool = False
    # Seconds to wait before the next unit, whatever notifications arrive meanwhile
    # (unless ``busy``).
    pause: float = 0.0


# Young-generation collections run after this many net container allocations. A worker
# holds about 25,000 young objects for its 256 requests in flight; at CPython's default of
# 700 every collection walks them again (a fifth of a worker's CPU, measured with perf).
GC_YOUNG_THRESHOLD = 50_000


def settle_heap() -> None:
    """Tune the garbage collector for a long-running loop process, once its start-up is
    done: move everything alive now (Django, the models, the settings) out of the
    collector's sight with ``gc.freeze()``, and collect the young generation less often.

    Reference counting still frees acyclic garbage at once; only cycles wait longer. For
    process entry points only: the frozen objects are never collected, so a test process
    calling this would keep whatever it froze.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 100)


class StopFlag:
    """Set by SIGTERM or SIGINT; the loop finishes its unit of work and returns."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.event.set())

    @property
    def is_set(self) -> bool:
        return self.event.is_set()


def start_run(kind: str) -> LoopRun:
    now = timezone.now()
    return LoopRun.objects.create(
        kind=kind, host=socket.gethostname(), pid=os.getpid(), started_at=now, heartbeat_at=now
    )


def save_run(run: LoopRun, ticks: int, counts: Mapping, *, finished: bool = False) -> None:
    """Refresh a run's heartbeat and progress; ``finished`` closes it. Guarded on the run
    being open, so a late heartbeat never reopens a finished run."""
    now = timezone.now()
    LoopRun.objects.filter(id=run.id, finished_at__isnull=True).update(
        heartbeat_at=now,
        ticks=ticks,
        counts=dict(counts),
        finished_at=now if finished else None,
    )


class Heartbeat:
    """Calls ``beat`` every ``LOOP_HEARTBEAT_SECONDS``, busy or idle, from a thread of its
    own, while the ``with`` block runs. Every long-running command beats through this
    (``recorded_run``; the backfill for its own run row).

    A thread, so that no unit of work delays it: a worker whose lanes are all sending, a
    poll reading a thousand pages, a backfill waiting for its rate limit. A beat says the
    process runs and reaches its database; whether it gets work done is in the counts a
    beat writes and in the flow metrics (oldest due delivery, relay lag). A failed beat
    is logged and tried again at the next period. The thread keeps one database
    connection of its own, closed when the block ends."""

    def __init__(self, beat: Callable[[], object], *, name: str, every: float | None = None):
        self.beat = beat
        self.every = settings.LOOP_HEARTBEAT_SECONDS if every is None else every
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Heartbeat":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        # A beat stuck on an unanswering database must not hold the process's exit; a
        # beat that lands after the final record is refused by its guard (save_run).
        self.thread.join(timeout=5.0)

    def __enter__(self) -> "Heartbeat":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self.stopped.wait(self.every):
                close_old_connections()
                try:
                    self.beat()
                except Exception as exc:
                    logger.warning(
                        "heartbeat failed",
                        extra={"action": "heartbeat.failed", "error": str(exc)[:200]},
                    )
                    reset_connection()
        finally:
            reset_connection()


@contextlib.contextmanager
def recorded_run(
    kind: str, stop: "StopFlag", progress: Callable[[], tuple[int, Mapping]]
) -> Iterator[LoopRun | None]:
    """The LoopRun row of a long-running command: created at start (waiting for the
    database as the loops do; ``None`` if stopped first), its heartbeat and
    ``progress()`` (ticks, counts) refreshed on the period while the block runs, closed
    with the final progress when it ends."""
    run = with_db_retry(lambda: start_run(kind), stop)
    if run is None:
        yield None
        return
    try:
        with Heartbeat(lambda: save_run(run, *progress()), name=f"{kind}-heartbeat"):
            yield run
    finally:
        with_db_retry(lambda: save_run(run, *progress(), finished=True), stop, attempts=3)


def run_loop(
    kind: str,
    unit: Callable[[], Tick],
    *,
    once: bool = False,
    until_idle: bool = False,
    interval: float = 0.2,
    stop: StopFlag | None = None,
    listen: tuple[str, ...] = (),
) -> Counter:
    """Run ``unit`` until stopped (``once``: a single unit; ``until_idle``: until a unit
    reports nothing left). Returns the summed counts, also kept in a LoopRun row whose
    heartbeat ``recorded_run`` refreshes on its period, whatever the unit is doing.

    Pacing: at once while busy; after the unit's ``pause`` when it asks for one; after
    SOON_WAIT while there is work in motion, and BLOCKED_WAIT while due work waits under
    a ceiling; when idle,
    a wait that doubles from SOON_WAIT up to ``interval``, so an idle loop costs little
    and a busy one answers within milliseconds. With ``listen`` channels (PostgreSQL,
    deliveries.wakeup) a notification ends the blocked and the idle waits early, and an
    idle loop waits the whole ``interval`` at once."""
    stop = stop or StopFlag()
    totals: Counter = Counter()
    ticks = 0
    with recorded_run(kind, stop, lambda: (ticks, dict(totals))) as run:
        if run is None:
            return totals
        listen = listen if wakeup.available() else ()  # nothing to listen on: poll
        listener = wakeup.Listener(*listen) if listen and not once else None

        def wait(seconds: float) -> None:
            if listener is None:
                stop.event.wait(seconds)
            else:
                listener.wait(seconds, stop.event)

        logger.info("loop started", extra={"action": f"{kind}.start", "run_id": str(run.id)})
        backoff = Backoff()
        idle_wait = SOON_WAIT
        while not stop.is_set:
            close_old_connections()
            try:
                tick = unit()
                backoff.reset()
            except DB_ERRORS as exc:
                logger.warning(
                    "database unavailable, retrying",
                    extra={"action": f"{kind}.db_error", "run_id": str(run.id), "error": str(exc)},
                )
                reset_connection()
                stop.event.wait(backoff.next())
                continue
            ticks += 1
            totals.update(tick.counts)
            if any(tick.counts.values()):
                logger.info(
                    "tick",
                    extra={"action": f"{kind}.tick", "run_id": str(run.id), **dict(tick.counts)},
                )
            if once or (until_idle and tick.idle):
                break
            if tick.pause and not tick.busy:
                idle_wait = SOON_WAIT
                stop.event.wait(tick.pause)
                if listener is not None:
                    listener.drain()  # what arrived meanwhile is what the next unit finds
            elif tick.busy or tick.soon:
                idle_wait = SOON_WAIT
                if not tick.busy:
                    # Pacing while work flows, not idleness: notifications (one per publish,
                    # say) wait here, so that what arrives meanwhile makes one page instead
                    # of a pass each.
                    stop.event.wait(SOON_WAIT)
                if listener is not None:
                    listener.drain()  # read, never left to pile up while work flows
            elif tick.blocked:
                idle_wait = SOON_WAIT
                wait(BLOCKED_WAIT)
            else:
                wait(interval if listener else idle_wait)
                idle_wait = min(idle_wait * 2, interval)
        if listener is not None:
            listener.close()
    logger.info(
        "loop stopped", extra={"action": f"{kind}.stop", "run_id": str(run.id), **dict(totals)}
    )
    return totals


# --- Database trouble: the one retry rule ------------------------------------------------

# What a dropped connection or a restarting server raises. Anything else is a bug and
# propagates.
DB_ERRORS = (OperationalError, InterfaceError)


class Backoff:
    """The waits between tries after a database error: doubling from ``first`` seconds
    to ``cap``. Every loop and retry of the job machinery waits by it."""

    def __init__(self, first: float = 0.5, cap: float = 10.0) -> None:
        self.first, self.cap = first, cap
        self.delay = first

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.delay = self.first


def reset_connection() -> None:
    """Close the connection after a database error, so the next try opens a fresh one."""
    with contextlib.suppress(DatabaseError):
        connection.close()


def with_db_retry(fn, stop: StopFlag, *, attempts: int = 20):
    """``fn()``, tried again after a database error up to ``attempts`` times; ``None``
    when the tries ran out or ``stop`` was set while waiting."""
    backoff = Backoff()
    for _ in range(attempts):
        try:
            return fn()
        except DB_ERRORS:
            reset_connection()
            if stop.event.wait(backoff.next()):
                return None
    return None
