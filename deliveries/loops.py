"""The scheduler and the relay: each a "do one unit of work, say whether there was work"
function, and one loop that runs such a function until told to stop.

The loop survives database trouble: a dropped connection or a restarting server is
logged, the connection closed, and the unit tried again after a short backoff. SIGTERM
and SIGINT finish the unit under way, then stop.
"""

import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)
from django.db.models import Q
from django.utils import timezone

from deliveries.conf import settings
from deliveries.prometheus import LEASE_EXPIRIES, LOST_DISPATCHES

from . import broker as transport
from . import jobs, state, tracing, wakeup
from .faults import crash_point
from .models import Delivery, LoopRun, Outbox
from .policy import RetryPolicy
from .sql import bound_cursor

logger = logging.getLogger("deliveries")

SOON_WAIT = 0.02
BLOCKED_WAIT = 0.05
# While the global in-flight ceiling is full, the scheduler comes back when about this
# share of it can have been freed (at the rate the workers freed slots since its last
# pass), waiting at least SOON_WAIT and at most REFILL_MAX_WAIT (refill_pause).
REFILL_SHARE = 0.1
REFILL_MAX_WAIT = 0.2


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
    # The scheduler's sweeps left work: sweep again on the next pass.
    sweep_busy: bool = False
    # The scheduler's admission pass, if it ran.
    admission: state.AdmissionResult | None = None
    # Seconds to wait before the next unit, whatever notifications arrive meanwhile
    # (unless ``busy``).
    pause: float = 0.0


# --- Scheduler ---------------------------------------------------------------------------


def scheduler_tick(*, page_size: int | None = None, sweep: bool = True) -> Tick:
    """One pass of the recovery clock: admit one page of due deliveries and, when
    ``sweep``, expire leases, recover lost dispatches and run the other job kinds'
    scheduling (their admission, expiries and recoveries)."""
    now = timezone.now()
    page_size = page_size or settings.SCHEDULER_PAGE_SIZE
    tick = Tick()
    others_busy = False
    if sweep:
        policy = RetryPolicy.from_settings()
        tick.counts["lease_expired"] = state.expire_leases(now=now, limit=page_size, policy=policy)
        tick.counts["transport_lost"] = state.recover_lost_dispatches(
            now=now, older_than=settings.SCHEDULER_STALE_ENQUEUED_SECONDS, limit=page_size
        )
    admitted = state.admit_due(now=now, page_size=page_size, limits=state.Limits.from_settings())
    tick.admission = admitted
    tick.counts["enqueued"] = admitted.admitted
    tick.counts["held_back"] = admitted.held_back
    expiries_left = tick.counts["lease_expired"] >= page_size  # a full page: more may wait
    tick.busy = admitted.admitted >= page_size or expiries_left
    if sweep:
        for kind in jobs.KINDS.values():
            counts, more = kind.schedule(now, page_size)
            tick.counts.update({f"{kind.name}.{k}": v for k, v in counts.items()})
            others_busy |= more
        tick.sweep_busy = others_busy or expiries_left
    if sweep and not tick.busy and admitted.admitted == 0 and not others_busy:
        tick.idle = not Delivery.objects.filter(
            Q(state__in=state.IN_FLIGHT) | Q(state=state.PENDING, next_attempt_at__lte=now)
        ).exists()
    tick.busy |= others_busy
    _count_recoveries(tick.counts)
    tick.soon = admitted.admitted > 0
    # Work waits for a slot: look again at a steady pace, not in a tight loop (each pass
    # counts the rows in flight).
    tick.blocked = bool(admitted.held_back or admitted.saturated)
    return tick


class SchedulerPasses:
    """The scheduler loop's unit: admission on every pass, the sweeps (lease expiry,
    lost dispatches, the other job kinds) at most every ``sweep_every`` seconds, or on
    the next pass while the last sweep left work.

    Admission runs whenever workers free slots (a FREED notification ends the wait), so
    under load a pass comes every few tens of milliseconds; the sweeps look for work
    that only a lease or a backoff running out creates, so repeating them that often
    only cost their queries (about half of the scheduler's CPU under load).

    While the global in-flight ceiling is full, a pass can admit only the slots freed
    since the last one, and every recording frees some: a pass after each would admit a
    few hundred rows at a time, each pass counting the thousands in flight and each
    admission making a relay page. So a pass that fills the ceiling asks the loop to
    pause (``refill_pause``) until about a tenth of it can be free again.
    """

    def __init__(self, *, page_size: int | None = None, sweep_every: float | None = None):
        self.page_size = page_size
        self.sweep_every = settings.SCHEDULER_INTERVAL if sweep_every is None else sweep_every
        self.next_sweep = 0.0
        # When the last pass began, and the rows in flight when it ended.
        self.last: tuple[float, int] | None = None

    def __call__(self) -> Tick:
        started = time.monotonic()
        sweep = started >= self.next_sweep
        tick = scheduler_tick(page_size=self.page_size, sweep=sweep)
        if sweep and not tick.sweep_busy:
            self.next_sweep = started + self.sweep_every
        admission = tick.admission
        if admission is not None:
            last, self.last = self.last, (started, admission.in_flight + admission.admitted)
            if admission.filled and last is not None:
                freed = last[1] - admission.in_flight
                tick.pause = refill_pause(freed, started - last[0], settings.DELIVERY_MAX_IN_FLIGHT)
        return tick


def refill_pause(freed: int, seconds: float, max_in_flight: int) -> float:
    """How long the scheduler waits after a pass that filled the global ceiling: the
    time the workers take to free REFILL_SHARE of it, at the rate they freed ``freed``
    slots in the ``seconds`` since the pass before, between SOON_WAIT and REFILL_MAX_WAIT.
    Nothing freed (or a clock that did not move): the longest wait. A small ceiling on
    fast workers waits SOON_WAIT, as every other pass that admitted work does."""
    if freed <= 0 or seconds <= 0:
        return REFILL_MAX_WAIT
    wait = REFILL_SHARE * max_in_flight * seconds / freed
    return min(max(wait, SOON_WAIT), REFILL_MAX_WAIT)


def _count_recoveries(counts: Counter) -> None:
    for key, n in counts.items():
        if not n:
            continue
        job, _, what = key.rpartition(".")
        if what == "lease_expired":
            LEASE_EXPIRIES.labels(job or "delivery").inc(n)
        elif what == "transport_lost":
            LOST_DISPATCHES.labels(job or "delivery").inc(n)


# --- Relay -------------------------------------------------------------------------------


def relay_tick(*, page_size: int | None = None, b=None) -> Tick:
    """Publish one page of unpublished outbox rows to the broker.

    With the database broker (the default) the queue is a table beside the outbox: one
    transaction takes the page, marks it published and inserts its messages, so a relay
    that dies anywhere leaves the page as it found it, at once available to another relay.

    With any other broker the page is claimed for ``RELAY_CLAIM_SECONDS`` in a short
    transaction, published with no transaction open, then marked published. A relay that
    dies in between leaves the rows to be published again after the claim runs out: the
    broker may then carry two copies of a message, which the workers' lease guard turns
    into one attempt.
    """
    page_size = page_size or settings.RELAY_PAGE_SIZE
    b = b or transport.broker()
    now = timezone.now()
    tick = Tick()
    if isinstance(b, transport.DatabaseBroker):
        with transaction.atomic():
            rows = _outbox_page(now, page_size, "published_at", now)
            if rows:
                _publish_page(b, rows)
    else:
        until = now + timedelta(seconds=settings.RELAY_CLAIM_SECONDS)
        rows = _outbox_page(now, page_size, "claimed_until", until)
        if rows:
            _publish_page(b, rows)
            _mark_published([r[0] for r in rows], timezone.now())
    if not rows:
        tick.idle = not Outbox.objects.filter(published_at__isnull=True).exists()
        return tick
    tick.counts["published"] = len(rows)
    tick.busy = len(rows) >= page_size
    tick.soon = True
    return tick


def _publish_page(b, rows: list[tuple]) -> None:
    """Put a page of outbox rows (id, ref_id, dispatch, priority, kind) on the broker,
    between the relay's two crash points."""
    crash_point("relay.before_publish")
    messages = [transport.Message(r[1], r[2], r[3], r[4]) for r in rows]
    spans = _relay_spans(messages) if tracing.enabled() else {}
    if spans:
        messages = [
            replace(m, traceparent=tracing.traceparent_of(spans[m.job_id]))
            if m.job_id in spans
            else m
            for m in messages
        ]
    try:
        transport.publish(b, messages)
    finally:
        for span in spans.values():
            span.end()
    crash_point("relay.after_publish")


def _relay_spans(messages: list) -> dict:
    """One ``webhooks.relay`` span per delivery published, continuing the trace its
    event was published in (tracing on only: one extra query per page)."""
    ids = [m.job_id for m in messages if m.kind == state.DELIVERY_KIND]
    contexts = dict(
        Delivery.objects.filter(id__in=ids)
        .exclude(event__trace_context="")
        .values_list("id", "event__trace_context")
    )
    return {
        m.job_id: tracing.start_span(
            "webhooks.relay",
            parent=contexts[m.job_id],
            kind="PRODUCER",
            delivery_id=str(m.job_id),
            dispatch=m.dispatch,
        )
        for m in messages
        if m.job_id in contexts
    }


# One page of unpublished rows that no relay holds a claim on, oldest first, locked so
# that relays divide the work, with one column set: claimed_until (the claim of a relay
# publishing to a broker outside the database), or published_at (the database broker's
# page, marked inside the transaction that inserts its messages). The inner SELECT uses
# the partial index outbox_unpublished.
_OUTBOX_PAGE_SQL = """
UPDATE deliveries_outbox SET {column} = %(value)s
WHERE id IN (
    SELECT id FROM deliveries_outbox
    WHERE published_at IS NULL AND (claimed_until IS NULL OR claimed_until < %(now)s)
    ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED
)
RETURNING id, ref_id, dispatch, priority, kind
"""


def _outbox_page(now, page_size: int, column: str, value) -> list[tuple]:
    """(id, ref_id, dispatch, priority, kind) of the page, oldest first; ``column`` is
    ``claimed_until`` or ``published_at``."""
    if connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(
                _OUTBOX_PAGE_SQL.format(column=column),
                {"value": value, "now": now, "limit": page_size},
            )
            return sorted(cursor.fetchall())
    with transaction.atomic():
        rows = list(
            Outbox.objects.filter(published_at__isnull=True)
            .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
            .order_by("id")
            .values_list("id", "ref_id", "dispatch", "priority", "kind")[:page_size]
        )
        Outbox.objects.filter(id__in=[r[0] for r in rows]).update(**{column: value})
    return rows


_MARK_PUBLISHED_SQL = """
UPDATE deliveries_outbox SET published_at = %s
WHERE id = ANY(%b::bigint[]) AND published_at IS NULL
"""


def _mark_published(ids: list[int], now) -> None:
    """The ids travel as one array parameter on PostgreSQL (the ORM's IN list of a
    2,000-row page cost more Python than the rest of the relay's page)."""
    if connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(_MARK_PUBLISHED_SQL, [now, ids])
        return
    Outbox.objects.filter(id__in=ids, published_at__isnull=True).update(published_at=now)


# --- The loop ----------------------------------------------------------------------------

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


_DB_ERRORS = (OperationalError, InterfaceError)


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
                    _reset_connection()
        finally:
            _reset_connection()


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
        listener = wakeup.Listener(*listen) if listen and not once else None

        def wait(seconds: float) -> None:
            if listener is None:
                stop.event.wait(seconds)
            else:
                listener.wait(seconds, stop.event)

        logger.info("loop started", extra={"action": f"{kind}.start", "run_id": str(run.id)})
        backoff = 0.5
        idle_wait = SOON_WAIT
        while not stop.is_set:
            close_old_connections()
            try:
                tick = unit()
                backoff = 0.5
            except _DB_ERRORS as exc:
                logger.warning(
                    "database unavailable, retrying",
                    extra={"action": f"{kind}.db_error", "run_id": str(run.id), "error": str(exc)},
                )
                _reset_connection()
                stop.event.wait(backoff)
                backoff = min(backoff * 2, 10.0)
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


def _reset_connection() -> None:
    with contextlib.suppress(DatabaseError):
        connection.close()


def with_db_retry(fn, stop: StopFlag, *, attempts: int = 20):
    delay = 0.5
    for _ in range(attempts):
        try:
            return fn()
        except _DB_ERRORS:
            _reset_connection()
            if stop.event.wait(delay):
                return None
            delay = min(delay * 2, 10.0)
    return None
