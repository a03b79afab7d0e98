"""Sequenced inbound events (emails with an entity, run in their entity's order) and the
index that finds an entity's unfinished ones (inbound_sequenced, partial: only
sequenced rows, so webhooks never write it).

Expand only. The column has its default in the database, so a previous release's
inserts get ``false``; on PostgreSQL the index is built CONCURRENTLY (a non-atomic
migration), so writes to the event table go on meanwhile."""

from django.db import migrations, models
from django.db.models import Q

INDEX = models.Index(
    fields=["source", "entity_id", "occurred_at", "received_at"],
    condition=Q(sequenced=True, state__in=["pending", "enqueued", "processing"]),
    name="inbound_sequenced",
)


def _index(add: bool):
    """Build (``add``) or drop INDEX: CONCURRENTLY on PostgreSQL."""

    def run(apps, schema_editor):
        model = apps.get_model("ingest", "InboundEvent")
        if schema_editor.connection.vendor == "postgresql":
            sql = INDEX.create_sql if add else INDEX.remove_sql
            schema_editor.execute(sql(model, schema_editor, concurrently=True))
        else:
            (schema_editor.add_index if add else schema_editor.remove_index)(model, INDEX)

    return run


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("ingest", "0012_console_permissions")]

    operations = [
        migrations.AddField(
            model_name="inboundevent",
            name="sequenced",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="inboundevent", index=INDEX)],
            database_operations=[migrations.RunPython(_index(True), _index(False), elidable=False)],
        ),
    ]
