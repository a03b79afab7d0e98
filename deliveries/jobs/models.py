"""The job machinery's tables. They keep the names they had when they were the deliveries
app's (``deliveries_outbox``…): moving them here changed Django's state only, not the
database (migration 0001)."""

import uuid

from django.db import models
from django.db.models import Q


class Outbox(models.Model):
    """One dispatch of a job waiting to be handed to the queue transport: a delivery, an
    inbound event's processing, any kind registered in ``deliveries.jobs.kinds``.

    It is written in the same transaction that marks the job enqueued; the relay
    publishes it to the broker and only then sets ``published_at``."""

    id = models.BigAutoField(primary_key=True)
    message_key = models.CharField(max_length=80, unique=True)
    kind = models.CharField(max_length=20, default="delivery")
    # The job's id: a Delivery's for kind "delivery".
    ref_id = models.UUIDField()
    dispatch = models.PositiveIntegerField()
    priority = models.SmallIntegerField(default=0)
    created_at = models.DateTimeField()
    # A relay took the row and is publishing it; another relay may take it after this.
    claimed_until = models.DateTimeField(null=True, blank=True)
    published_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "deliveries_outbox"
        verbose_name_plural = "outbox"
        indexes = [
            # The relay's page: unpublished rows in insertion order.
            models.Index(
                fields=["id"], condition=Q(published_at__isnull=True), name="outbox_unpublished"
            ),
        ]


class QueueMessage(models.Model):
    """The database broker's queue (``deliveries.jobs.broker.DatabaseBroker``).

    A message is visible when ``visible_at <= now``. A take locks visible messages and,
    in the same transaction, deletes those it spent (a worker's delivery messages, spent
    with their leases) and moves the others' ``visible_at`` to now + the visibility
    timeout; an acknowledgement deletes those. The table holds only live messages."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=100)
    payload = models.TextField()
    priority = models.SmallIntegerField(default=0)
    visible_at = models.DateTimeField()
    receives = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()

    class Meta:
        db_table = "deliveries_queuemessage"
        indexes = [
            # The broker's take: visible messages of a queue, by priority then age.
            models.Index(fields=["queue", "-priority", "visible_at"], name="queue_visible"),
        ]


class EntityLock(models.Model):
    """A lock on one business entity, with an expiry so a dead holder cannot keep it."""

    key = models.CharField(max_length=300, primary_key=True)
    owner = models.CharField(max_length=100)
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "deliveries_entitylock"


class LoopRun(models.Model):
    """What one run of a long-running command (scheduler, relay, workers, a poll loop)
    did: the run id is in its logs, and its heartbeat is refreshed on a fixed period
    while it runs (``deliveries.jobs.loop.Heartbeat``)."""

    class Kind(models.TextChoices):
        SCHEDULER = "scheduler"
        RELAY = "relay"
        WORKERS = "workers"
        POLL = "poll"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    host = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    ticks = models.PositiveBigIntegerField(default=0)
    # Counters by name, e.g. {"enqueued": 120, "lease_expired": 1}.
    counts = models.JSONField(default=dict)

    class Meta:
        db_table = "deliveries_looprun"
        indexes = [models.Index(fields=["kind", "-started_at"], name="looprun_kind_started")]
