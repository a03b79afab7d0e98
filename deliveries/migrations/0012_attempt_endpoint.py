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


def _create(index: models.Index, columns: str):
    def create(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(
                f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {index.name}"
                f" ON deliveries_attempt ({columns})"
            )
        else:
            schema_editor.add_index(apps.get_model("deliveries", "Attempt"), index)

    return create


def _drop(index: models.Index):
    def drop(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {index.name}")
        else:
            schema_editor.remove_index(apps.get_model("deliveries", "Attempt"), index)

    return drop


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
            database_operations=[migrations.RunPython(
                    _create(NEW, "endpoint_id, started_at"), _drop(NEW), elidable=False
                )],
        ),
        migrations.RunPython(fill_recent, migrations.RunPython.noop, elidable=True),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.RemoveIndex(model_name="attempt", name="attempt_started")],
            database_operations=[migrations.RunPython(
                    _drop(OLD), _create(OLD, "started_at"), elidable=False
                )],
        ),
    ]
