"""Pausing an endpoint: ``paused_at`` and ``paused_reason``, the partial index admission
reads the paused endpoints by (endpoint_paused), and the permission to pause and resume.

Expand only. ``paused_reason`` has a database default, so a previous release still
inserts endpoints; ``paused_at`` is nullable, and a previous release ignores both (it
would send a paused endpoint's deliveries, which is what it always did). On PostgreSQL
the index is built CONCURRENTLY (a non-atomic migration)."""

from django.db import migrations, models
from django.db.models import Q

from deliveries.core.sql import add_index_concurrently

INDEX = models.Index(fields=["id"], condition=Q(paused_at__isnull=False), name="endpoint_paused")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("deliveries", "0026_schedules_module")]

    operations = [
        migrations.AlterModelOptions(
            name="endpoint",
            options={
                "permissions": [
                    (
                        "rotate_secret",
                        "Can rotate an endpoint's signing secret and see the new one",
                    ),
                    ("pause_endpoint", "Can pause and resume an endpoint's deliveries"),
                ]
            },
        ),
        migrations.AddField(
            model_name="endpoint",
            name="paused_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="endpoint",
            name="paused_reason",
            field=models.CharField(blank=True, db_default="", default="", max_length=200),
        ),
        add_index_concurrently("deliveries", "Endpoint", INDEX),
    ]
