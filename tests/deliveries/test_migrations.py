"""Data steps of migrations, run on rows the current models write."""

import importlib
import uuid
from datetime import timedelta

import pytest
from django.apps import apps
from django.db import connection
from django.utils import timezone

from deliveries import services
from deliveries.models import Attempt, Delivery, DeliveryListing, Tenant

pytestmark = pytest.mark.django_db

attempt_endpoint = importlib.import_module("deliveries.migrations.0012_attempt_endpoint")


def test_0012_fills_in_the_endpoint_of_the_last_24_hours_of_attempts(monkeypatch):
    monkeypatch.setattr(attempt_endpoint, "BATCH", 2)  # several batches
    tenant = Tenant.objects.create(name="acme")
    a, _ = services.endpoint_create(tenant=tenant, url="https://a.example/hook")
    b, _ = services.endpoint_create(tenant=tenant, url="https://b.example/hook")
    services.publish_event(tenant=tenant, event_type="x.y", payload={})
    now = timezone.now()
    for delivery in Delivery.objects.all():
        for number, age in enumerate([1, 5, 23, 25], start=1):
            Attempt.objects.create(
                delivery=delivery,
                number=number,
                started_at=now - timedelta(hours=age),
                duration_ms=1,
                outcome="retry",
            )

    with connection.schema_editor(atomic=False) as editor:
        attempt_endpoint.fill_recent(apps, editor)

    filled = {
        (e, n)
        for e, n in Attempt.objects.filter(endpoint__isnull=False).values_list(
            "endpoint_id", "number"
        )
    }
    assert filled == {(a.id, 1), (a.id, 2), (a.id, 3), (b.id, 1), (b.id, 2), (b.id, 3)}
    assert Attempt.objects.filter(endpoint__isnull=True).count() == 2  # the 25-hour-old
    for attempt in Attempt.objects.filter(endpoint__isnull=False).select_related("delivery"):
        assert attempt.endpoint_id == attempt.delivery.endpoint_id


def test_stored_bodies_are_compressed_with_lz4_and_read_back_whole(tenant):
    # deliveries 0014 and ingest 0004: a body over the TOAST threshold is compressed
    # with lz4 (cheaper to store and to read than pglz), and reads back byte for byte.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT attrelid::regclass::text, attcompression FROM pg_attribute"
            " WHERE attname = 'body' AND attrelid IN"
            " ('deliveries_event'::regclass, 'ingest_inboundevent'::regclass)"
        )
        assert dict(cursor.fetchall()) == {"deliveries_event": "l", "ingest_inboundevent": "l"}
    payload = {"lines": [{"sku": f"SKU-{i:06d}", "qty": i % 7} for i in range(2000)]}
    event = services.publish_event(tenant=tenant, event_type="t", payload=payload)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_column_compression(body), body FROM deliveries_event WHERE id = %s",
            [event.id],
        )
        method, body = cursor.fetchone()
    assert method == "lz4"
    assert bytes(body) == services.encode_payload(payload)


delivery_listing = importlib.import_module("deliveries.migrations.0016_delivery_listing")


def test_0016_lists_the_deliveries_written_before_it_and_skips_those_listed(monkeypatch):
    monkeypatch.setattr(delivery_listing, "BATCH", 2)  # several batches
    tenant = Tenant.objects.create(name="acme")
    for url in ("https://a.example/hook", "https://b.example/hook"):
        services.endpoint_create(tenant=tenant, url=url)
    for _ in range(3):
        services.publish_event(tenant=tenant, event_type="x.y", payload={})
    listed = set(DeliveryListing.objects.values_list("delivery_id", flat=True))
    # As if written before the table: three deliveries not listed.
    DeliveryListing.objects.filter(delivery_id__in=sorted(listed)[1:4]).delete()

    with connection.schema_editor(atomic=False) as editor:
        delivery_listing.fill(apps, editor)

    rows = DeliveryListing.objects.values_list("delivery_id", "tenant_id", "endpoint_id")
    expected = Delivery.objects.values_list("id", "tenant_id", "endpoint_id")
    assert sorted(rows) == sorted(expected) and len(rows) == 6
    for listing in DeliveryListing.objects.select_related("delivery"):
        assert listing.created_at == listing.delivery.created_at


def test_every_delivery_inserted_is_listed_whoever_inserts_it(tenant):
    """The trigger, not the publish path, writes the listing: a raw INSERT (a previous
    release's publish, a bulk load) is listed too, in the same statement."""
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://a.example/hook")
    event = services.publish_event(tenant=tenant, event_type="x.y", payload={}, endpoint_ids=[])
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO deliveries_delivery (id, event_id, endpoint_id, tenant_id, state,"
            " priority, next_attempt_at, attempt_count, policy_attempts, dispatch_count,"
            " lease_expiries, last_outcome, last_error, created_at, updated_at)"
            " VALUES (gen_random_uuid(), %s, %s, %s, 'pending', 0, now(), 0, 0, 0, 0, '', '',"
            " now(), now()) RETURNING id",
            [event.id, endpoint.id, tenant.id],
        )
        [delivery_id] = cursor.fetchone()

    listing = DeliveryListing.objects.get()
    assert (listing.delivery_id, listing.tenant_id, listing.endpoint_id) == (
        delivery_id,
        tenant.id,
        endpoint.id,
    )
    # And a delivery deleted without Django's collector takes its listing row with it.
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM deliveries_delivery WHERE id = %s", [delivery_id])
    assert not DeliveryListing.objects.exists()


def state_after(app: str, migration: str):
    """The models as the migration ``app.migration`` saw them."""
    from django.db.migrations.loader import MigrationLoader

    return MigrationLoader(connection).project_state((app, migration)).apps


tasks_queue = importlib.import_module("deliveries.migrations.0021_looprun_poll_and_tasks_queue")


def test_0021_moves_django_q2_tasks_out_of_the_pipelines_queue_and_keeps_its_messages(settings):
    from django_q.signing import SignedPackage

    from deliveries.jobs.brokers import Message
    from deliveries.jobs.brokers.database import DatabaseBroker
    from deliveries.jobs.models import QueueMessage

    pipeline = DatabaseBroker(list_key=settings.QUEUE_NAME)
    delivery = Message(uuid.uuid4(), 1).encode()
    future = '{"v": 99, "d": "x", "n": 1}'  # a newer release's: still the pipeline's
    task = SignedPackage.dumps({"id": "t", "func": "deliveries.tasks.alerts_pass"})
    pipeline.enqueue_many([delivery, future, task], priorities=[0, 0, 0])

    with connection.schema_editor() as editor:
        tasks_queue.move_tasks(
            state_after("deliveries", "0021_looprun_poll_and_tasks_queue"), editor
        )

    queues = dict(QueueMessage.objects.values_list("payload", "queue"))
    assert queues == {
        delivery: settings.QUEUE_NAME,
        future: settings.QUEUE_NAME,
        task: settings.Q_CLUSTER["name"],
    }


job_models_move = importlib.import_module("deliveries.jobs.migrations.0001_initial")


def test_the_job_models_content_types_and_their_permissions_follow_them():
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType

    # As before the move: the content type (and a permission granted on it) is deliveries'.
    ContentType.objects.filter(app_label="trusty_jobs", model="entitylock").delete()
    old = ContentType.objects.create(app_label="deliveries", model="entitylock")
    granted = Permission.objects.create(
        content_type=old, codename="view_entitylock", name="Can view entity lock"
    )
    # A content type the new label has already is left alone, and so is the old one.
    kept = ContentType.objects.create(app_label="deliveries", model="looprun")

    with connection.schema_editor() as editor:
        job_models_move.content_types_follow(state_after("trusty_jobs", "0001_initial"), editor)

    old.refresh_from_db()
    assert old.app_label == "trusty_jobs"
    assert Permission.objects.get(id=granted.id).content_type_id == old.id
    assert ContentType.objects.filter(id=kept.id, app_label="deliveries").exists()
    assert ContentType.objects.filter(app_label="trusty_jobs", model="looprun").count() == 1


schedules_deliveries = importlib.import_module("deliveries.migrations.0026_schedules_module")
schedules_ingest = importlib.import_module("ingest.migrations.0009_schedules_module")


def test_schedule_rows_follow_their_units_to_the_schedules_modules_and_back():
    from django.utils.module_loading import import_string
    from django_q.models import Schedule

    old = {
        "webhooks: scheduler": "deliveries.tasks.scheduler_pass",
        "poll:crm": "ingest.tasks.poll_pass",
        "other": "myapp.tasks.report",
    }
    for name, func in old.items():
        Schedule.objects.create(name=name, func=func, schedule_type=Schedule.MINUTES, minutes=1)

    schedules_deliveries.forwards(apps, None)
    schedules_ingest.forwards(apps, None)
    funcs = dict(Schedule.objects.values_list("name", "func"))
    assert funcs == {
        "webhooks: scheduler": "deliveries.schedules.scheduler_pass",
        "poll:crm": "ingest.schedules.poll_pass",
        "other": "myapp.tasks.report",
    }
    assert all(callable(import_string(f)) for n, f in funcs.items() if n != "other")

    schedules_ingest.backwards(apps, None)
    schedules_deliveries.backwards(apps, None)
    assert dict(Schedule.objects.values_list("name", "func")) == old
