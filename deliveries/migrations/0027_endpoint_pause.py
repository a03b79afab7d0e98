"""Pausing an endpoint: ``paused_at`` and ``paused_reason``, the partial index admission
reads the paused endpoints by (endpoint_paused), and the permission to pause and resume.

Expand only. ``paused_reason`` has a database default, so a previous release still
inserts endpoints; ``paused_at`` is nullable, and a previous release ignores both (it
would send a paused endpoint's deliveries, which is what it always did). On PostgreSQL
the index is built CONCURRENTLY (a non-atomic migration)."""

from django.db import migrations, models
from django.db.models import Q

INDEX = models.Index(fields=["id"], condition=Q(paused_at__isnull=False), name="endpoint_paused")


def _index(add: bool):
    """Build (``add``) or drop INDEX: CONCURRENTLY on PostgreSQL."""

    def run(apps, schema_editor):
        model = apps.get_model("deliveries", "Endpoint")
        if schema_editor.connection.vendor == "postgresql":
            sql = INDEX.create_sql if add else INDEX.remove_sql
            schema_editor.execute(sql(model, schema_editor, concurrently=True))
        else:
            (schema_editor.add_index if add else schema_editor.remove_index)(model, INDEX)

    return run


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
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="endpoint", index=INDEX)],
            database_operations=[migrations.RunPython(_index(True), _index(False), elidable=False)],
        ),
    ]
