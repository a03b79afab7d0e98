"""Outbound webhooks: tenants, endpoints, events, deliveries, attempts and the outbox.

The delivery row holds only the current state of one logical delivery; each HTTP attempt
is an append-only ``Attempt`` row. State changes never go through ``save()``: they are
guarded UPDATEs in ``deliveries/state.py``, the one module that owns the state machine.
"""

import contextlib
import ipaddress
import uuid

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q

from deliveries.core.conf import settings

from . import catalogue
from .core import encryption
from .core.egress import EgressPolicy, ErrorKind, match_allowances, validate_endpoint_url
from .core.headers import validate_endpoint_headers
from .core.ids import uuid7
from .core.timezones import validate_time_zone

ERROR_KIND_CHOICES = [("", "None")] + [
    (k.value, k.value.replace("_", " ").title()) for k in ErrorKind
]


class Tenant(models.Model):
    """A customer of the service: owns endpoints, events and deliveries."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True)
    # The host project's own key for the account this tenant is (its customer's id, say):
    # services.tenant_get_or_create finds or makes the tenant by it, so a host links its
    # account model without a join table. Unique where set; NULL for tenants made here.
    external_id = models.CharField(
        max_length=200,
        unique=True,
        null=True,
        blank=True,
        help_text="The host application's own id for this tenant's account.",
    )
    # Where the tenant's "every day at 09:00" is read (deliveries.core.timezones); everything
    # the service stores and schedules is UTC. db_default: rows inserted by code that
    # predates the column still get a value (expand-contract, docs/compatibility.md).
    time_zone = models.CharField(
        max_length=64,
        default="UTC",
        db_default="UTC",
        validators=[validate_time_zone],
        help_text="IANA time zone name, e.g. Europe/Berlin.",
    )
    # Where the tenant is told about its endpoints (disabled, failing): set by the tenant
    # in its portal, or by staff. db_default: older writers still insert.
    notification_email = models.EmailField(
        blank=True,
        default="",
        db_default="",
        help_text="Told by email when one of its endpoints is disabled or keeps failing.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    """A tenant's REST credential. Only a SHA-256 of the key is stored; the prefix is
    shown so that a person can tell keys apart. Keys carry 256 random bits, so a fast
    hash is enough (there is nothing to brute-force)."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Optional: a key handed to a contractor or a CI job can stop working by itself.
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="The key stops working at this time; empty: never."
    )

    class Meta:
        permissions = [
            # Minting shows the key once: more than adding a row.
            ("create_api_key", "Can create a tenant's API key and see it once"),
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant})"


class Endpoint(models.Model):
    """A URL a tenant registered to receive events."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="endpoints")
    # The URL's egress rule depends on the tenant (its allowances): checked in clean(),
    # the rule the API and the services apply too.
    url = models.URLField(max_length=2000)
    description = models.CharField(max_length=500, blank=True)
    # Empty list: every event type. Entries are type names or dotted prefixes with a
    # wildcard (invoice.*), deliveries.catalogue's rule.
    event_types = models.JSONField(
        default=list, blank=True, validators=[catalogue.validate_event_type_filter]
    )
    enabled = models.BooleanField(default=True)
    disabled_reason = models.CharField(max_length=200, blank=True)
    disabled_at = models.DateTimeField(null=True, blank=True)
    # Set by the first failure after a success; cleared by a success. An endpoint failing
    # for longer than DELIVERY_DISABLE_AFTER is disabled.
    failing_since = models.DateTimeField(null=True, blank=True)
    # Paused (non-null): its deliveries are held pending, neither admitted nor
    # dead-lettered, and events published meanwhile still get theirs; resuming lets them
    # flow (services.endpoint_pause / endpoint_resume, deliveries.admission). Unlike a
    # disabled endpoint, nothing is lost. db_default: an older release still inserts.
    paused_at = models.DateTimeField(null=True, blank=True)
    paused_reason = models.CharField(max_length=200, blank=True, default="", db_default="")
    # Start-rate ceiling (requests per second; null: none) and concurrency ceiling.
    rate_limit = models.FloatField(null=True, blank=True)
    max_concurrency = models.PositiveIntegerField(null=True, blank=True)
    timeout = models.FloatField(null=True, blank=True)
    headers = models.JSONField(default=dict, blank=True, validators=[validate_endpoint_headers])
    retry_client_errors = models.BooleanField(
        default=False, help_text="Retry 4xx answers other than 408, 425 and 429 too."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        permissions = [
            # Rotating shows the new secret, with which anyone can sign deliveries the
            # receiver accepts: more than changing the endpoint.
            ("rotate_secret", "Can rotate an endpoint's signing secret and see the new one"),
            # Holding deliveries back is an operation on the tenant's traffic, not an
            # edit of the endpoint's settings.
            ("pause_endpoint", "Can pause and resume an endpoint's deliveries"),
        ]
        indexes = [
            # publish_event: the enabled endpoints of one tenant.
            models.Index(fields=["tenant", "enabled"], name="endpoint_tenant_enabled"),
            # The alerts' endpoint_failing check: enabled endpoints failing for a while.
            models.Index(
                fields=["failing_since"],
                condition=Q(enabled=True, failing_since__isnull=False),
                name="endpoint_failing",
            ),
            # Admission's every pass: the paused endpoints, whose rows it leaves out
            # (statements.admit.PAUSED_ENDPOINTS). Partial: it holds the paused ones only.
            models.Index(
                fields=["id"], condition=Q(paused_at__isnull=False), name="endpoint_paused"
            ),
        ]

    def __str__(self) -> str:
        return self.url

    def clean(self) -> None:
        """The admin's form and full_clean() refuse the URLs the API refuses, with the
        networks open to this endpoint's tenant (and to the endpoint) counted."""
        if not self.url or not self.tenant_id:
            return
        target = (self.tenant_id, self.pk)
        rows = EgressAllowance.objects.filter(tenant_id=self.tenant_id).values_list(
            "tenant_id", "endpoint_id", "network"
        )
        policy = EgressPolicy.from_settings().widened(match_allowances([target], rows)[target])
        try:
            validate_endpoint_url(self.url, policy)
        except ValidationError as exc:
            raise ValidationError({"url": exc.messages}) from exc

    @property
    def paused(self) -> bool:
        return self.paused_at is not None

    def subscribes_to(self, event_type: str) -> bool:
        return catalogue.matches(self.event_types, event_type)


class EndpointSecret(models.Model):
    """A signing secret (``whsec_`` + base64). Several can be active during a rotation:
    the old one keeps signing until ``expires_at``, so receivers can switch over."""

    # Read and written as ``secret`` (below), which encrypts: the database holds a token.
    encrypted_secret_fields = (("secret_encrypted", "legacy_plaintext"),)

    id = models.BigAutoField(primary_key=True)
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="secrets")
    # A Fernet token under SECRETS_ENCRYPTION_KEYS (deliveries/core/encryption.py). Null only on
    # a row a release before encryption wrote, until it is encrypted (migration 0018 and
    # rotate_encryption_keys encrypt such rows).
    secret_encrypted = models.TextField(null=True, blank=True)  # noqa: DJ001
    # The column the secret used to be kept in, in plain text: blanked by migration 0018
    # and never written since. Kept only so that a previous release can still insert;
    # a later release drops it (docs/compatibility.md, "Secrets at rest").
    legacy_plaintext = models.CharField(max_length=200, blank=True, default="", db_column="secret")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"secret {self.id} of {self.endpoint_id}"

    @property
    def secret(self) -> str:
        return encryption.reveal(
            self.secret_encrypted, self.legacy_plaintext, row=f"endpoint secret {self.pk}"
        )

    @secret.setter
    def secret(self, value: str) -> None:
        self.secret_encrypted = encryption.encrypt(value)
        self.legacy_plaintext = ""


def validate_network(value: str) -> None:
    """A CIDR network with no host bits set (``10.20.0.0/16``, ``fd12::/16``)."""
    try:
        ipaddress.ip_network(value.strip())
    except ValueError as exc:
        raise ValidationError(f"{value!r} is not a CIDR network ({exc}).") from None


class EgressAllowance(models.Model):
    """A network staff opened for one tenant's endpoints, or for one endpoint, although
    the egress guard refuses it by default (a receiver inside the operator's network).

    The worker admits it for that tenant's (endpoint's) deliveries only, on top of
    EGRESS_ALLOW_NETWORKS, which opens a network for every tenant and so is for the
    operator's own receivers. Metadata and link-local addresses stay refused whatever
    it says (deliveries/core/egress.py)."""

    id = models.BigAutoField(primary_key=True)
    # Indexed (the foreign key's index): the worker reads a batch's tenants' rows.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="egress_allowances")
    endpoint = models.ForeignKey(
        Endpoint,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="egress_allowances",
        help_text="Empty: every endpoint of the tenant.",
    )
    network = models.CharField(
        max_length=50,
        validators=[validate_network],
        help_text="CIDR, e.g. 10.20.0.0/16 or fd12:3456::/48.",
    )
    note = models.CharField(max_length=500, blank=True, help_text="Why, and who asked.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        editable=False,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.network} for {self.endpoint or self.tenant}"

    def clean(self) -> None:
        if self.network:
            with contextlib.suppress(ValueError):  # the field's validator says why
                self.network = str(ipaddress.ip_network(self.network.strip()))
        if (
            self.endpoint_id is not None
            and self.tenant_id is not None
            and (self.endpoint.tenant_id != self.tenant_id)
        ):
            raise ValidationError({"endpoint": "This endpoint belongs to another tenant."})


class EndpointThrottle(models.Model):
    """Token bucket for an endpoint's start-rate ceiling, spent by the scheduler when it
    admits deliveries (under its admission lock, so schedulers never double-spend)."""

    endpoint = models.OneToOneField(
        Endpoint, on_delete=models.CASCADE, primary_key=True, related_name="throttle"
    )
    tokens = models.FloatField()
    refilled_at = models.DateTimeField()


class Event(models.Model):
    """One published event. The body bytes are fixed at publish time and sent unchanged
    on every attempt; a payload revision is a new event."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="events")
    # Indexed for the admin's event-type filter (events are never updated, so the index
    # costs one entry per event).
    event_type = models.CharField(max_length=200, db_index=True)
    payload_version = models.PositiveSmallIntegerField(default=1)
    entity_id = models.CharField(max_length=200, blank=True, db_index=True)
    body = models.BinaryField()
    priority = models.SmallIntegerField(default=0)
    # NULL, not "", for "no key": the unique constraint applies only to real keys.
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    # SHA-256 of the create request that carried the idempotency key: the same key with
    # a different request is refused (422).
    request_hash = models.CharField(max_length=64, blank=True)
    # W3C traceparent of the publish span, when tracing is on (deliveries/core/tracing.py): the
    # relay and the workers continue that trace. db_default: older writers still insert.
    trace_context = models.CharField(max_length=128, blank=True, default="", db_default="")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="event_idempotency_key_per_tenant",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event_type} {self.id}"


class DeliveryState(models.TextChoices):
    PENDING = "pending"
    ENQUEUED = "enqueued"
    LEASED = "leased"
    SUCCEEDED = "succeeded"
    DEAD = "dead"


class Outcome(models.TextChoices):
    """The classified result of an attempt (or of a transition without one)."""

    SUCCESS = "success"
    RETRY = "retry"
    PERMANENT = "permanent"
    ENDPOINT_GONE = "endpoint_gone"
    BLOCKED = "blocked"
    ENDPOINT_DISABLED = "endpoint_disabled"
    CANCELLED = "cancelled"
    LEASE_EXPIRED = "lease_expired"
    TRANSPORT_LOST = "transport_lost"


class Delivery(models.Model):
    """One logical delivery of an event to an endpoint. Its id is the ``webhook-id`` and
    ``Idempotency-Key`` on every copy sent."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    # Every index on this row gets a new entry at each of its three state changes (no
    # update that changes the state can be HOT). So the row keeps only the indexes the
    # state machine reads: the event's is the (event, endpoint) uniqueness below. The
    # endpoint and tenant columns are for the state machine's reads; their foreign keys,
    # and the indexes that the lists and a deletion need, are on the insert-only
    # DeliveryListing, through which deleting an endpoint or a tenant deletes its
    # deliveries (cascade_to_deliveries).
    event = models.ForeignKey(
        Event, on_delete=models.CASCADE, related_name="deliveries", db_index=False
    )
    endpoint = models.ForeignKey(
        Endpoint,
        on_delete=models.DO_NOTHING,
        related_name="+",
        db_index=False,
        db_constraint=False,
    )
    tenant = models.ForeignKey(
        Tenant, on_delete=models.DO_NOTHING, related_name="+", db_index=False, db_constraint=False
    )
    state = models.CharField(
        max_length=16, choices=DeliveryState.choices, default=DeliveryState.PENDING
    )
    priority = models.SmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    # All attempts ever made (numbers the Attempt rows) and the attempts that count
    # against the retry schedule (reset by a replay).
    attempt_count = models.PositiveIntegerField(default=0)
    policy_attempts = models.PositiveIntegerField(default=0)
    # How many times the scheduler handed this delivery to the transport; part of the
    # outbox message key, so each dispatch gets its own outbox row.
    dispatch_count = models.PositiveIntegerField(default=0)
    enqueued_at = models.DateTimeField(null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    lease_token = models.UUIDField(null=True, blank=True)
    lease_expiries = models.PositiveIntegerField(default=0)
    last_outcome = models.CharField(max_length=32, choices=Outcome.choices, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "deliveries"
        permissions = [
            ("replay_delivery", "Can replay and cancel deliveries"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["event", "endpoint"], name="delivery_event_endpoint"),
            models.CheckConstraint(
                condition=Q(state__in=DeliveryState.values), name="delivery_state_valid"
            ),
            models.CheckConstraint(
                condition=~Q(state=DeliveryState.LEASED)
                | (Q(lease_until__isnull=False) & Q(lease_token__isnull=False)),
                name="delivery_leased_has_lease",
            ),
        ]
        indexes = [
            # The scheduler's claim: due pending rows by priority, then age. Partial, so
            # it holds only claimable rows however many terminal rows the table keeps.
            models.Index(
                fields=["-priority", "next_attempt_at"],
                condition=Q(state="pending"),
                name="delivery_due",
            ),
            # The same rows by endpoint: the scheduler's claim when some endpoints are
            # at their ceilings, which reads each other endpoint's first rows instead of
            # reading past every row the full ones cannot take (deliveries.admission).
            models.Index(
                fields=["endpoint", "-priority", "next_attempt_at"],
                condition=Q(state="pending"),
                name="delivery_due_endpoint",
            ),
            # Admission control and the lease/transport sweeps: rows in flight.
            models.Index(
                fields=["tenant", "endpoint"],
                condition=Q(state__in=["enqueued", "leased"]),
                name="delivery_in_flight",
            ),
            # Dead-letter view (grouped by endpoint and reason from the index alone) and
            # bulk recovery.
            models.Index(
                fields=["endpoint", "finished_at"],
                include=["last_outcome"],
                condition=Q(state="dead"),
                name="delivery_dead",
            ),
            # The admin's outcome filter: failed outcomes only, so a delivery that
            # succeeds the first time never enters it.
            models.Index(
                fields=["last_outcome", "-created_at"],
                condition=~Q(last_outcome__in=["", "success"]),
                name="delivery_failed_outcome",
            ),
        ]

    def __str__(self) -> str:
        return str(self.id)


def cascade_to_deliveries(collector, field, sub_objs, using):
    """``on_delete`` of the listing's endpoint and tenant: deleting an endpoint or a
    tenant, in any way Django deletes (a service, the admin, a queryset), deletes their
    deliveries, found through the listing's indexes; the deliveries take their listing
    rows and attempts with them. Django's CASCADE here would delete the listing rows
    alone, and the delivery's own keys are DO_NOTHING so that Django never reads the
    delivery table by its unindexed endpoint and tenant columns."""
    collector.collect(
        Delivery.objects.using(using).filter(pk__in=sub_objs.values("delivery_id")),
        source=field.remote_field.model,
        nullable=False,
        fail_on_restricted=False,
    )


# The collector passes the listing rows unread: the deliveries' query reads them.
cascade_to_deliveries.lazy_sub_objs = True


class DeliveryListing(models.Model):
    """Whose a delivery is and when it was made, written with it at publish and never
    updated: what the delivery lists (the customer history, the admin log, retention)
    read deliveries by, newest or oldest first, and what deleting an endpoint or a
    tenant finds them by.

    On the delivery row these indexes would get a new entry at each of its three state
    changes; here each gets one, at publish (docs/architecture.md, "The listing
    table"). A trigger on the delivery table writes it (migration 0016), in the
    statement that inserts the deliveries, whoever inserts them: the listing cannot miss
    a delivery. (A later migration that rebuilds the delivery table on SQLite, as
    altering a column there does, drops the trigger and has to make it again:
    tests/e2e/test_sqlite_smoke.py would find deliveries unlisted.)"""

    # The key is the migration's (0016): ON DELETE CASCADE in PostgreSQL as well, for a
    # previous release that deletes deliveries without knowing this table.
    delivery = models.OneToOneField(
        Delivery,
        primary_key=True,
        on_delete=models.CASCADE,
        related_name="listing",
        db_constraint=False,
    )
    tenant = models.ForeignKey(
        Tenant, on_delete=cascade_to_deliveries, related_name="+", db_index=False
    )
    endpoint = models.ForeignKey(
        Endpoint, on_delete=cascade_to_deliveries, related_name="+", db_index=False
    )
    # The delivery's created_at, copied.
    created_at = models.DateTimeField()

    class Meta:
        indexes = [
            # The admin log newest first (and under its state, event-type and outcome
            # filters, which read on until a page is full), and retention oldest first.
            models.Index(fields=["-created_at", "-delivery"], name="listing_created"),
            # One tenant's deliveries newest first (the API's every list, the admin's
            # tenant filter) and one endpoint's (the endpoint filter, and the reads and
            # foreign-key checks of an endpoint's deletion).
            models.Index(fields=["tenant", "-created_at", "-delivery"], name="listing_tenant"),
            models.Index(fields=["endpoint", "-created_at", "-delivery"], name="listing_endpoint"),
        ]

    def __str__(self) -> str:
        return str(self.delivery_id)


class Attempt(models.Model):
    """One HTTP attempt, append-only: the evidence of what happened on the wire."""

    id = models.BigAutoField(primary_key=True)
    # Indexed by attempt_delivery_number, which leads with it.
    delivery = models.ForeignKey(
        Delivery, on_delete=models.CASCADE, related_name="attempts", db_index=False
    )
    # The delivery's endpoint, copied so that an endpoint's recent attempts are read by
    # attempt_endpoint_started alone (null on attempts recorded before it was added).
    endpoint = models.ForeignKey(
        "Endpoint", null=True, blank=True, on_delete=models.CASCADE, related_name="+",
        db_index=False,
    )  # fmt: skip
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.FloatField()
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    outcome = models.CharField(max_length=32, choices=Outcome.choices)
    # Why there was no HTTP answer: one of deliveries.core.egress.ErrorKind, or "".
    error_kind = models.CharField(max_length=16, choices=ERROR_KIND_CHOICES, blank=True)
    error = models.CharField(max_length=500, blank=True)
    # A timeout or a dropped connection after sending: the receiver may have acted on it.
    ambiguous = models.BooleanField(default=False)
    response_body = models.TextField(blank=True)
    response_truncated = models.BooleanField(default=False)
    request_headers = models.JSONField(default=dict)
    # The outcome was recorded by the lease holder (False: the lease had been lost, so
    # the attempt is evidence only and changed no state).
    recorded = models.BooleanField(default=True)
    worker = models.CharField(max_length=100, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(outcome__in=Outcome.values), name="attempt_outcome_valid"
            ),
        ]
        indexes = [
            # The attempt timeline of one delivery.
            models.Index(fields=["delivery", "number"], name="attempt_delivery_number"),
            # Endpoint health over the last 24 hours (admin endpoint list).
            models.Index(fields=["endpoint", "started_at"], name="attempt_endpoint_started"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number}"


# Upper bounds (milliseconds) of the latency buckets of EndpointHour; a last bucket
# holds the slower ones. A percentile read from them is "at most <bound>".
LATENCY_BOUNDS_MS = (5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000)
LATENCY_COLUMNS = (*(f"le_{bound}ms" for bound in LATENCY_BOUNDS_MS), "slower")


class AttemptMinute(models.Model):
    """Attempts counted by minute and outcome: the overview's chart of the last 24 hours,
    read without touching the attempt rows (1,440 minutes, whatever the traffic).

    Written by the worker's recording transaction, in the statement that records the
    batch (statements.worker.RECORD, its tallies those of TALLY_ATTEMPTS). ``writer`` is
    the recording connection (its PostgreSQL backend pid): no two transactions ever add
    to one row at once, so recording workers never wait for each other here. Readers sum
    over it."""

    id = models.BigAutoField(primary_key=True)
    minute = models.DateTimeField()
    outcome = models.CharField(max_length=32)
    writer = models.IntegerField()
    attempts = models.PositiveIntegerField()

    class Meta:
        constraints = [
            # The tally's upsert; and the overview's range of minutes (it leads).
            models.UniqueConstraint(
                fields=["minute", "outcome", "writer"], name="attemptminute_key"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.outcome}: {self.attempts}"


class EndpointHour(models.Model):
    """Attempts counted by hour, endpoint and outcome, with their time and a latency
    histogram (LATENCY_BOUNDS_MS): each endpoint's success rate and percentiles over the
    last 24 hours, read from at most 24 rows per endpoint, outcome and writer. Written
    with AttemptMinute, by the same statement and the same rule for ``writer``."""

    id = models.BigAutoField(primary_key=True)
    hour = models.DateTimeField()
    endpoint = models.ForeignKey(
        Endpoint, on_delete=models.CASCADE, related_name="+", db_constraint=False,
        db_index=False,
    )  # fmt: skip
    outcome = models.CharField(max_length=32)
    writer = models.IntegerField()
    attempts = models.PositiveIntegerField()
    total_ms = models.FloatField()
    le_5ms = models.PositiveIntegerField(default=0)
    le_10ms = models.PositiveIntegerField(default=0)
    le_20ms = models.PositiveIntegerField(default=0)
    le_50ms = models.PositiveIntegerField(default=0)
    le_100ms = models.PositiveIntegerField(default=0)
    le_200ms = models.PositiveIntegerField(default=0)
    le_500ms = models.PositiveIntegerField(default=0)
    le_1000ms = models.PositiveIntegerField(default=0)
    le_2000ms = models.PositiveIntegerField(default=0)
    le_5000ms = models.PositiveIntegerField(default=0)
    le_10000ms = models.PositiveIntegerField(default=0)
    le_30000ms = models.PositiveIntegerField(default=0)
    slower = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            # The tally's upsert; and the overview's last 24 hours (it leads with hour).
            models.UniqueConstraint(
                fields=["hour", "endpoint", "outcome", "writer"], name="endpointhour_key"
            ),
        ]
        indexes = [
            # Deleting an endpoint deletes its rows (Django's cascade reads them by it).
            models.Index(fields=["endpoint", "hour"], name="endpointhour_endpoint"),
        ]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h {self.endpoint_id} {self.outcome}: {self.attempts}"


def endpoint_timeout(timeout: float | None) -> float:
    """The request timeout of an endpoint whose ``timeout`` field holds ``timeout``."""
    return min(timeout or settings.DELIVERY_TIMEOUT, settings.DELIVERY_MAX_TIMEOUT)


class SchemaValidation(models.TextChoices):
    """What publishing does with a payload that does not match its type's schema."""

    REJECT = "reject", "Reject: publishing refuses the payload"
    WARN = "warn", "Warn: log and count it, publish anyway"
    OFF = "off", "Off: do not check"


class EventType(models.Model):
    """A kind of event in the catalogue: what it means, the team that owns it, its
    payload's JSON Schema per version (``versions``), and whether replaying it in bulk is
    safe (a receiver that is not idempotent for it would double-charge, double-email…).

    Tenants read the catalogue (``GET /api/v1/event-types/``, the portal); a type's
    group is its dotted prefix (``invoice`` for ``invoice.paid``), which an endpoint
    subscribes to as ``invoice.*``."""

    name = models.CharField(max_length=200, primary_key=True)
    owner = models.CharField(max_length=200, blank=True, help_text="Team or person to ask.")
    description = models.TextField(blank=True)
    replay_safe = models.BooleanField(
        default=False, help_text="Receivers handle a replay of this type without harm."
    )
    # warn by default: a schema added to a type that code already publishes must not
    # start rolling back the host's transactions (reject raises inside them).
    # db_default: rows a previous release inserts still get a value.
    validation = models.CharField(
        max_length=8,
        choices=SchemaValidation.choices,
        default=SchemaValidation.WARN,
        db_default=SchemaValidation.WARN,
        help_text="What publishing does with a payload that does not match its schema.",
    )

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(validation__in=SchemaValidation.values),
                name="event_type_validation_valid",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if catalogue.event_type_problem(self.name or ""):
            raise ValidationError({"name": catalogue.event_type_problem(self.name or "")})

    @property
    def group(self) -> str:
        return catalogue.group_of(self.name)


class EventTypeVersion(models.Model):
    """One payload version of an event type: its JSON Schema and an example payload.
    Versions are additive: a change that would refuse payloads the previous version took
    is a new version, and publishers name the version they send (``payload_version``)."""

    id = models.BigAutoField(primary_key=True)
    # Indexed by event_type_version_unique, which leads with it.
    event_type = models.ForeignKey(
        EventType, on_delete=models.CASCADE, related_name="versions", db_index=False
    )
    version = models.PositiveSmallIntegerField(default=1)
    schema = models.JSONField(
        default=dict,
        blank=True,
        help_text="JSON Schema (Draft 2020-12) of the payload; {} accepts any payload.",
    )
    example = models.JSONField(
        default=dict, blank=True, help_text="An example payload; it must match the schema."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["event_type", "version"]
        constraints = [
            models.UniqueConstraint(
                fields=["event_type", "version"], name="event_type_version_unique"
            ),
            models.CheckConstraint(condition=Q(version__gte=1), name="event_type_version_min"),
        ]

    def __str__(self) -> str:
        return f"{self.event_type_id} v{self.version}"

    def clean(self) -> None:
        # Here, not only in the field's validator, which an empty list ([]) skips.
        try:
            catalogue.validate_json_schema(self.schema)
        except ValidationError as exc:
            raise ValidationError({"schema": exc.messages}) from None
        problem = catalogue.example_problem(self.schema, self.example)
        if problem:
            raise ValidationError({"example": problem})


class PortalLink(models.Model):
    """A short-lived, single-use link into one tenant's portal (deliveries.portal). Only
    a SHA-256 of its token is stored (256 random bits: nothing to brute-force); opening
    it marks it used, in a guarded UPDATE, and starts a portal session for the tenant."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    # Who asked: "python", "api key 12".
    via = models.CharField(max_length=100, blank=True)

    class Meta:
        indexes = [
            # Retention: links past their expiry, oldest first.
            models.Index(fields=["expires_at"], name="portal_link_expires"),
        ]

    def __str__(self) -> str:
        return f"portal link {self.id} of {self.tenant_id}"


class AuditEntry(models.Model):
    """Who did what to which rows, written in the same transaction as the change."""

    id = models.BigAutoField(primary_key=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    action = models.CharField(max_length=100)
    target = models.CharField(max_length=100)
    count = models.PositiveIntegerField(default=0)
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.action} {self.count} {self.target}"


class OperationalEvent(models.Model):
    """An incident the service noticed about itself (dead letters growing, an endpoint
    disabled, a spike of inbound verification failures), recorded as data.

    One row per incident: while it is open (``resolved_at`` null) the same condition
    seen again only bumps ``occurrences`` and ``last_seen_at``, so one incident sends one
    notification. It resolves once the condition has not been seen for
    ALERTS_RESOLVE_AFTER; seen again after that, it is a new incident."""

    class Kind(models.TextChoices):
        DEAD_LETTERS = "dead_letters"
        ENDPOINT_DISABLED = "endpoint_disabled"
        ENDPOINT_FAILING = "endpoint_failing"
        VERIFICATION_FAILURES = "verification_failures"
        DEAD_JOBS = "dead_jobs"

    class Severity(models.TextChoices):
        WARNING = "warning"
        CRITICAL = "critical"

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=40)
    # What the incident is about, within its kind: "all", an endpoint id, a source slug.
    key = models.CharField(max_length=200)
    severity = models.CharField(max_length=16, choices=Severity.choices, default=Severity.WARNING)
    summary = models.CharField(max_length=500)
    details = models.JSONField(default=dict, blank=True)
    first_seen_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    occurrences = models.PositiveIntegerField(default=1)
    resolved_at = models.DateTimeField(null=True, blank=True)
    # Set when a notifier claimed the incident (guarded UPDATE: one claim per incident).
    notified_at = models.DateTimeField(null=True, blank=True)
    # What the notification did: {"webhook": "...", "email": "..."}.
    notification = models.JSONField(default=dict, blank=True)

    class Meta:
        constraints = [
            # At most one open incident per (kind, key): two processes noticing the same
            # condition at once cannot open two incidents (and send two messages).
            models.UniqueConstraint(
                fields=["kind", "key"],
                condition=Q(resolved_at__isnull=True),
                name="operational_event_open",
            ),
        ]
        indexes = [
            # The notifier's claim: open incidents not yet notified.
            models.Index(
                fields=["first_seen_at"],
                condition=Q(notified_at__isnull=True),
                name="operational_event_unnotified",
            ),
            # The admin list and retention.
            models.Index(fields=["-first_seen_at"], name="operational_event_first_seen"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.key}"


class AlertCheckpoint(models.Model):
    """Where an alert check left off (its last run time and any baseline), so that the
    next run looks only at what changed since."""

    name = models.CharField(max_length=100, primary_key=True)
    checked_at = models.DateTimeField()
    data = models.JSONField(default=dict, blank=True)
