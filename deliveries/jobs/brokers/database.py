"""The default broker, in the service's own database.

For the pipeline's workers the committed outbox row is itself the queue entry: their take
(``take``) claims outbox rows directly and records their publication in the transaction
that leases the jobs, with no relay between them. The broker also keeps a queue table,
for django-q2's tasks and for a relay still run beside the workers (it keeps working, one
hop longer). A take of the table locks a batch (``FOR UPDATE SKIP LOCKED`` on PostgreSQL)
and settles it in the caller's transaction: the messages the caller has spent are
deleted, the rest hidden for the visibility timeout, to be acknowledged (deleted) once
processed. The workers spend a delivery's message in the transaction that leases the
delivery, since from then on the lease is its record; django-q2's ``dequeue`` hides every
message. The table only ever holds live messages. On SQLite the same statements run
inside IMMEDIATE transactions, which serialise them. (django-q2's own ORM broker claims
one row at a time with no SKIP LOCKED and no index, hence this class.)
"""

import json
import time
from collections.abc import Sequence
from datetime import timedelta

from django.db import connection, transaction
from django.utils import timezone
from django_q.brokers import Broker
from django_q.conf import Conf

from deliveries.core.conf import settings

from .. import wakeup
from ..models import QueueMessage
from ..statements import (
    ACKNOWLEDGE_MESSAGES,
    ENQUEUE_MESSAGES,
    LOCK_MESSAGES,
    SETTLE_MESSAGES,
    TAKE,
)
from . import Message


class DatabaseBroker(Broker):
    """django-q2 broker on the service's database, with batch claims and batch acks."""

    # The workers claim the outbox rows themselves (``take``): no relay is needed.
    takes_outbox = True

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

    def publish_many(self, messages: Sequence[Message]) -> None:
        self.enqueue_many([m.encode() for m in messages], priorities=[m.priority for m in messages])

    def receive_many(self, limit: int) -> list[tuple[int, str]]:
        return self.dequeue(limit)

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
