"""Queue transport: the interface every broker stands behind, one module per broker.

A broker is a ``django_q.brokers.Broker`` named by ``QUEUE_BROKER_CLASS``; the pipeline
reaches it only through this module (``get_broker``, ``publish``, ``receive``,
``acknowledge``, ``Message``) and asks a broker what it can do by its attributes, never
by its type:

- ``publish_many(messages)``, ``receive_many(limit)``, ``acknowledge_many(ids)``: a
  page or a batch in one round trip; without them the broker's one-message calls run in
  a loop (any django-q2 broker works).
- ``takes_outbox = True``: the broker lives in the service's database and the workers
  claim the committed outbox rows themselves (``take``), so no relay is needed and the
  outbox and queue notifications wake the workers.

The brokers: ``database`` (``DatabaseBroker``, the default) and ``redis``
(``RedisBroker``, django-q2's Redis broker with batches; the extra
``trusty-webhooks[redis]``). A broker without acknowledgements loses the messages a
killed worker held; the scheduler's lost-dispatch sweep
(``SCHEDULER_STALE_ENQUEUED_SECONDS``) recovers those deliveries, so they are late,
never lost.

The same broker class serves two queues that never share a key: the pipeline's
(``QUEUE_NAME``: relay to workers, ``get_broker()``) and django-q2's own (its cluster's
name, ``TASKS_QUEUE_NAME``: a ``qcluster`` running the maintenance schedules). Each side
reads only its own, so neither takes a message it cannot read: a qcluster would delete a
delivery message it failed to unpickle, and a worker would hide a django-q2 task.
"""

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string
from django_q.brokers import Broker
from django_q.conf import Conf

from deliveries.core.conf import settings

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


def get_broker() -> Broker:
    """The pipeline's broker: ``QUEUE_BROKER_CLASS`` on the queue ``QUEUE_NAME``. Never
    django-q2's default (its cluster's queue), which a qcluster reads."""
    if shares_tasks_queue():
        raise ImproperlyConfigured(QUEUES_SHARED)
    # Built from the app's own setting, not django-q2's Q_CLUSTER["broker_class"] (the
    # host's, which a host may not have: django-q2 would then pick Redis).
    return broker_class()(list_key=settings.QUEUE_NAME)


# Where the brokers were before: a value deployments may have set in QUEUE_BROKER_CLASS
# keeps naming them. django-q2's own Redis broker gets the batching subclass.
DATABASE_BROKER = "deliveries.jobs.brokers.database.DatabaseBroker"
_MOVED = {
    "deliveries.broker.DatabaseBroker": DATABASE_BROKER,
    "deliveries.jobs.broker.DatabaseBroker": DATABASE_BROKER,
    "django_q.brokers.redis_broker.Redis": "deliveries.jobs.brokers.redis.RedisBroker",
}


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


def takes_outbox(b: Broker | type[Broker]) -> bool:
    """Whether the workers claim the outbox rows themselves with this broker (a broker or
    its class): no relay is needed."""
    return bool(getattr(b, "takes_outbox", False))


# Uniform batch operations over any django-q2 broker: a broker that batches does a page
# or a batch in one round trip, others go one message at a time.


def publish(b: Broker, messages: Sequence[Message]) -> None:
    if not messages:
        return
    if hasattr(b, "publish_many"):
        b.publish_many(messages)
    else:
        for m in messages:
            b.enqueue(m.encode())


def receive(b: Broker, limit: int) -> list[tuple[object, str]]:
    got = b.receive_many(limit) if hasattr(b, "receive_many") else (b.dequeue() or [])
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
