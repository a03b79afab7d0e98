"""Attempts carry their delivery's endpoint, so that the admin endpoint list's 24-hour
health reads attempt_endpoint_started alone instead of joining every recent attempt to
its delivery (323 ms at 1,000,000 deliveries, over the pages' 200 ms budget).

Expand only, written for a large, busy attempt table (docs/compatibility.md): a nullable
column; on PostgreSQL the new index is built and the old one dropped CONCURRENTLY, so
writes go on meanwhile (hence a non-atomic migration); the attempts of the last 24 hours
(all the health reads) are filled in from their deliveries in batches of 5,000 before
attempt_started, which that filter uses, is dropped. Older attempts keep a null
endpoint. A release that predates this one writes attempts without it: those count in
no endpoint's health."""

from datetime import timedelta

import django.db.models.deletion
from django.db import migrations, models
from django.db.models import OuterRef, Subquery
from django.utils import timezone

NEW = models.Index(fields=["endpoint", "started_at"], name="attempt_endpoint_started")
OLD = models.Index(fields=["started_at"], name="attempt_started")
BATCH = 5000


def _concurrently(schema_editor) -> bool:
    return schema_editor.connection.vendor == "postgresql"


def create_new(apps, schema_editor):
    if _concurrently(schema_editor):
        schema_editor.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS attempt_endpoint_started"
            " ON deliveries_attempt (endpoint_id, started_at)"
        )
    else:
        schema_editor.add_index(apps.get_model("deliveries", "Attempt"), NEW)


def drop_new(apps, schema_editor):
    if _concurrently(schema_editor):
        schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS attempt_endpoint_started")
    else:
        schema_editor.remove_index(apps.get_model("deliveries", "Attempt"), NEW)


def fill_recent(apps, schema_editor):
    Attempt = apps.get_model("deliveries", "Attempt")
    Delivery = apps.get_model("deliveries", "Delivery")
    since = timezone.now() - timedelta(hours=24)
    endpoint = Subquery(
        Delivery.objects.filter(id=OuterRef("delivery_id")).values("endpoint_id")[:1]
    )
    while True:
        ids = list(
            Attempt.objects.filter(started_at__gte=since, endpoint__isnull=True).values_list(
                "id", flat=True
            )[:BATCH]
        )
        if not ids:
            return
        Attempt.objects.filter(id__in=ids).update(endpoint_id=endpoint)


def drop_old(apps, schema_editor):
    if _concurrently(schema_editor):
        schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS attempt_started")
    else:
        schema_editor.remove_index(apps.get_model("deliveries", "Attempt"), OLD)


def create_old(apps, schema_editor):
    if _concurrently(schema_editor):
        schema_editor.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS attempt_started"
            " ON deliveries_attempt (started_at)"
        )
    else:
        schema_editor.add_index(apps.get_model("deliveries", "Attempt"), OLD)


class Migration(migrations.Migration):
    atomic = False  # CREATE/DROP INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("deliveries", "0011_outbox_drop_like_index")]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="endpoint",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to="deliveries.endpoint",
            ),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="attempt", index=NEW)],
            database_operations=[migrations.RunPython(create_new, drop_new, elidable=False)],
        ),
        migrations.RunPython(fill_recent, migrations.RunPython.noop, elidable=True),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.RemoveIndex(model_name="attempt", name="attempt_started")],
            database_operations=[migrations.RunPython(drop_old, create_old, elidable=False)],
        ),
    ]
