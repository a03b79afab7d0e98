"""Queue transport behind django-q2's broker interface.

``DatabaseBroker`` is the default, in the service's own database. For the pipeline's
workers the committed outbox row is itself the queue entry: their take (``take``) claims
outbox rows directly and records their publication in the transaction that leases the
jobs, with no relay between them. The broker also keeps a queue table, for django-q2's
tasks and for a relay still run beside the workers (it keeps working, one hop longer). A
take of the table locks a batch (``FOR UPDATE SKIP LOCKED`` on PostgreSQL) and settles it
in the caller's transaction: the messages the caller has spent are deleted, the rest hidden for the
visibility timeout, to be acknowledged (deleted) once processed. The workers spend a
delivery's message in the transaction that leases the delivery, since from then on the
lease is its record; django-q2's ``dequeue`` hides every message. The table only ever
holds live messages. On SQLite the same statements run inside IMMEDIATE transactions,
which serialise them. (django-q2's own ORM broker claims one row at a time with no SKIP
LOCKED and no index, hence this class.)

Any other ``django_q.brokers.Broker`` works too (``QUEUE_BROKER_CLASS``), e.g. django-q2's
Redis broker. A broker without acknowledgements loses the messages a killed worker held;
the scheduler's lost-dispatch sweep (``SCHEDULER_STALE_ENQUEUED_SECONDS``) recovers those
deliveries, so they are late, never lost.

The same broker class serves two queues that never share a key: the pipeline's
(``QUEUE_NAME``: relay to workers, ``get_broker()``) and django-q2's own (its cluster's name,
``TASKS_QUEUE_NAME``: a ``qcluster`` running the maintenance schedules). Each side reads
only its own, so neither takes a message it cannot read: a qcluster would delete a
delivery message it failed to unpickle, and a worker would hide a django-q2 task.
"""

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.utils import timezone
from django.utils.module_loading import import_string
from django_q.brokers import Broker
from django_q.conf import Conf

from deliveries.core.conf import settings

from . import wakeup
from .models import QueueMessage
from .queries import (
    ACKNOWLEDGE_MESSAGES,
    ENQUEUE_MESSAGES,
    LOCK_MESSAGES,
    SETTLE_MESSAGES,
    TAKE,
)

# For isinstance() alone. django-q2's Redis broker imports redis, an optional extra
# (trusty-webhooks[redis]): without it no Redis broker can exist, and nothing is one.
try:
    from django_q.brokers.redis_broker import Redis
except ImportError:

    class Redis:
        pass


# The queue message format. Writers write MESSAGE_VERSION; readers read every version in
# READABLE_VERSIONS, because a queue drains across deploys: a message written by the
# previous release may be read by this one (docs/compatibility.md keeps the matrix).
#   1: {"d": job id hex, "n": dispatch, "p": priority, "k"?: kind}  (no "v" key)
#   2: version 1 + "v": 2 and "tp"?: a W3C traceparent (deliveries/core/tracing.py)
MESSAGE_VERSION = 2
READABLE_VERSIONS = frozenset({1, 2})


class UnreadableMessage(ValueError):
    """A message this release cannot read: a newer format (a rollback left it in the
    queue) or garbage. The worker leaves it unacknowledged for a release that can."""


@dataclass(frozen=True)
class Message:
    """A dispatch of one job (a delivery, unless ``kind`` says otherwise), as carried by
    the broker. Only ids travel: the job's state lives in the database."""

    job_id: uuid.UUID
    dispatch: int
    priority: int = 0
    kind: str = "delivery"
    traceparent: str = ""
    version: int = MESSAGE_VERSION

    def encode(self) -> str:
        data = {"v": MESSAGE_VERSION, "d": self.job_id.hex, "n": self.dispatch, "p": self.priority}
        if self.kind != "delivery":
            data["k"] = self.kind
        if self.traceparent:
            data["tp"] = self.traceparent
        return json.dumps(data)

    @classmethod
    def decode(cls, payload: str | bytes) -> "Message":
        try:
            data = json.loads(payload)
            version = int(data.get("v", 1))
        except (ValueError, TypeError, AttributeError) as exc:
            raise UnreadableMessage(f"not a queue message: {exc}") from exc
        if version not in READABLE_VERSIONS:
            raise UnreadableMessage(f"message format version {version} is not readable here")
        try:
            return cls(
                uuid.UUID(data["d"]),
                int(data["n"]),
                int(data.get("p", 0)),
                data.get("k", "delivery"),
                str(data.get("tp", "")) if version >= 2 else "",
                version,
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise UnreadableMessage(f"version {version} message without {exc}") from exc


class DatabaseBroker(Broker):
    """django-q2 broker on the service's database, with batch claims and batch acks."""

    @staticmethod
    def get_connection(list_key: str | None = None) -> int:
        return 0

    def _visibility(self) -> timedelta:
        return timedelta(seconds=settings.QUEUE_VISIBILITY_TIMEOUT)

    def enqueue(self, task: str) -> int:
        return self.enqueue_many([task], priorities=[0])[0]

    def enqueue_many(self, tasks: Sequence[str], *, priorities: Sequence[int]) -> list[int]:
        now = timezone.now()
        rows = ENQUEUE_MESSAGES([self.list_key, now, now, json.dumps(tasks), list(priorities)])
        wakeup.notify(wakeup.QUEUE)  # PostgreSQL only: elsewhere the workers poll
        return [r[0] for r in rows]

    def dequeue(self, limit: int | None = None) -> list[tuple[int, str]]:
        """Take up to ``limit`` visible messages, highest priority first, and hide them
        for the visibility timeout. An unacknowledged message becomes visible again.

        django-q2's pusher calls this in a loop with no limit: on an empty queue that
        call waits the cluster's poll interval (``Q_CLUSTER["poll"]``, as django-q2's own
        ORM broker does), so an idle qcluster does not spin on the database."""
        with transaction.atomic(savepoint=False):
            rows = self.lock(limit or settings.WORKER_BATCH_SIZE)
            self.settle(spent=[], hidden=[r[0] for r in rows])
        if not rows and limit is None:
            time.sleep(Conf.POLL)
        return rows

    def take(
        self, limit: int, *, kinds: Sequence[str]
    ) -> tuple[list[Message], list[tuple[int, str]]]:
        """The pipeline workers' take, inside the caller's transaction: up to ``limit``
        dispatches of ``kinds``, read straight from the outbox (each row's publication
        recorded by the claim, no message written), then, to fill the limit, the visible
        messages on this queue (a relay still running with this broker writes them),
        locked as ``lock`` locks them, for ``settle``. A rollback leaves both as they
        were. Returns the outbox rows' messages and the queue's (id, payload)."""
        if not connection.in_atomic_block:
            raise RuntimeError("a take runs inside a transaction")
        rows = TAKE(
            {"kinds": list(kinds), "now": timezone.now(), "limit": limit, "queue": self.list_key}
        )
        claimed = sorted((r for r in rows if r[5] is None), key=lambda r: (-r[3], r[0]))
        return (
            [Message(r[1], r[2], r[3], r[4]) for r in claimed],
            [(r[0], r[5]) for r in rows if r[5] is not None],
        )

    def lock(self, limit: int) -> list[tuple[int, str]]:
        """The first half of a take, inside the caller's transaction: up to ``limit``
        visible messages, highest priority first, locked until ``settle`` and the commit
        (other takes skip them). A rollback leaves them as they were, visible at once."""
        if not connection.in_atomic_block:
            raise RuntimeError("a take runs inside a transaction")
        return LOCK_MESSAGES([self.list_key, timezone.now(), limit])

    def settle(self, *, spent: Sequence[int], hidden: Sequence[int]) -> None:
        """The second half of a take: delete the ``spent`` messages (the caller has
        recorded what they asked for in the same transaction) and hide the others for the
        visibility timeout, to be acknowledged when processed."""
        if not spent and not hidden:
            return
        until = timezone.now() + self._visibility()
        SETTLE_MESSAGES({"spent": list(spent), "hidden": list(hidden), "until": until})

    def acknowledge(self, task_id: int) -> None:
        self.acknowledge_many([task_id])

    def acknowledge_many(self, task_ids: Sequence[int]) -> None:
        ACKNOWLEDGE_MESSAGES([list(task_ids)])

    def fail(self, task_id: int) -> None:
        self.acknowledge(task_id)

    def delete(self, task_id: int) -> None:
        self.acknowledge(task_id)

    def queue_size(self) -> int:
        return QueueMessage.objects.filter(
            queue=self.list_key, visible_at__lte=timezone.now()
        ).count()

    def lock_size(self) -> int:
        return QueueMessage.objects.filter(
            queue=self.list_key, visible_at__gt=timezone.now()
        ).count()

    def purge_queue(self) -> None:
        QueueMessage.objects.filter(queue=self.list_key).delete()

    def delete_queue(self) -> None:
        self.purge_queue()

    def ping(self) -> bool:
        QueueMessage.objects.filter(queue=self.list_key).exists()
        return True

    def info(self) -> str:
        return "database"


def get_broker() -> Broker:
    """The pipeline's broker: ``QUEUE_BROKER_CLASS`` on the queue ``QUEUE_NAME``. Never
    django-q2's default (its cluster's queue), which a qcluster reads."""
    if shares_tasks_queue():
        raise ImproperlyConfigured(QUEUES_SHARED)
    # Built from the app's own setting, not django-q2's Q_CLUSTER["broker_class"] (the
    # host's, which a host may not have: django-q2 would then pick Redis).
    return broker_class()(list_key=settings.QUEUE_NAME)


# Where the database broker was before the job machinery had its own package: a value
# deployments may have set in QUEUE_BROKER_CLASS keeps naming it.
_MOVED = {"deliveries.broker.DatabaseBroker": "deliveries.jobs.broker.DatabaseBroker"}


def broker_class() -> type[Broker]:
    """The class ``QUEUE_BROKER_CLASS`` names (``ImportError`` if none)."""
    path = settings.QUEUE_BROKER_CLASS
    return import_string(_MOVED.get(path, path))


QUEUES_SHARED = (
    "QUEUE_NAME (the pipeline's queue) must differ from django-q2's cluster name "
    "(TASKS_QUEUE_NAME, Q_CLUSTER['name'] or Q_CLUSTER_NAME): a qcluster would take and "
    "delete delivery messages, and the workers would hide its tasks."
)


def tasks_queue_name() -> str:
    """django-q2's cluster queue as django-q2 reads it (``Q_CLUSTER`` at start-up, or the
    ``Q_CLUSTER_NAME`` environment variable; ``"default"`` for a host without either)."""
    return Conf.CLUSTER_NAME


def shares_tasks_queue() -> bool:
    """Whether the pipeline's queue is django-q2's (its cluster name now, or as the
    host's ``Q_CLUSTER`` names it)."""
    named = getattr(settings, "Q_CLUSTER", {}).get("name")
    return settings.QUEUE_NAME in {tasks_queue_name(), named}


# Uniform batch operations over any django-q2 broker: ours and django-q2's Redis broker
# batch (a page or a batch is one round trip), others go one message at a time.


def publish(b: Broker, messages: Sequence[Message]) -> None:
    if not messages:
        return
    if hasattr(b, "enqueue_many"):
        b.enqueue_many([m.encode() for m in messages], priorities=[m.priority for m in messages])
    elif isinstance(b, Redis):
        # django-q2's enqueue is one RPUSH per message; one RPUSH takes them all.
        b.connection.rpush(b.list_key, *(m.encode() for m in messages))
    else:
        for m in messages:
            b.enqueue(m.encode())


def receive(b: Broker, limit: int) -> list[tuple[object, str]]:
    if isinstance(b, DatabaseBroker):
        return b.dequeue(limit)
    got = b.dequeue() or []
    if isinstance(b, Redis) and got and limit > len(got):
        # django-q2's dequeue pops one message (BLPOP, waiting up to a second for it); the
        # rest of the batch is what is already queued, taken at once (LRANGE and LTRIM in
        # one MULTI: any Redis version, and no other consumer gets the same messages).
        pipe = b.connection.pipeline()
        pipe.lrange(b.list_key, 0, limit - len(got) - 1)
        pipe.ltrim(b.list_key, limit - len(got), -1)
        more, _ = pipe.execute()
        got += [(None, payload) for payload in more]
    return [(task_id, p.decode() if isinstance(p, bytes) else p) for task_id, p in got]


def acknowledge(b: Broker, task_ids: Sequence[object]) -> None:
    ids = [t for t in task_ids if t is not None]
    if not ids:
        return
    if hasattr(b, "acknowledge_many"):
        b.acknowledge_many(ids)
    else:
        for task_id in ids:
            b.acknowledge(task_id)
