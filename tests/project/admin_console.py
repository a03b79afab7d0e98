"""What the admin-wide tests share: a row for every model the admin shows, the secrets
among them, and the admin's pages and actions, discovered from ``admin.site``."""

import re
from dataclasses import dataclass, field
from datetime import timedelta

from django.contrib import admin
from django.contrib.auth.models import Group, Permission, User
from django.db import connection
from django.test import Client, RequestFactory
from django.urls import URLPattern, reverse
from django.utils import timezone
from django_q.models import OrmQ, Task

from deliveries import services
from deliveries.core.ids import uuid7
from deliveries.jobs.models import Job, JobRun, LoopRun, RecurringJob
from deliveries.models import (
    ApiKey,
    Attempt,
    Delivery,
    EgressAllowance,
    EndpointSecret,
    EventType,
    OperationalEvent,
    Tenant,
)
from deliveries.schedules import install_schedules
from ingest.backfill import backfill_run_create
from ingest.models import HandlerRun, InboundEvent, PollSource, SourceSecret
from ingest.poll_sources import poll_source_create
from ingest.receiving import NewEvent, email_receive, inbound_store_many
from ingest.schemes import MailPost
from ingest.sources import count_refusal, source_create

# Every admin registers these five views; anything else in get_urls() is a custom page.
STANDARD_VIEWS = {"changelist", "add", "history", "delete", "change"}
# What a response must never carry, whatever the key or secret: a whole signing secret
# or a whole API key (the 12-character prefix alone is how keys are told apart).
SECRET_SHAPES = re.compile(rb"whsec_[A-Za-z0-9+/=]{16,}|whk_[A-Za-z0-9_-]{20,}")


@dataclass
class Console:
    secrets: set[str] = field(default_factory=set)


def console_data() -> Console:
    """At least one row of every model registered in the admin, so that every action has
    something to act on and every change page something to show."""
    now = timezone.now()
    console = Console()
    tenant = Tenant.objects.create(name="acme")
    endpoint, secret = services.endpoint_create(tenant=tenant, url="https://example.com/hook")
    console.secrets.add(secret)
    _, key = services.api_key_create(tenant=tenant, name="ci")
    console.secrets.add(key)
    EgressAllowance.objects.create(tenant=tenant, network="10.20.0.0/16", note="their VPN")
    EventType.objects.create(name="invoice.paid", owner="billing", replay_safe=True)
    EventType.objects.create(name="payment.requested", owner="billing")
    for event_type in ("invoice.paid", "payment.requested", "user.created"):
        services.publish_event(tenant=tenant, event_type=event_type, payload={"t": event_type})
    Delivery.objects.update(
        state="dead", last_outcome="permanent", last_status_code=400, finished_at=now
    )
    for delivery in Delivery.objects.all():
        Attempt.objects.create(
            delivery=delivery,
            endpoint=endpoint,
            number=1,
            started_at=now,
            duration_ms=12.0,
            status_code=400,
            outcome="permanent",
            request_headers={"webhook-timestamp": "1", "authorization": "[redacted]"},
        )
    LoopRun.objects.create(kind="scheduler", host="h", pid=1, started_at=now, heartbeat_at=now)
    for state in ("dead", "pending"):
        job = Job.objects.create(
            id=uuid7(),
            type="billing.sync_invoice",
            state=state,
            tenant_id=tenant.id,
            payload={"invoice_id": 42},
            run_at=now,
            created_at=now,
            started_at=now,
            attempts=1,
            progress_done=5,
            progress_total=10,
            progress_updated_at=now,
            dead_reason="attempts exhausted (1): boom" if state == "dead" else "",
        )
    JobRun.objects.create(
        job=job, attempt=1, started_at=now, duration_ms=3.0, outcome="error", error="Traceback"
    )
    RecurringJob.objects.create(
        name="nightly-sync", job_type="billing.sync_invoice", cron="0 3 * * *", next_tick_at=now
    )
    OperationalEvent.objects.create(
        kind="dead_letters", key="all", summary="3 dead", first_seen_at=now, last_seen_at=now
    )
    services.audit(actor=None, action="console.seed", target="tenant", count=1)

    source = source_create(slug="shop", scheme="standard", secrets=["whsec_" + "c2VjcmV0" * 4])
    console.secrets.add("whsec_" + "c2VjcmV0" * 4)
    count_refusal(source, "bad_signature", remote="192.0.2.1")
    inbound_store_many(
        source=source,
        events=[NewEvent("evt_1", "order.created", "order_1", now, b'{"id": "order_1"}')],
    )
    HandlerRun.objects.create(
        event=InboundEvent.objects.get(source=source),
        handler="h",
        attempt=1,
        started_at=now,
        duration_ms=1.0,
        outcome="error",
        error="boom",
    )
    mailbox = source_create(
        slug="mail",
        scheme="smtp",
        secrets=["relay:smtp-credential-0123456789"],
        options={"addresses": ["support@example.com"]},
    )
    console.secrets.add("relay:smtp-credential-0123456789")
    for subject in ("Printer on fire", "=?utf-8?q?x=0D=0ABcc=3A_y?="):  # one accepted, one rejected
        email_receive(
            source=mailbox,
            post=MailPost(
                raw=(
                    f"From: ann@example.org\r\nTo: support+t-1@example.com\r\n"
                    f"Subject: {subject}\r\nMessage-ID: <{len(subject)}@example.org>\r\n\r\nhi\r\n"
                ).encode(),
                recipients=("support+t-1@example.com",),
                mail_from="ann@example.org",
            ),
            transport="smtp",
        )
    poll_source_create(
        slug="crm",
        config={"url": "https://crm.example.com/records"},
        auth_secret="Bearer poll-credential-0123456789",
    )
    console.secrets.add("Bearer poll-credential-0123456789")
    backfill_run_create(slug="crm", since=now - timedelta(days=1), until=now, rate=10)

    install_schedules()
    for success in (True, False):
        Task.objects.create(
            id=f"task{int(success)}",
            name=f"task-{success}",
            func="deliveries.schedules.prune_pass",
            started=now,
            stopped=now,
            success=success,
            result=None,
        )
    if OrmQ in admin.site._registry:
        OrmQ.objects.create(key="webhooks", payload="x", lock=now)
    Group.objects.create(name="operators").permissions.set(Permission.objects.all()[:3])
    # Stored encrypted: the clear values are what a page must never show.
    console.secrets.update(s.secret for s in EndpointSecret.objects.all())
    console.secrets.update(s.secret for s in SourceSecret.objects.all())
    console.secrets.update(p.auth_secret for p in PollSource.objects.all())
    console.secrets.update(ApiKey.objects.values_list("key_hash", flat=True))
    return console


def add_user_secrets(console: Console) -> None:
    """The users' password hashes (only the hash part: the algorithm's name is public)."""
    hashes = User.objects.values_list("password", flat=True)
    console.secrets.update(p.rsplit("$", 1)[-1] for p in hashes)


def leaks(body: bytes, console: Console) -> list[str]:
    found = [s[:12] + "…" for s in console.secrets if s and s.encode() in body]
    return found + [m.decode()[:12] + "…" for m in SECRET_SHAPES.findall(body)]


def staff_client(name: str, permissions) -> Client:
    user = User.objects.create_user(name, password="pw-" + name, is_staff=True)
    user.user_permissions.set(permissions)
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client


def superuser_client() -> tuple[Client, User]:
    user = User.objects.create_superuser("root", password="pw-root")
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client, user


def superuser_request(user: User):
    request = RequestFactory().get("/admin/")
    request.user = user
    return request


def registered():
    """Every registered ModelAdmin, the project's and the third-party ones."""
    return sorted(admin.site._registry.items(), key=lambda item: item[0]._meta.label)


def first_object(model_admin, request):
    return model_admin.get_queryset(request).order_by("pk").first()


def admin_url(model, view: str, *args) -> str:
    opts = model._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_{view}", args=args)


def custom_urls(model_admin, obj) -> list[str]:
    """The admin's own pages (what get_urls() adds to the standard five), each with its
    path arguments filled in from ``obj``."""
    opts = model_admin.model._meta
    prefix = f"{opts.app_label}_{opts.model_name}_"
    urls = []
    for pattern in model_admin.get_urls():
        if not isinstance(pattern, URLPattern) or not pattern.name:
            continue
        if pattern.name.removeprefix(prefix) in STANDARD_VIEWS:
            continue
        arguments = {name: obj.pk for name in pattern.pattern.converters}
        urls.append(reverse(f"admin:{pattern.name}", kwargs=arguments))
    return urls


def database_fingerprint() -> dict[str, str]:
    """A digest of every table's rows but the sessions' (a login writes one)."""
    digests = {}
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            if table == "django_session":
                continue
            cursor.execute(
                f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) "
                f'FROM "{table}" t'
            )
            digests[table] = cursor.fetchone()[0]
    return digests
