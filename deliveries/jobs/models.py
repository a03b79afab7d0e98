"""The job machinery's tables. The outbox, the queue, the entity locks and the loop runs
keep the names they had when they were the deliveries app's (``deliveries_outbox``…):
moving them here changed Django's state only, not the database (migration 0001). The
host's background jobs (``Job``, ``JobRun``) are this app's own tables."""

import uuid

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q

from deliveries.core.timezones import validate_time_zone

from ..core.ids import uuid7
from .cron import validate_cron


class Outbox(models.Model):
    """One dispatch of a job waiting to be handed to the queue transport: a delivery, an
    inbound event's processing, any kind registered in ``deliveries.jobs.kinds``.

    It is written in the same transaction that marks the job enqueued. With the database
    broker the committed row is itself the queue entry: a worker's take claims it and
    sets ``published_at`` in the transaction that leases the job. With a broker outside
    the database the relay publishes it and only then sets ``published_at``."""

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
            # The workers' take with the database broker: unpublished rows by priority,
            # then age, as the queue table's take orders its messages. The kind is a
            # filter, not a key: one take serves every kind its worker processes, in one
            # order.
            models.Index(
                models.F("priority").desc(),
                "created_at",
                condition=Q(published_at__isnull=True),
                name="outbox_claimable",
            ),
        ]


class QueueMessage(models.Model):
    """The database broker's queue (``deliveries.jobs.brokers.database.DatabaseBroker``).

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
    """What one run of a long-running command (scheduler, relay, workers, a poll loop,
    the SMTP listener) did: the run id is in its logs, and its heartbeat is refreshed on
    a fixed period while it runs (``deliveries.jobs.loop.Heartbeat``)."""

    class Kind(models.TextChoices):
        SCHEDULER = "scheduler"
        RELAY = "relay"
        WORKERS = "workers"
        POLL = "poll"
        JOBS = "jobs"
        SMTP = "smtp"

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

    def __str__(self) -> str:
        return f"{self.kind} on {self.host} (pid {self.pid})"


class JobState(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    DEAD = "dead"


class Job(models.Model):
    """One of the host's background jobs (``deliveries.jobs.background``): the row is the
    queue entry itself. Committed, it is claimable by ``run_jobs``; the claim sets
    ``running`` and a lease in one statement, the worker records the outcome in another.
    Only ``deliveries.jobs.background.state`` and its ``statements`` change ``state``,
    always by guarded UPDATE.

    ``attempts`` counts the claims that ran (or may have run) the function; ``run_at`` is
    when the job is next due. The row keeps only the current state; every run is a
    ``JobRun``."""

    State = JobState

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    type = models.CharField(max_length=200)
    queue = models.CharField(max_length=100, default="default")
    # Higher runs sooner, as on the outbox and the broker's queue.
    priority = models.SmallIntegerField(default=0)
    # The tenant's id as a plain column, no foreign key: the machinery never imports the
    # products' models (deliveries.Tenant), and a host may have tenants of its own.
    tenant_id = models.UUIDField(null=True, blank=True)
    payload = models.JSONField(default=dict)
    version = models.PositiveSmallIntegerField(default=1)
    # NULL, not "": jobs without a key never conflict under job_idempotency.
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.PENDING)
    run_at = models.DateTimeField()
    deadline = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=5)
    lease_token = models.UUIDField(null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    # The entity lock the job runs under ("" for none), computed at enqueue.
    lock_key = models.CharField(max_length=300, default="", blank=True)
    progress_done = models.BigIntegerField(null=True, blank=True)
    progress_total = models.BigIntegerField(null=True, blank=True)
    progress_updated_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(default="", blank=True)
    dead_reason = models.CharField(max_length=500, default="", blank=True)
    # What the function returned, as JSON, for a done job whose type keeps it (a Django
    # task's, deliveries.jobs.tasks, within its backend's RESULT_MAX_BYTES); else NULL.
    result = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(state__in=JobState.values), name="job_state_valid"),
            # A running job has a lease: the sweep finds it when its holder dies.
            models.CheckConstraint(
                condition=~Q(state=JobState.RUNNING)
                | Q(lease_token__isnull=False, lease_until__isnull=False),
                name="job_running_has_lease",
            ),
            # A second enqueue with the same key is a no-op. Partial: a job without a key
            # (most) costs no entry here on its insert and on each state change.
            models.UniqueConstraint(
                fields=["type", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="job_idempotency",
            ),
        ]
        indexes = [
            # The claim (run_jobs): due pending jobs of a queue, by priority then run_at.
            models.Index(
                "queue",
                models.F("priority").desc(),
                "run_at",
                condition=Q(state=JobState.PENDING),
                name="job_claimable",
            ),
            # The lease sweep (the "job" kind's schedule) and the claim's count of running
            # jobs per tenant.
            models.Index(
                fields=["lease_until"], condition=Q(state=JobState.RUNNING), name="job_running"
            ),
            # The deadline sweep: pending jobs that carry a deadline.
            models.Index(
                fields=["deadline"],
                condition=Q(state=JobState.PENDING, deadline__isnull=False),
                name="job_deadline",
            ),
            # The dead-job alert check (deliveries.alerts) and retention, by finish time.
            models.Index(fields=["finished_at"], condition=Q(state=JobState.DEAD), name="job_dead"),
        ]
        # The admin's actions (deliveries.jobs.services): each needs its own permission.
        permissions = [
            ("replay_job", "Can replay dead jobs"),
            ("cancel_job", "Can cancel pending jobs"),
        ]

    def __str__(self) -> str:
        return f"{self.type} {self.id}"


class JobOutcome(models.TextChoices):
    DONE = "done"
    RETRY = "retry"  # raise Retry(after=...)
    ERROR = "error"  # an exception: retried by the policy, or dead when spent
    TIMEOUT = "timeout"
    FAILED = "failed"  # raise Fail(...): dead at once
    UNREADABLE = "unreadable"  # unknown type or payload version: dead
    RELEASED = "released"  # SIGTERM past the grace: given back unfinished
    LOST = "lost"  # the lease expired: the worker died or hung (the scheduler's sweep)


class JobRun(models.Model):
    """One run of a job: appended when the worker records it, never updated."""

    Outcome = JobOutcome

    id = models.BigAutoField(primary_key=True)
    # The machinery's own table: a foreign key like any other. Its index lists a job's
    # runs (admin, REST progress).
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="runs")
    attempt = models.PositiveIntegerField()
    # The run_jobs process (its LoopRun id) that ran it.
    run_id = models.UUIDField(null=True, blank=True)
    started_at = models.DateTimeField()
    duration_ms = models.FloatField()
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    # The traceback of an error, secrets masked; "" for a run that returned.
    error = models.TextField(default="", blank=True)
    # The exception's class as an import path ("builtins.ValueError"); "" for a run that
    # raised nothing. A database default: a previous release inserts runs without it.
    error_class = models.CharField(max_length=200, default="", db_default="", blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(outcome__in=JobOutcome.values),
                name="jobrun_outcome_valid",
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.attempt}"


class RecurringJob(models.Model):
    """A job enqueued on a cron schedule, evaluated in ``time_zone`` (deliveries.jobs.
    recurring). The scheduler's sweep is its one clock: each due tick is enqueued with
    the idempotency key ``recurring:<name>:<tick in UTC>``, so two schedulers, or a rerun
    after a crash, never enqueue one tick twice. Change it through
    ``services.recurring_job_save``, which sets ``next_tick_at`` from the schedule."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=100, unique=True)
    job_type = models.CharField(max_length=200)
    cron = models.CharField(
        max_length=200,
        validators=[validate_cron],
        help_text="Five fields: minute hour day-of-month month day-of-week (0 9 * * 1-5).",
    )
    time_zone = models.CharField(
        max_length=64,
        default="UTC",
        validators=[validate_time_zone],
        help_text="An IANA name (Europe/Berlin); the cron is read on its wall clock.",
    )
    payload = models.JSONField(default=dict, blank=True)
    # A plain column, as on Job: the machinery has no key to the products' tenants.
    tenant_id = models.UUIDField(null=True, blank=True)
    enabled = models.BooleanField(default=True)
    # The latest tick enqueued (UTC), and the next one the sweep waits for.
    last_scheduled_tick = models.DateTimeField(null=True, blank=True)
    next_tick_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            # The scheduler's sweep: enabled rows whose next tick has come.
            models.Index(
                fields=["next_tick_at"], condition=Q(enabled=True), name="recurringjob_due"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        # Whether the type is registered is the process's to say, not the row's:
        # services.recurring_job_save asks the registry.
        if not isinstance(self.payload, dict):
            raise ValidationError(
                {"payload": "The payload is a JSON object: the job's keyword arguments."}
            )
