"""Drop the varchar_pattern_ops index Django adds beside the unique index of a CharField
with unique=True: nothing looks message keys up with LIKE, and every outbox row (each
dispatch of a delivery, each inbound event) was written through it. The unique index
stays. PostgreSQL only (SQLite never had it); the reverse recreates it."""

from django.db import migrations

INDEX = "deliveries_outbox_message_key_109e0cbe_like"


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")


def recreate(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {INDEX} ON deliveries_outbox "
            "(message_key varchar_pattern_ops)"
        )


class Migration(migrations.Migration):
    dependencies = [("deliveries", "0010_operational_events_and_alert_checkpoints")]

    operations = [migrations.RunPython(drop, recreate, elidable=False)]
