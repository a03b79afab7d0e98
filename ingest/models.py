"""Inbound webhooks: sources, their secrets, the events received, and the evidence of
verification failures and handler runs."""

import uuid

from django.db import models
from django.db.models import Q, Value

from deliveries.core import encryption
from deliveries.core.ids import uuid7

from .schemes import SCHEMES


class Source(models.Model):
    """One configured provider endpoint: ``POST /ingest/<slug>/``."""

    slug = models.SlugField(max_length=100, unique=True)
    scheme = models.CharField(max_length=20, choices=[(s, s) for s in SCHEMES])
    # Scheme options (the generic HMAC scheme's header, algorithm, encoding…).
    options = models.JSONField(default=dict, blank=True)
    enabled = models.BooleanField(default=True)
    # Seconds a signed timestamp may be off, in both directions.
    replay_tolerance = models.PositiveIntegerField(default=300)
    max_body_bytes = models.PositiveIntegerField(default=1024 * 1024)
    # Empty: the scheme's own (application/json for most).
    content_types = models.JSONField(default=list, blank=True)
    # Requests per second accepted from this source (null: no limit); past it, 429.
    rate_limit = models.FloatField(null=True, blank=True)
    # Keys (in a JSON or form body, at any depth; headers by name) whose values the
    # console masks when it shows an event, on top of its own list (ingest.selectors.
    # REDACTED_KEYS). What is stored, and what handlers get, is the body as received.
    # db_default: an older release still inserts sources.
    redact_keys = models.JSONField(
        default=list,
        db_default=Value([], output_field=models.JSONField()),
        blank=True,
        help_text='Field names to mask when the console shows a body, e.g. ["email", "iban"].',
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.slug


class SourceSecret(models.Model):
    """A verification secret. Several can be live at once: providers switch to a rotated
    secret gradually (Shopify takes up to an hour)."""

    # Read and written as ``secret`` (below), which encrypts: the database holds a token.
    encrypted_secret_fields = (("secret_encrypted", "legacy_plaintext"),)

    id = models.BigAutoField(primary_key=True)
    source = models.ForeignKey(Source, on_delete=models.CASCADE, related_name="secrets")
    # A Fernet token under SECRETS_ENCRYPTION_KEYS (deliveries/core/encryption.py); null only on
    # a row a release before encryption wrote, until migration 0007 or
    # rotate_encryption_keys encrypts it.
    secret_encrypted = models.TextField(null=True, blank=True)  # noqa: DJ001
    # The former plain-text column: blanked by migration 0007, never written since, kept
    # for a previous release's inserts until a later release drops it.
    legacy_plaintext = models.CharField(max_length=500, blank=True, default="", db_column="secret")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"secret {self.id} of {self.source_id}"

    @property
    def secret(self) -> str:
        return encryption.reveal(
            self.secret_encrypted, self.legacy_plaintext, row=f"source secret {self.pk}"
        )

    @secret.setter
    def secret(self, value: str) -> None:
        self.secret_encrypted = encryption.encrypt(value)
        self.legacy_plaintext = ""


class InboundState(models.TextChoices):
    PENDING = "pending"  # waiting for its processing job (or a retry's time)
    ENQUEUED = "enqueued"
    PROCESSING = "processing"  # leased by a worker
    PROCESSED = "processed"
    SKIPPED = "skipped"  # stale (older than what was applied) or no handler
    DEAD = "dead"  # handler failed on every attempt
    REJECTED = "rejected"  # authentic but unparseable: stored as evidence, never processed


SEQUENCED_INDEX = models.Index(
    fields=["source", "entity_id", "occurred_at", "received_at"],
    condition=Q(sequenced=True, state__in=["pending", "enqueued", "processing"]),
    name="inbound_sequenced",
)


class InboundEvent(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    # No index of its own: inbound_source_event and inbound_source_received both lead
    # with it, and each index costs a write on every received event.
    source = models.ForeignKey(
        Source, on_delete=models.CASCADE, related_name="events", db_index=False
    )
    # The provider's id, the dedupe key. For a rejected body it is a hash of the body.
    event_id = models.CharField(max_length=255)
    # The second dedupe key, for schemes that do not sign the event id (GitHub, Shopify,
    # an HMAC source whose id header is not in the signed template): SHA-256 of the
    # signed body, hex, so that a genuine body replayed under a fresh id is a duplicate.
    # Null for the others (their id cannot be changed without breaking the signature).
    body_sha256 = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001 (null: no key)
    event_type = models.CharField(max_length=200, blank=True)
    entity_id = models.CharField(max_length=300, blank=True)
    occurred_at = models.DateTimeField(null=True, blank=True)
    body = models.BinaryField()
    # A filtered copy: signature and auth headers left out.
    headers = models.JSONField(default=dict)
    state = models.CharField(
        max_length=16, choices=InboundState.choices, default=InboundState.PENDING
    )
    received_at = models.DateTimeField()
    duplicates = models.PositiveIntegerField(default=0)
    last_duplicate_at = models.DateTimeField(null=True, blank=True)
    next_attempt_at = models.DateTimeField()
    attempt_count = models.PositiveIntegerField(default=0)
    dispatch_count = models.PositiveIntegerField(default=0)
    enqueued_at = models.DateTimeField(null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    lease_token = models.UUIDField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    processed_at = models.DateTimeField(null=True, blank=True)
    # Runs only after every earlier one (by occurred_at, then received_at) of its source
    # and entity has finished: an email with an entity (ingest.worker, "Sequenced
    # events"). db_default: an older release still inserts events.
    sequenced = models.BooleanField(default=False, db_default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["source", "event_id"], name="inbound_source_event"),
            # The receive view's insert: a copy of a stored body is a duplicate, whatever
            # id it came with (ON CONFLICT DO NOTHING covers both keys).
            models.UniqueConstraint(
                fields=["source", "body_sha256"],
                condition=Q(body_sha256__isnull=False),
                name="inbound_source_body",
            ),
            models.CheckConstraint(
                condition=Q(state__in=InboundState.values), name="inbound_state_valid"
            ),
        ]
        indexes = [
            # The scheduler's claim of due work.
            models.Index(
                fields=["next_attempt_at"], condition=Q(state="pending"), name="inbound_due"
            ),
            # Lease expiry and lost dispatches.
            models.Index(
                fields=["state"],
                condition=Q(state__in=["enqueued", "processing"]),
                name="inbound_in_flight",
            ),
            # Admin: one source's newest first.
            models.Index(fields=["source", "-received_at"], name="inbound_source_received"),
            # TAKE_SEQUENCED: an entity's unfinished sequenced events in their order. Only
            # sequenced rows are in it, so storing and leasing webhooks never writes it.
            SEQUENCED_INDEX,
        ]

    def __str__(self) -> str:
        return f"{self.source_id}:{self.event_id}"


class InboundEmail(models.Model):
    """An inbound event that is an email: its envelope and what the receive path read
    of the message. The raw message is the event's body, kept under the events'
    retention. One per accepted recipient of a message (the event's type is that
    recipient's address without its plus tag, so each address's handlers run), written
    in the transaction that stores the event."""

    class Transport(models.TextChoices):
        SMTP = "smtp"
        MAILGUN = "mailgun"
        POSTMARK = "postmark"
        SENDGRID = "sendgrid"

    event = models.OneToOneField(
        InboundEvent, primary_key=True, on_delete=models.CASCADE, related_name="email"
    )
    transport = models.CharField(max_length=16, choices=Transport.choices)
    # The dedupe key's source: the Message-ID header (without its angle brackets).
    message_id = models.TextField(blank=True)
    # The envelope: MAIL FROM, the recipient this event is for, every accepted one.
    mail_from = models.CharField(max_length=320, blank=True)
    recipient = models.CharField(max_length=320)
    recipients = models.JSONField(default=list)
    # The message's own headers, decoded (empty for a message rejected before reading).
    from_address = models.CharField(max_length=320, blank=True)
    to = models.JSONField(default=list, blank=True)
    cc = models.JSONField(default=list, blank=True)
    subject = models.TextField(blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    size = models.PositiveIntegerField()
    # [{"filename", "content_type", "size"}]: what the checks read, not the bytes.
    attachments = models.JSONField(default=list, blank=True)
    # Recorded, not guessed: the provider's verdicts (spf, dkim, dmarc from its
    # Authentication-Results, "by" naming who wrote them) or the listener's own DKIM
    # check; {} when nobody checked.
    authentication = models.JSONField(default=dict, blank=True)
    # Where it came from: the SMTP peer (and whether TLS and AUTH were used) or the
    # provider's address.
    remote_addr = models.CharField(max_length=100, blank=True)
    tls = models.BooleanField(default=False)
    authenticated_as = models.CharField(max_length=200, blank=True)
    # Why the message was stored rejected (ingest.mail.REASONS), "" if accepted.
    rejected_reason = models.CharField(max_length=40, blank=True)
    received_at = models.DateTimeField()

    class Meta:
        indexes = [
            # The admin's list, newest first.
            models.Index(fields=["-received_at"], name="inbound_email_received"),
        ]
        permissions = [
            # Runs the handlers of stored mail again: more than looking at it.
            ("reprocess_inboundemail", "Can process inbound emails again"),
        ]

    def __str__(self) -> str:
        return f"{self.subject[:60] or '(no subject)'} to {self.recipient}"


class HandlerRun(models.Model):
    """One run of one handler on one inbound event, append-only."""

    class Outcome(models.TextChoices):
        OK = "ok"
        ERROR = "error"
        STALE = "stale"  # skipped: older than the last event applied to the entity
        NO_HANDLER = "no_handler"

    id = models.BigAutoField(primary_key=True)
    event = models.ForeignKey(InboundEvent, on_delete=models.CASCADE, related_name="runs")
    handler = models.CharField(max_length=300)
    attempt = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.FloatField()
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    error = models.TextField(blank=True)

    def __str__(self) -> str:
        return f"{self.handler} {self.outcome}"


class EntityVersion(models.Model):
    """The event time of the last event applied to an entity: an older event arriving
    later is stale. Keyed by source and entity id."""

    key = models.CharField(max_length=400, primary_key=True)
    applied_at = models.DateTimeField()
    event = models.ForeignKey(InboundEvent, null=True, on_delete=models.SET_NULL, related_name="+")

    def __str__(self) -> str:
        return self.key


class VerificationFailure(models.Model):
    """Counts of refused requests per source and reason, so a broken secret rotation
    shows up as a spike. One row per (source, reason); ``sample`` keeps the latest
    request's non-secret details."""

    id = models.BigAutoField(primary_key=True)
    source = models.ForeignKey(Source, on_delete=models.CASCADE, related_name="failures")
    reason = models.CharField(max_length=40)
    count = models.PositiveBigIntegerField(default=0)
    first_at = models.DateTimeField()
    last_at = models.DateTimeField()
    sample = models.JSONField(default=dict, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["source", "reason"], name="failure_source_reason"),
        ]

    def __str__(self) -> str:
        return f"{self.source_id} {self.reason} x{self.count}"


# --- Polling and backfill -------------------------------------------------------------


class PollSource(models.Model):
    """A provider without webhooks, read by polling its list of changed records.

    Its records are stored as inbound events of ``source`` (a :class:`Source` with the
    ``poll`` scheme, so nothing posted to its webhook URL is accepted), which gives them
    the webhooks' dedupe, handlers and entity locks. ``tenant`` is the customer whose
    provider account this is (their backfill runs show in the REST API); empty for the
    operator's own integrations, seen by staff only.

    The cursor is over the provider's data, never our clock: ``cursor_at`` is the highest
    ``updated_at`` stored, ``cursor_ids`` the ids already stored at exactly that time."""

    class Adapter(models.TextChoices):
        HTTP_JSON = "http_json"

    encrypted_secret_fields = (("auth_secret_encrypted", "legacy_auth_secret"),)

    id = models.BigAutoField(primary_key=True)
    source = models.OneToOneField(Source, on_delete=models.CASCADE, related_name="poll")
    tenant = models.ForeignKey(
        "deliveries.Tenant",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="poll_sources",
    )
    adapter = models.CharField(max_length=20, choices=Adapter.choices, default=Adapter.HTTP_JSON)
    # The adapter's settings (URL, query parameter names, response paths…); no secrets.
    config = models.JSONField(default=dict)
    # The value of the adapter's auth header ("" : none), read and written as
    # ``auth_secret`` (below): a Fernet token, like SourceSecret's. Write-only in the
    # admin, never logged.
    auth_secret_encrypted = models.TextField(null=True, blank=True)  # noqa: DJ001
    # The former plain-text column, as SourceSecret.legacy_plaintext.
    legacy_auth_secret = models.CharField(
        max_length=2000, blank=True, default="", db_column="auth_secret"
    )
    enabled = models.BooleanField(default=True)
    every_minutes = models.PositiveIntegerField(default=5, help_text="The schedule's interval.")
    cursor_at = models.DateTimeField(null=True, blank=True)
    cursor_ids = models.JSONField(default=list, blank=True)
    last_poll_at = models.DateTimeField(null=True, blank=True)
    last_poll_counts = models.JSONField(default=dict, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        permissions = [("poll_pollsource", "Can poll a source now from the console")]

    def __str__(self) -> str:
        return self.source.slug

    @property
    def auth_secret(self) -> str:
        return encryption.reveal(
            self.auth_secret_encrypted, self.legacy_auth_secret, row=f"poll source {self.pk}"
        )

    @auth_secret.setter
    def auth_secret(self, value: str) -> None:
        self.auth_secret_encrypted = encryption.encrypt(value)
        self.legacy_auth_secret = ""


class BackfillState(models.TextChoices):
    RUNNING = "running"  # or killed: a stale heartbeat with the lease expired says so
    INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM; resumable
    FAILED = "failed"  # the provider kept failing; resumable
    COMPLETED = "completed"


class BackfillRun(models.Model):
    """One backfill of a window of a poll source's history: what was asked, who asked,
    where it stands (the checkpoint, written with every page's events) and what it did."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    source = models.ForeignKey(PollSource, on_delete=models.CASCADE, related_name="backfills")
    state = models.CharField(
        max_length=16, choices=BackfillState.choices, default=BackfillState.RUNNING
    )
    since = models.DateTimeField()
    # Exclusive; defaults to when the run was created, so the window is fixed.
    until = models.DateTimeField()
    rate = models.FloatField(help_text="Requests per second at most.")
    page_size = models.PositiveIntegerField()
    started_by = models.CharField(max_length=200)
    created_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The same shape as a poll source's cursor: resume lists from checkpoint_at (>=) and
    # skips checkpoint_ids.
    checkpoint_at = models.DateTimeField(null=True, blank=True)
    checkpoint_ids = models.JSONField(default=list, blank=True)
    pages = models.PositiveBigIntegerField(default=0)
    requests = models.PositiveBigIntegerField(default=0)
    processed = models.PositiveBigIntegerField(default=0, help_text="Records read in the window.")
    stored = models.PositiveBigIntegerField(default=0, help_text="New inbound events.")
    duplicates = models.PositiveBigIntegerField(default=0, help_text="Already stored.")
    # Seconds spent running, over all resumptions: the denominator of the rates.
    active_seconds = models.FloatField(default=0.0)
    resumes = models.PositiveIntegerField(default=0)
    # Records in the window if the provider says (its total), for the ETA.
    total = models.PositiveBigIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=BackfillState.values), name="backfill_state_valid"
            ),
        ]
        indexes = [
            # The admin's and the API's newest-first lists.
            models.Index(fields=["-created_at"], name="backfill_created"),
        ]
        permissions = [
            # Starting runs a program against the provider for hours: more than a row.
            ("start_backfillrun", "Can start and resume a backfill from the console"),
        ]

    def __str__(self) -> str:
        return f"backfill {self.id} of {self.source_id}"
