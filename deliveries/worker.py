"""The delivery workers: an asyncio loop that sends with aiohttp and talks to the
database from a small thread pool.

One unit of work (``Worker.process_batch``):

1. take a batch of messages from the broker;
2. lease their deliveries in one transaction (skipping stale or raced copies) and load
   what sending needs: endpoints, secrets, bodies;
3. send every request concurrently, with no transaction open, through the egress module;
4. record the attempts and transitions in one transaction (a batch whose answers come in
   over time is recorded in groups, every ``RECORD_EVERY`` seconds);
5. acknowledge the recorded messages on the broker.

Several lanes take batches at once so that the database work of one overlaps the network
work of another, and a lane does not wait for its batch's answers: it takes the next
batch as long as there is room under the concurrency ceiling. An endpoint that sleeps
30 s per request holds only its own request slots (and at most its concurrency ceiling
of them), never a lane (docs/reliability.md, head-of-line isolation).

A worker that dies anywhere in this leaves either unacknowledged messages (redelivered
after the visibility timeout) or a lease (returned by the scheduler when it runs out):
late, never lost.
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
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.db import (
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)
from django.utils import timezone

from project.metrics import ATTEMPTS

from . import broker as transport
from . import jobs, state
from .egress import EgressError, EgressSession
from .faults import crash_point
from .models import Endpoint, endpoint_timeout
from .policy import RetryPolicy, classify, parse_retry_after
from .services import active_secrets
from .signing import signature_header

logger = logging.getLogger("deliveries.worker")

# Seconds between recordings of a batch whose answers come in over time.
RECORD_EVERY = 0.2
# Seconds a lane waits when every request slot is taken.
SLOT_WAIT = 0.01

# Headers the protocol owns; an endpoint's custom headers cannot replace them.
PROTOCOL_HEADERS = frozenset(
    {
        "content-type",
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "idempotency-key",
        "content-length",
        "host",
    }
)


@dataclass(frozen=True)
class Target:
    url: str
    timeout: float
    headers: dict
    retry_client_errors: bool
    secrets: tuple[str, ...]


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


def _take(broker, batch_size: int, lease_seconds: float) -> Taken:
    """Dequeue a batch and lease its deliveries: one trip to the database thread."""
    close_old_connections()
    received = transport.receive(broker, batch_size)
    messages, others = [], {}
    for task_id, payload in received:
        m = transport.Message.decode(payload)
        if m.kind == "delivery":
            messages.append((task_id, m))
        else:
            others.setdefault(m.kind, []).append((task_id, m))
    claimed = _claim(messages, lease_seconds) if messages else None
    return Taken(len(received), messages, others, claimed)


def _claim(messages: list[tuple[object, transport.Message]], lease_seconds: float) -> Claimed:
    """Lease the batch's deliveries and load their endpoints (runs in a DB thread)."""
    wanted = [(m.job_id, m.dispatch) for _, m in messages]
    now = timezone.now()
    leased, skipped = state.lease(wanted, now=now, lease_seconds=lease_seconds)
    endpoint_ids = {item.endpoint_id for item in leased}
    secrets = active_secrets(endpoint_ids, now=now)
    targets = {}
    for e in Endpoint.objects.filter(id__in=endpoint_ids):
        targets[e.id] = Target(
            url=e.url,
            timeout=endpoint_timeout(e),
            headers={
                k: str(v) for k, v in (e.headers or {}).items() if k.lower() not in PROTOCOL_HEADERS
            },
            retry_client_errors=e.retry_client_errors,
            secrets=tuple(secrets.get(e.id, ())),
        )
    return Claimed(leased=leased, targets=targets, skipped=skipped)


def _run_job(job, messages) -> Counter:
    close_old_connections()
    return job.process(messages)


def _record_and_acknowledge(
    results: list[state.AttemptResult], policy: RetryPolicy, broker, task_ids: list
) -> state.RecordSummary:
    """Record the batch, then acknowledge its messages. With the database broker both
    happen in one transaction; with another broker the acknowledgement follows the
    commit (a crash in between redelivers messages whose deliveries are already
    recorded, which the lease guard skips)."""
    close_old_connections()
    same_database = isinstance(broker, transport.DatabaseBroker)
    with transaction.atomic():
        summary = state.record(results, now=timezone.now(), policy=policy)
        if same_database:
            transport.acknowledge(broker, task_ids)
    if not same_database:
        transport.acknowledge(broker, task_ids)
    return summary


class Worker:
    def __init__(
        self,
        *,
        batch_size: int | None = None,
        concurrency: int | None = None,
        lanes: int = 4,
        broker=None,
        egress: EgressSession | None = None,
    ) -> None:
        self.batch_size = batch_size or settings.WORKER_BATCH_SIZE
        self.lanes = lanes
        self.broker = broker or transport.broker()
        self.policy = RetryPolicy.from_settings()
        self.lease_seconds = max(
            settings.DELIVERY_LEASE_SECONDS, settings.DELIVERY_MAX_TIMEOUT + 15
        )
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.concurrency = concurrency or settings.WORKER_CONCURRENCY
        self.in_flight = asyncio.Semaphore(self.concurrency)
        self.sending = 0  # leased deliveries whose requests are out or being recorded
        self.egress = egress
        self.db = ThreadPoolExecutor(max_workers=lanes + 1, thread_name_prefix="worker-db")
        self.counts: Counter = Counter()

    async def _in_db(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.db, fn, *args)

    async def _in_db_retrying(self, fn, *args, attempts: int = 6):
        """Recording must survive a database blip: the attempts already happened."""
        delay = 0.25
        for i in range(attempts):
            try:
                return await self._in_db(fn, *args)
            except (OperationalError, InterfaceError):
                if i == attempts - 1:
                    raise
                await self._in_db(_close_connection)
                await asyncio.sleep(delay)
                delay *= 2
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
        taken = await self._in_db(_take, self.broker, limit, self.lease_seconds)
        for kind, items in taken.others.items():
            await self._process_other(kind, items)
        sending = None
        if taken.messages:
            self.sending += len(taken.claimed.leased)
            sending = asyncio.create_task(self._deliver(taken.messages, taken.claimed))
        return taken.received, sending

    async def _process_other(self, kind: str, items: list) -> None:
        """Jobs registered by other apps (deliveries.jobs); unknown kinds are left
        unacknowledged so that a worker that knows them gets them later."""
        job = jobs.KINDS.get(kind)
        if job is None:
            logger.error("unknown job kind", extra={"action": "workers.unknown_kind", "kind": kind})
            return
        counts = await self._in_db_retrying(_run_job, job, [m for _, m in items])
        await self._in_db_retrying(
            transport.acknowledge, self.broker, [task_id for task_id, _ in items]
        )
        self.counts.update({f"{kind}.{k}": v for k, v in counts.items()})

    async def _deliver(self, messages: list[tuple[object, str]], claimed: "Claimed") -> None:
        """Send a leased batch and record it as the answers come in: what has finished
        is recorded (and its messages acknowledged) every RECORD_EVERY seconds, so a
        delivery that shares a batch with one to an endpoint that takes 30 s to answer
        is not held until then. A batch that answers within the window is recorded in
        one transaction, as before."""
        crash_point("worker.after_lease")
        by_delivery: dict = {}
        for task_id, m in messages:
            by_delivery.setdefault(m.job_id, []).append(task_id)
        leased_ids = {item.id for item in claimed.leased}
        # Messages that leased nothing (stale or raced copies) go with the first group.
        unmatched = [
            t for job_id, ids in by_delivery.items() if job_id not in leased_ids for t in ids
        ]
        pending = {
            asyncio.create_task(self._send(item, claimed.targets[item.endpoint_id]))
            for item in claimed.leased
        }
        self.counts.update(messages=len(messages), skipped=claimed.skipped)
        try:
            while pending or unmatched:
                done = set()
                if pending:
                    done, pending = await asyncio.wait(pending, timeout=RECORD_EVERY)
                    if not done:
                        continue
                results = [task.result() for task in done]
                task_ids = unmatched + [t for r in results for t in by_delivery[r.leased.id]]
                unmatched = []
                await self._record(results, task_ids)
        finally:
            for task in pending:
                task.cancel()
            self.sending -= len(claimed.leased)

    async def _record(self, results: list, task_ids: list) -> None:
        crash_point("worker.after_send")
        for outcome, n in Counter(str(r.classification.outcome) for r in results).items():
            ATTEMPTS.labels(outcome).inc(n)
        summary = await self._in_db_retrying(
            _record_and_acknowledge, list(results), self.policy, self.broker, task_ids
        )
        self.counts.update(
            succeeded=summary.succeeded,
            retrying=summary.retrying,
            dead=summary.dead,
            stale=summary.stale,
        )
        for endpoint_id in summary.disabled_endpoints:
            logger.warning(
                "endpoint disabled",
                extra={"action": "endpoint.disabled", "endpoint_id": str(endpoint_id)},
            )

    async def _send(self, item: state.Leased, target: Target) -> state.AttemptResult:
        msg_id = str(item.id)
        timestamp = int(time.time())
        headers = {
            **target.headers,
            "content-type": "application/json",
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature_header(
                target.secrets, msg_id=msg_id, timestamp=timestamp, body=item.body
            ),
            "idempotency-key": msg_id,
        }
        # The attempt log keeps what varies per attempt: the timestamp signed, and the
        # names of custom headers (their values may be credentials). The rest is fixed by
        # the protocol (webhook-id and Idempotency-Key are the delivery id).
        logged_headers = {"webhook-timestamp": str(timestamp)}
        logged_headers.update(dict.fromkeys(target.headers, "[redacted]"))
        started = datetime.now(UTC)
        async with self.in_flight:
            try:
                response = await self.egress.post(
                    target.url, body=item.body, headers=headers, timeout=target.timeout
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
        try:
            await asyncio.gather(
                *(self._lane(stop, once, until_idle, idle_sleep) for _ in range(self.lanes))
            )
        finally:
            if own_session:
                await self.egress.close()
            close_thread_connections(self.db, self.lanes + 1)
        return self.counts

    async def _lane(
        self, stop: asyncio.Event, once: bool, until_idle: bool, idle_sleep: float
    ) -> None:
        """Take a batch whenever there is room under the concurrency ceiling; the batch's
        requests go out in their own task while the lane takes the next one. Requests
        that hang (an endpoint that sleeps) therefore hold their own slots, not the lane.
        """
        backoff = 0.5
        mine: set[asyncio.Task] = set()
        try:
            while not stop.is_set():
                room = min(self.batch_size, self.concurrency - self.sending)
                if room <= 0:
                    await _wait(stop, SLOT_WAIT)
                    continue
                try:
                    handled, sending = await self._take_and_start(room)
                    backoff = 0.5
                except (OperationalError, InterfaceError) as exc:
                    logger.warning(
                        "database unavailable, retrying",
                        extra={"action": "workers.db_error", "error": str(exc)},
                    )
                    await self._in_db(_close_connection)
                    await _wait(stop, backoff)
                    backoff = min(backoff * 2, 10.0)
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
                    await _wait(stop, idle_sleep)
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
        _close_connection()

    for future in [executor.submit(close) for _ in range(threads)]:
        future.result()
    executor.shutdown(wait=True)


def _close_connection() -> None:
    try:
        connection.close()
    except Exception:
        logger.debug("closing a broken connection failed")


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
