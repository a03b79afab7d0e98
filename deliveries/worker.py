"""The delivery workers: an asyncio loop that sends with aiohttp and talks to the
database from a small thread pool.

One unit of work (``Worker.process_batch``):

1. take a batch of messages from the broker and lease their deliveries (skipping stale
   or raced copies), loading what sending needs: endpoints, secrets, bodies. With the
   database broker this is one transaction, which also spends (deletes) the delivery
   messages: the lease is their record from then on;
2. send every request concurrently, with no transaction open, through the egress module;
3. record the attempts and transitions in one transaction (a batch whose answers come in
   over time is recorded in groups, every ``RECORD_EVERY`` seconds);
4. acknowledge the recorded messages on a broker outside the database (Redis).

Several lanes take batches at once so that the database work of one overlaps the network
work of another, and a lane does not wait for its batch's answers: it takes the next
batch as long as there is room under the concurrency ceiling plus a prefetch of half of
it (prefetched deliveries wait in the process for a request slot, so requests start as
soon as answers come in, while the answered batch is being recorded). An endpoint that sleeps
30 s per request holds only its own request slots (and at most its concurrency ceiling
of them), never a lane (docs/reliability.md, head-of-line isolation).

A worker that dies anywhere in this leaves its messages untaken (the take rolled back), or
a lease (returned by the scheduler when it runs out), or, with a broker outside the
database, unacknowledged messages (redelivered after the visibility timeout; their
copies find the delivery leased or done and are dropped): late, never lost.

Shutdown (SIGTERM): the lanes take no new batch; the requests in flight get
``WORKER_SHUTDOWN_GRACE`` seconds to finish and are recorded as usual. Past the grace, the
requests still running are cut off and their leases given back (``state.release``:
pending, due now, the attempt not counted), in the transaction that records the rest, so
nothing waits for a lease to run out.
"""

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from django.db import close_old_connections, transaction
from django.utils import timezone

from deliveries.core.conf import settings
from deliveries.core.prometheus import (
    ATTEMPTS,
    DELIVERIES_FINISHED,
    DISPATCH_DURATION,
    DISPATCH_FAILURES,
    status_class,
)

from . import state
from .alerts import endpoint_disabled_signal
from .core import tracing
from .core.egress import EgressError, EgressSession
from .core.headers import DROPPED, REDACTED, sendable_headers
from .core.retry import RetryPolicy, parse_retry_after
from .jobs import brokers as broker
from .jobs import kinds, wakeup
from .jobs.faults import crash_point
from .jobs.loop import DB_ERRORS, Backoff, reset_connection
from .metrics import ENDPOINT_LABELS
from .models import Endpoint, endpoint_timeout
from .policy import classify
from .selectors import allowed_networks
from .services import active_secrets
from .signing import delivery_headers

logger = logging.getLogger("deliveries.worker")

# With notifications, how often idle lanes still look (redeliveries are not announced).
LISTEN_POLL = 1.0
# Seconds between recordings of a batch whose answers come in over time.
RECORD_EVERY = 0.2
# Seconds a lane waits when every request slot is taken.
SLOT_WAIT = 0.01
# Deliveries a worker leases ahead of its free request slots, as a fraction of its
# concurrency: they wait for a slot in the process, so that the requests of the next
# batch start the moment answers come in, while the batch that answered is recorded.
PREFETCH = 0.5


@dataclass(frozen=True)
class Target:
    url: str
    timeout: float
    headers: dict
    retry_client_errors: bool
    secrets: tuple[str, ...]
    # Networks staff opened for this endpoint's tenant or for the endpoint
    # (selectors.allowed_networks), admitted on top of EGRESS_ALLOW_NETWORKS.
    allow_networks: tuple = ()
    # Names of stored custom headers the header rule refuses: not sent, and recorded.
    dropped_headers: tuple[str, ...] = ()


@dataclass
class Claimed:
    leased: list[state.Leased]
    targets: dict
    skipped: int


@dataclass
class Taken:
    received: int
    messages: list  # (task id, payload) of deliveries
    others: dict  # kind -> [(task id, Message)]
    claimed: "Claimed | None"


def _take(queue, batch_size: int, lease_seconds: float) -> Taken:
    """Take a batch and lease its deliveries: one trip to the database thread.

    With the database broker, one transaction claims the batch straight from the outbox
    (recording its publication: the committed outbox row is the queue entry) and leases
    its deliveries; messages a relay still put on the queue table fill the rest of the
    batch and are spent (deleted) in the same transaction. From then on a delivery's
    lease is its record, and a worker that dies leaves it to run out; the other kinds'
    jobs lease their rows next and recover a dispatch whose entry is gone
    (deliveries.jobs.kinds). Queue messages it cannot read, or of kinds it does not
    know, are hidden for the visibility timeout and left for a release that can; the
    outbox rows of such kinds are not claimed. A worker that dies before the commit
    leaves the outbox rows and messages as they were. With another broker the batch is
    received first and the deliveries leased after."""
    close_old_connections()
    if broker.takes_outbox(queue):
        with transaction.atomic():
            direct, received = queue.take(batch_size, kinds=_processed_kinds())
            messages, others = _sort(received)
            for m in direct:
                if m.kind == "delivery":
                    messages.append((None, m))
                else:
                    others.setdefault(m.kind, []).append((None, m))
            claimed = _claim(messages, lease_seconds) if messages else None
            if direct or received:
                crash_point("worker.before_take_commit")
            if received:
                spent = {t for t, _ in messages}
                spent.update(t for kind in others if kinds.processed(kind) for t, _ in others[kind])
                spent.discard(None)  # the outbox rows': recorded by the claim
                queue.settle(spent=list(spent), hidden=[t for t, _ in received if t not in spent])
        # Spent: nothing to acknowledge.
        messages = [(None, m) for _, m in messages]
        for kind in others:
            if kinds.processed(kind):
                others[kind] = [(None, m) for _, m in others[kind]]
        taken = len(direct) + len(received)
    else:
        received = broker.receive(queue, batch_size)
        messages, others = _sort(received)
        claimed = _claim(messages, lease_seconds) if messages else None
        taken = len(received)
    ENDPOINT_LABELS.refresh_if_due()
    return Taken(taken, messages, others, claimed)


def _processed_kinds() -> list[str]:
    """The outbox kinds a worker takes: deliveries and every kind it processes."""
    return ["delivery", *(k.name for k in kinds.KINDS.values() if k.process is not None)]


def _sort(received: list[tuple[object, str]]) -> tuple[list, dict]:
    """Decode a batch: (task id, message) of deliveries, and kind -> [(task id, message)]
    of the other kinds."""
    messages, others = [], {}
    for task_id, payload in received:
        try:
            m = broker.Message.decode(payload)
        except broker.UnreadableMessage as exc:
            # Left unacknowledged: a release that reads it takes it after the visibility
            # timeout; meanwhile the scheduler's lost-dispatch sweep re-dispatches its
            # delivery in a format this release writes (docs/compatibility.md).
            logger.error(
                "unreadable queue message",
                extra={"action": "workers.unreadable_message", "error": str(exc)},
            )
            continue
        if m.kind == "delivery":
            messages.append((task_id, m))
        else:
            others.setdefault(m.kind, []).append((task_id, m))
    return messages, others


def _claim(messages: list[tuple[object, broker.Message]], lease_seconds: float) -> Claimed:
    """Lease the batch's deliveries and load their endpoints (runs in a DB thread)."""
    wanted = [(m.job_id, m.dispatch) for _, m in messages]
    now = timezone.now()
    leased, skipped = state.lease(wanted, now=now, lease_seconds=lease_seconds)
    endpoint_ids = {item.endpoint_id for item in leased}
    secrets = active_secrets(endpoint_ids, now=now)
    targets = {}
    # Values, not models: a batch's endpoints are read for every batch.
    endpoints = list(
        Endpoint.objects.filter(id__in=endpoint_ids).values_list(
            "id", "tenant_id", "url", "timeout", "headers", "retry_client_errors"
        )
    )
    allowed = allowed_networks((tenant_id, endpoint_id) for endpoint_id, tenant_id, *_ in endpoints)
    for endpoint_id, tenant_id, url, timeout, headers, retry_client_errors in endpoints:
        sent, dropped = sendable_headers(headers)
        if dropped:
            _log_dropped_headers(endpoint_id, dropped)
        targets[endpoint_id] = Target(
            url=url,
            timeout=endpoint_timeout(timeout),
            headers=sent,
            retry_client_errors=retry_client_errors,
            secrets=tuple(secrets.get(endpoint_id, ())),
            allow_networks=allowed[(tenant_id, endpoint_id)],
            dropped_headers=tuple(dropped),
        )
    return Claimed(leased=leased, targets=targets, skipped=skipped)


def _log_dropped_headers(endpoint_id, names: list[str]) -> None:
    """An endpoint row holds custom headers the rule refuses (written before it, or
    past the services): they are never sent. Once per endpoint per batch; names only,
    the values may be credentials."""
    logger.warning(
        "endpoint headers not sent",
        extra={
            "action": "workers.headers_dropped",
            "endpoint_id": str(endpoint_id),
            "headers": names,
        },
    )


def _observe(results: list[state.AttemptResult]) -> None:
    """Metrics and one log line per attempt: DEBUG for a success (the attempt table is
    the full record; a line per success at thousands a second would cost more than the
    send), INFO for anything else. Ids, timing and outcome only: never the body, the
    headers or the secrets. Label lookups are made once per endpoint per batch."""
    for (outcome, status), n in Counter(
        (str(r.classification.outcome), status_class(r.status_code)) for r in results
    ).items():
        ATTEMPTS.labels(outcome, status).inc(n)
    by_endpoint: dict = {}
    for r in results:
        by_endpoint.setdefault(r.leased.endpoint_id, []).append(r)
    for endpoint_id, batch in by_endpoint.items():
        label = ENDPOINT_LABELS.label(endpoint_id)
        histogram = DISPATCH_DURATION.labels(label)
        failures = 0
        for r in batch:
            histogram.observe(r.duration_ms / 1000)
            failures += r.classification.outcome != "success"
        if failures:
            DISPATCH_FAILURES.labels(label).inc(failures)
    debug = logger.isEnabledFor(logging.DEBUG)
    for r in results:
        success = r.classification.outcome == "success"
        if success and not debug:
            continue
        logger.log(
            logging.DEBUG if success else logging.INFO,
            "delivery attempt",
            extra={
                "action": "delivery.attempt",
                "job_type": "delivery",
                "delivery_id": str(r.leased.id),
                "event_id": str(r.leased.event_id),
                "tenant_id": str(r.leased.tenant_id),
                "endpoint_id": str(r.leased.endpoint_id),
                "event_type": r.leased.event_type,
                "attempt": r.leased.attempt_number,
                "duration_ms": round(r.duration_ms, 1),
                "outcome": str(r.classification.outcome),
                "status_code": r.status_code,
                "error_kind": r.error_kind,
            },
        )


def _record_disabled(endpoint_ids) -> None:
    """The incident for endpoints this worker disabled (deliveries/alerts.py). The
    deliveries are recorded already; failing to record the incident is logged, never
    allowed to stop the lane."""

    close_old_connections()
    try:
        endpoint_disabled_signal(endpoint_ids)
    except DB_ERRORS:
        raise  # retried by the caller
    except Exception:
        logger.exception("could not record the incident", extra={"action": "alert.record_failed"})


def _run_job(job, messages) -> Counter:
    close_old_connections()
    return job.process(messages)


def _record_and_acknowledge(
    results: list[state.AttemptResult],
    policy: RetryPolicy,
    queue,
    task_ids: list,
    released: list[state.Leased],
) -> tuple[state.RecordSummary, int]:
    """Record the batch and give back the leases of requests cut off by a shutdown in
    one transaction, then acknowledge its messages on a broker that acknowledges (a
    released delivery is dispatched again by the scheduler, so its old message is spent;
    a crash between the commit and the acknowledgement redelivers messages whose
    deliveries are recorded already, which the lease guard skips). The database broker's
    delivery messages were spent by the take: their task ids are None."""
    close_old_connections()
    with transaction.atomic():
        now = timezone.now()
        summary = state.record(results, now=now, policy=policy)
        returned = state.release(released, now=now) if released else 0
    broker.acknowledge(queue, task_ids)
    return summary, returned


class Worker:
    def __init__(
        self,
        *,
        batch_size: int | None = None,
        concurrency: int | None = None,
        lanes: int | None = None,
        queue=None,
        egress: EgressSession | None = None,
        shutdown_grace: float | None = None,
    ) -> None:
        self.batch_size = batch_size or settings.WORKER_BATCH_SIZE
        self.lanes = lanes or settings.WORKER_LANES
        self.queue = queue or broker.get_broker()
        self.policy = RetryPolicy.from_settings()
        # A prefetched delivery may wait for a request slot as long as a request can take
        # (slots held by hanging requests), then take as long itself.
        self.lease_seconds = max(
            settings.DELIVERY_LEASE_SECONDS, 2 * settings.DELIVERY_MAX_TIMEOUT + 15
        )
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.concurrency = concurrency or settings.WORKER_CONCURRENCY
        self.in_flight = asyncio.Semaphore(self.concurrency)
        # Leased deliveries not recorded yet: waiting for a request slot, out, or being
        # recorded. At most concurrency + prefetch.
        self.sending = 0
        self.prefetch = int(self.concurrency * PREFETCH)
        self.egress = egress
        self.db = ThreadPoolExecutor(max_workers=self.lanes + 1, thread_name_prefix="worker-db")
        self.counts: Counter = Counter()
        self.wake = asyncio.Event()
        self.idle_wait: float | None = None  # set when notifications wake idle lanes
        self.shutdown_grace = (
            settings.WORKER_SHUTDOWN_GRACE if shutdown_grace is None else shutdown_grace
        )
        # Set when the shutdown grace has run out: requests still in flight are cut off.
        self.abandon = asyncio.Event()

    def request_stop(self, stop: asyncio.Event) -> None:
        """A signal: the first stops taking work (in-flight requests get the grace); a
        second one cuts them off at once."""
        if stop.is_set():
            self.abandon.set()
        stop.set()

    async def _in_db(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.db, fn, *args)

    async def _in_db_retrying(self, fn, *args, attempts: int = 6):
        """Recording must survive a database blip: the attempts already happened."""
        backoff = Backoff(first=0.25)
        for i in range(attempts):
            try:
                return await self._in_db(fn, *args)
            except DB_ERRORS:
                if i == attempts - 1:
                    raise
                await self._in_db(reset_connection)
                await asyncio.sleep(backoff.next())
        return None

    async def process_batch(self) -> int:
        """One unit of work, to its end; returns how many broker messages it handled."""
        handled, sending = await self._take_and_start(self.batch_size)
        if sending is not None:
            await sending
        return handled

    async def _take_and_start(self, limit: int) -> tuple[int, "asyncio.Task | None"]:
        """Dequeue and lease up to ``limit`` messages, run the other kinds' jobs, and
        start sending the deliveries in a task of their own (returned), so that the lane
        can take the next batch while these requests are out."""
        # The room is reserved while the database is asked, so that lanes taking at the
        # same moment do not each count the same free slots.
        self.sending += limit
        try:
            taken = await self._in_db(_take, self.queue, limit, self.lease_seconds)
        finally:
            self.sending -= limit
        for kind, items in taken.others.items():
            await self._process_other(kind, items)
        sending = None
        if taken.messages:
            self.sending += len(taken.claimed.leased)
            sending = asyncio.create_task(self._deliver(taken.messages, taken.claimed))
        return taken.received, sending

    async def _process_other(self, kind: str, items: list) -> None:
        """Jobs registered by other apps (deliveries.jobs.kinds), acknowledged after they ran
        (the database broker's take spent them already); unknown kinds are left
        unacknowledged so that a worker that knows them gets them later."""
        job = kinds.processed(kind)
        if job is None:
            logger.error("unknown job kind", extra={"action": "workers.unknown_kind", "kind": kind})
            return
        counts = await self._in_db_retrying(_run_job, job, [m for _, m in items])
        task_ids = [task_id for task_id, _ in items if task_id is not None]
        if task_ids:
            await self._in_db_retrying(broker.acknowledge, self.queue, task_ids)
        self.counts.update({f"{kind}.{k}": v for k, v in counts.items()})

    async def _deliver(self, messages: list[tuple[object, str]], claimed: "Claimed") -> None:
        """Send a leased batch and record it as the answers come in: what has finished
        is recorded (and its messages acknowledged) every RECORD_EVERY seconds, so a
        delivery that shares a batch with one to an endpoint that takes 30 s to answer
        is not held until then. A batch that answers within the window is recorded in
        one transaction. Once the shutdown grace has run out, the requests still out are
        cut off and their leases released with the next recording."""
        crash_point("worker.after_lease")
        if tracing.enabled():
            # The relay's span, carried by the message, is the parent of the attempt's.
            parents = {m.job_id: m.traceparent for _, m in messages if m.traceparent}
            claimed.leased = [
                replace(item, trace_context=parents.get(item.id) or item.trace_context)
                for item in claimed.leased
            ]
        started = time.perf_counter()
        by_delivery: dict = {}
        for task_id, m in messages:
            by_delivery.setdefault(m.job_id, []).append(task_id)
        leased_ids = {item.id for item in claimed.leased}
        # Messages that leased nothing (stale or raced copies) go with the first group
        # (spent already with the database broker: task id None).
        unmatched = [
            t
            for job_id, ids in by_delivery.items()
            if job_id not in leased_ids
            for t in ids
            if t is not None
        ]
        released: list[state.Leased] = []
        tasks: dict[asyncio.Task, state.Leased] = {}
        if self.abandon.is_set():
            released = list(claimed.leased)  # stopping past the grace: never sent
        else:
            tasks = {
                asyncio.create_task(self._send(item, claimed.targets[item.endpoint_id])): item
                for item in claimed.leased
            }
        pending = set(tasks)
        outstanding = len(claimed.leased)  # leased here, not yet recorded
        self.counts.update(messages=len(messages), skipped=claimed.skipped)
        try:
            while pending or unmatched or released:
                done: set = set()
                if pending:
                    done, pending = await asyncio.wait(pending, timeout=RECORD_EVERY)
                    released += [tasks[t] for t in done if t.cancelled()]
                    done = {t for t in done if not t.cancelled()}
                    if self.abandon.is_set() and pending:
                        for task in pending:
                            task.cancel()
                        await asyncio.wait(pending)
                        released += [tasks[t] for t in pending if t.cancelled()]
                        done |= {t for t in pending if not t.cancelled()}
                        pending = set()
                    if not done and not released:
                        continue
                results = [task.result() for task in done]
                task_ids = unmatched + [
                    t
                    for leased in [r.leased for r in results] + released
                    for t in by_delivery[leased.id]
                ]
                await self._record(results, task_ids, released, started)
                # Recorded: their request slots count as free again, whatever the rest
                # of the batch is still waiting for.
                self.sending -= len(results) + len(released)
                outstanding -= len(results) + len(released)
                unmatched, released = [], []
        finally:
            for task in pending:
                task.cancel()
            self.sending -= outstanding

    async def _record(
        self,
        results: list[state.AttemptResult],
        task_ids: list,
        released: list[state.Leased],
        started: float,
    ) -> None:
        """Record attempts (and release leases cut off by the shutdown), then acknowledge
        their messages."""
        crash_point("worker.after_send")
        _observe(results)
        summary, returned = await self._in_db_retrying(
            _record_and_acknowledge, results, self.policy, self.queue, task_ids, released
        )
        if summary.succeeded:
            DELIVERIES_FINISHED.labels("succeeded").inc(summary.succeeded)
        if summary.dead:
            DELIVERIES_FINISHED.labels("dead").inc(summary.dead)
        logger.debug(
            "batch recorded",
            extra={
                "action": "workers.batch",
                "job_type": "delivery",
                "messages": len(task_ids),
                "attempts": len(results),
                "succeeded": summary.succeeded,
                "retrying": summary.retrying,
                "dead": summary.dead,
                "duration_ms": round((time.perf_counter() - started) * 1000, 1),
            },
        )
        self.counts.update(
            succeeded=summary.succeeded,
            retrying=summary.retrying,
            dead=summary.dead,
            stale=summary.stale,
        )
        if released:
            self.counts["released"] += returned
            logger.warning(
                "shutdown grace ran out: leases released",
                extra={
                    "action": "workers.released",
                    "released": returned,
                    "delivery_ids": [str(item.id) for item in released[:50]],
                },
            )
        for endpoint_id in summary.disabled_endpoints:
            logger.warning(
                "endpoint disabled",
                extra={"action": "endpoint.disabled", "endpoint_id": str(endpoint_id)},
            )
        if summary.disabled_endpoints:
            await self._in_db_retrying(_record_disabled, summary.disabled_endpoints)

    async def _send(self, item: state.Leased, target: Target) -> state.AttemptResult:
        if not tracing.enabled():
            return await self._attempt(item, target)
        # The traceparent is not sent to the receiver: trace ids stay inside the service.
        span = tracing.start_span(
            "webhooks.deliver",
            parent=item.trace_context,
            kind="CLIENT",
            delivery_id=str(item.id),
            event_id=str(item.event_id),
            endpoint_id=str(item.endpoint_id),
            event_type=item.event_type,
            attempt=item.attempt_number,
        )
        outcome = "released"  # cut off by a shutdown unless a result comes back
        try:
            result = await self._attempt(item, target)
            outcome = str(result.classification.outcome)
            if result.status_code is not None:
                span.set_attribute("http.response.status_code", result.status_code)
            return result
        finally:
            span.set_attribute("webhooks.outcome", outcome)
            span.end()

    async def _attempt(self, item: state.Leased, target: Target) -> state.AttemptResult:
        async with self.in_flight:
            if self.abandon.is_set():
                # Past the shutdown grace while waiting for a slot: never sent, so the
                # lease is given back (a cancelled task is released by _deliver).
                raise asyncio.CancelledError
            return await self._post(item, target)

    async def _post(self, item: state.Leased, target: Target) -> state.AttemptResult:
        msg_id = str(item.id)
        timestamp = int(time.time())
        headers = delivery_headers(
            target.headers, target.secrets, msg_id=msg_id, timestamp=timestamp, body=item.body
        )
        # The attempt log keeps what varies per attempt: the timestamp signed, and the
        # names of custom headers (their values may be credentials). The rest is fixed by
        # the protocol (webhook-id and Idempotency-Key are the delivery id), which is how
        # deliveries.selectors.attempt_request_headers reads it back.
        # The timestamp last: a stored header of the same name was dropped, not sent.
        logged_headers = dict.fromkeys(target.headers, REDACTED)
        logged_headers.update(dict.fromkeys(target.dropped_headers, DROPPED))
        logged_headers["webhook-timestamp"] = str(timestamp)
        started = datetime.now(UTC)
        try:
            response = await self.egress.post(
                target.url,
                body=item.body,
                headers=headers,
                timeout=target.timeout,
                allow_networks=target.allow_networks,
            )
        except EgressError as exc:
            return state.AttemptResult(
                leased=item,
                classification=classify(
                    status=None, error_kind=str(exc.kind), ambiguous=exc.ambiguous
                ),
                started_at=started,
                duration_ms=exc.elapsed_ms,
                error_kind=str(exc.kind),
                error=exc.detail,
                request_headers=logged_headers,
                worker=self.name,
            )
        classification = classify(
            status=response.status, retry_client_errors=target.retry_client_errors
        )
        retry_after = None
        if classification.retryable:
            retry_after = parse_retry_after(response.headers.get("retry-after"), now=started)
        limit = settings.DELIVERY_RESPONSE_BODY_LIMIT
        return state.AttemptResult(
            leased=item,
            classification=classification,
            started_at=started,
            duration_ms=response.elapsed_ms,
            status_code=response.status,
            response_body=response.body[:limit].decode("utf-8", errors="replace"),
            response_truncated=response.truncated or len(response.body) > limit,
            request_headers=logged_headers,
            retry_after=retry_after,
            worker=self.name,
        )

    async def run(
        self,
        *,
        stop: asyncio.Event,
        once: bool = False,
        until_idle: bool = False,
        idle_sleep: float | None = None,
    ) -> Counter:
        """Run ``lanes`` batch loops until ``stop`` is set (they finish the batch under
        way), or after one batch each (``once``), or until the broker is empty
        (``until_idle``)."""
        idle_sleep = settings.WORKER_IDLE_SLEEP if idle_sleep is None else idle_sleep
        own_session = self.egress is None
        if own_session:
            self.egress = EgressSession()
            await self.egress.__aenter__()
        listening = None if once or until_idle else self._listen()
        grace = asyncio.create_task(self._abandon_after_grace(stop))
        try:
            await asyncio.gather(
                *(self._lane(stop, once, until_idle, idle_sleep) for _ in range(self.lanes))
            )
        finally:
            grace.cancel()
            if listening is not None:
                stopped, thread = listening
                stopped.set()
                await asyncio.to_thread(thread.join, LISTEN_POLL + 1)
            if own_session:
                await self.egress.close()
            close_thread_connections(self.db, self.lanes + 1)
        return self.counts

    def _listen(self) -> tuple[threading.Event, threading.Thread] | None:
        """With the database broker on PostgreSQL, a thread waits for the notifications
        of new outbox rows (the workers' queue entries) and of a relay's messages, and
        wakes idle lanes (deliveries.jobs.wakeup); they still poll every LISTEN_POLL
        seconds for redeliveries, which nobody announces. Returns the event that stops
        the thread, and the thread."""
        if not (broker.takes_outbox(self.queue) and wakeup.available()):
            return None
        loop = asyncio.get_running_loop()
        stopped = threading.Event()

        def listen() -> None:
            listener = wakeup.Listener(wakeup.OUTBOX, wakeup.QUEUE)
            try:
                while not stopped.is_set():
                    if listener.wait(LISTEN_POLL, stopped) and not stopped.is_set():
                        loop.call_soon_threadsafe(self.wake.set)
            finally:
                listener.close()
                reset_connection()

        thread = threading.Thread(target=listen, name="worker-listen", daemon=True)
        thread.start()
        self.idle_wait = LISTEN_POLL
        return stopped, thread

    async def _abandon_after_grace(self, stop: asyncio.Event) -> None:
        await stop.wait()
        logger.info(
            "stopping: requests in flight get the grace period",
            extra={"action": "workers.stopping", "grace": self.shutdown_grace},
        )
        await _wait(self.abandon, self.shutdown_grace)
        self.abandon.set()

    async def _lane(
        self, stop: asyncio.Event, once: bool, until_idle: bool, idle_sleep: float
    ) -> None:
        """Take a batch whenever there is room under the concurrency ceiling; the batch's
        requests go out in their own task while the lane takes the next one. Requests
        that hang (an endpoint that sleeps) therefore hold their own slots, not the lane.
        """
        backoff = Backoff()
        mine: set[asyncio.Task] = set()
        try:
            while not stop.is_set():
                room = min(self.batch_size, self.concurrency + self.prefetch - self.sending)
                if room <= 0:
                    await _wait(stop, SLOT_WAIT)
                    continue
                # Cleared before the take, not after an empty one: a notification that
                # arrives while the take runs must still end the idle wait below, or the
                # lane sleeps a whole LISTEN_POLL with work waiting.
                self.wake.clear()
                try:
                    handled, sending = await self._take_and_start(room)
                    backoff.reset()
                except DB_ERRORS as exc:
                    logger.warning(
                        "database unavailable, retrying",
                        extra={"action": "workers.db_error", "error": str(exc)},
                    )
                    await self._in_db(reset_connection)
                    await _wait(stop, backoff.next())
                    continue
                if sending is not None:
                    mine.add(sending)
                    sending.add_done_callback(mine.discard)
                    sending.add_done_callback(_log_failure)
                if once:
                    return
                if until_idle and handled == 0:
                    if not mine:
                        return
                    await asyncio.wait(mine)  # what is out may come back as retries
                    continue
                if handled == 0:
                    await _wait_any(stop, self.wake, self.idle_wait or idle_sleep)
        finally:
            # Stopping finishes the requests under way and records them.
            if mine:
                await asyncio.wait(mine)


def _log_failure(task: asyncio.Task) -> None:
    """A batch that could not be recorded (the database stayed away through every
    retry) is left to the lease and the visibility timeout: late, not lost."""
    if task.cancelled() or task.exception() is None:
        return
    logger.warning(
        "batch not recorded; its leases will expire",
        extra={"action": "workers.record_failed", "error": str(task.exception())},
    )


def close_thread_connections(executor: ThreadPoolExecutor, threads: int) -> None:
    """Close the Django connection each pool thread opened, then stop the pool. The
    barrier makes every thread take exactly one of the close calls."""
    barrier = threading.Barrier(threads)

    def close() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=5)
        reset_connection()

    for future in [executor.submit(close) for _ in range(threads)]:
        future.result()
    executor.shutdown(wait=True)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


async def _wait_any(stop: asyncio.Event, wake: asyncio.Event, seconds: float) -> None:
    """Wait until ``stop`` or ``wake`` is set, or ``seconds`` pass."""
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
