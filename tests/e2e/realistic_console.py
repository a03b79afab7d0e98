"""A console with what an operator meets: hundreds of deliveries over several tenants and
endpoints, through the real scheduler, relay and workers to a real local receiver that
answers 200, 503 (retried, then dead), 400, 410 and too late (ambiguous); a paused
endpoint holding its deliveries; retries waiting; dead letters; signed inbound events,
duplicates and refusals; a poll source with a completed backfill; background jobs, done
and dead; loops beating; and the audit rows the actions wrote."""

import json
import random
from dataclasses import dataclass
from datetime import timedelta

from django.test import Client
from django.utils import timezone

from deliveries import services
from deliveries.jobs.background import enqueue
from deliveries.jobs.loop import save_run, start_run
from deliveries.jobs.models import Job
from deliveries.models import Delivery, Endpoint, EventType, Tenant
from ingest.backfill import backfill_run_create, backfill_run_execute
from ingest.poll_sources import poll_source_create
from ingest.schemes import get_scheme
from ingest.sources import source_create
from tests.conftest import drain
from tests.receiver import Receiver, always, fail_first

INBOUND_SECRET = "whsec_" + "c2hvcC1zZWNyZXQtZm9yLXRlc3Rz"
EVENT_TYPES = {
    # name: (owner, replay-safe)
    "invoice.paid": ("billing", False),
    "invoice.voided": ("billing", True),
    "user.created": ("identity", True),
    "order.shipped": ("fulfilment", True),
    "subscription.renewed": ("billing", True),
}


@dataclass
class Console:
    tenants: dict[str, Tenant]
    endpoints: dict[str, Endpoint]
    deliveries: int


def build(receiver: Receiver, provider, settings, *, events: int = 240) -> Console:
    rng = random.Random(40)
    for name, (owner, safe) in EVENT_TYPES.items():
        EventType.objects.create(name=name, owner=owner, replay_safe=safe)
    tenants = {n: Tenant.objects.create(name=n) for n in ("acme", "globex", "initech")}
    receiver.behaviours.update(
        {
            "/ok": always(200),
            "/flaky": fail_first(1, 503),
            "/down": always(503, body=b'{"error":"maintenance"}'),
            "/refuse": always(400, body=b'{"error":"unknown customer"}'),
            "/gone": always(410),
            "/late": always(200),
            "/held": always(200),
            "/ok2": always(200),
        }
    )
    receiver.delays["/late"] = 0.4  # past the endpoint's timeout: ambiguous
    plan = {
        # name: (tenant, path, event types, options)
        "acme-ok": ("acme", "/ok", [], {}),
        "acme-flaky": ("acme", "/flaky", ["invoice.paid", "invoice.voided"], {}),
        "acme-down": ("acme", "/down", ["order.shipped"], {}),
        "globex-refuse": ("globex", "/refuse", ["user.created"], {}),
        "globex-gone": ("globex", "/gone", ["subscription.renewed"], {}),
        "globex-late": ("globex", "/late", ["invoice.paid"], {"timeout": 0.15}),
        "initech-held": ("initech", "/held", [], {}),
        "initech-ok": ("initech", "/ok2", [], {}),
    }
    endpoints = {}
    for name, (tenant, path, types, options) in plan.items():
        endpoints[name], _ = services.endpoint_create(
            tenant=tenants[tenant],
            url=receiver.url(path) + f"?customer={tenant}",
            event_types=types,
            description=name,
            **options,
        )
    services.endpoint_pause(
        endpoint=endpoints["initech-held"], reason="receiver being redeployed", via="admin"
    )

    # Retries at once, so that the drain reaches the dead letters in seconds.
    settings.DELIVERY_RETRY_SCHEDULE = [0, 0]
    for i in range(events):
        tenant = rng.choice(list(tenants.values()))
        event_type = rng.choice(list(EVENT_TYPES))
        services.publish_event(
            tenant=tenant,
            event_type=event_type,
            payload={"id": f"obj_{i}", "amount": rng.randint(100, 99_999), "currency": "EUR"},
            entity_id=f"{event_type.split('.')[0]}:{i % 37}",
        )
    drain()
    # Retries now wait an hour: these stay pending, waiting by policy.
    settings.DELIVERY_RETRY_SCHEDULE = [3600]
    for i in range(12):
        services.publish_event(
            tenant=tenants["acme"], event_type="order.shipped", payload={"id": f"late_{i}"}
        )
    drain()
    dead = list(Delivery.objects.filter(state="dead").values_list("id", flat=True)[:3])
    services.delivery_replay(delivery_ids=dead, via="admin")  # audited, then dead again
    drain()

    _inbound()
    _backfill(provider)
    _jobs(tenants["acme"])
    _schedules()
    for kind in ("scheduler", "relay", "workers"):
        save_run(start_run(kind), ticks=120, counts={"enqueued": 40, "lease_expired": 0})
    return Console(tenants, endpoints, Delivery.objects.count())


def _inbound() -> None:
    """Signed events posted to the real receive view: stored, duplicated, refused."""
    source_create(slug="shop", scheme="standard", secrets=[INBOUND_SECRET])
    scheme = get_scheme("standard")
    client = Client()

    def post(body: bytes, *, event_id: str, secret: str = INBOUND_SECRET) -> int:
        signed = scheme.sign(body=body, secret=secret, event_id=event_id)
        signed.pop("content-type", None)
        headers = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in signed.items()}
        return client.post(
            "/ingest/shop/",
            body,
            content_type="application/json",
            HTTP_X_SHOP_DOMAIN="acme.example",
            **headers,
        ).status_code

    for i in range(25):
        body = json.dumps(
            {
                "type": "order.created",
                "order": {"id": i, "email": f"buyer{i}@example.com", "total": "42.00"},
                "customer": {"password": "hunter2", "card_number": "4242424242424242"},
            }
        ).encode()
        assert post(body, event_id=f"msg_{i}") == 200
        if i % 10 == 0:
            assert post(body, event_id=f"msg_{i}") == 200  # a duplicate
    for i in range(3):
        assert post(b'{"type":"forged"}', event_id=f"evil_{i}", secret="whsec_d3Jvbmc=") == 401
    drain()


def _backfill(provider) -> None:
    poll_source_create(
        slug="crm",
        config=provider.config(page_size=50),
        auth_secret="Bearer crm-token-0123456789",
        schedule=False,
    )
    now = timezone.now()
    run = backfill_run_create(
        slug="crm", since=now - timedelta(days=3650), until=now, rate=1000, started_by="ops"
    )
    backfill_run_execute(run_id=run.id)


def _schedules() -> None:
    """django-q2's schedules, and a task that ran and one that failed."""
    from django_q.models import Task

    from deliveries.schedules import install_schedules

    install_schedules()
    now = timezone.now()
    for success in (True, False):
        Task.objects.create(
            id=f"task-{success}",
            name=f"prune-{'ok' if success else 'failed'}",
            func="deliveries.schedules.prune_pass",
            started=now - timedelta(seconds=3),
            stopped=now - timedelta(seconds=1.7),
            success=success,
            result={"deliveries": 0} if success else "Traceback: OperationalError",
        )


def _jobs(tenant) -> None:
    from tests.deliveries.jobs import sample_jobs  # noqa: F401  (registers the test types)

    for i in range(5):
        enqueue("test.noop", {"label": f"nightly-{i}"}, tenant=tenant)
    now = timezone.now()
    Job.objects.create(
        type="test.noop",
        state="dead",
        tenant_id=tenant.id,
        payload={"label": "export"},
        run_at=now,
        created_at=now - timedelta(minutes=7),
        started_at=now - timedelta(minutes=6),
        finished_at=now - timedelta(minutes=5),
        attempts=5,
        dead_reason="attempts exhausted (5): TimeoutError",
    )
