"""Sequenced inbound events (emails with an entity, run in their entity's order) and the
index that finds an entity's unfinished ones (inbound_sequenced, partial: only
sequenced rows, so webhooks never write it).

Expand only. The column has its default in the database, so a previous release's
inserts get ``false``; on PostgreSQL the index is built CONCURRENTLY (a non-atomic
migration), so writes to the event table go on meanwhile."""

from django.db import migrations, models
from django.db.models import Q

from deliveries.core.sql import add_index_concurrently

INDEX = models.Index(
    fields=["source", "entity_id", "occurred_at", "received_at"],
    condition=Q(sequenced=True, state__in=["pending", "enqueued", "processing"]),
    name="inbound_sequenced",
)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("ingest", "0012_console_permissions")]

    operations = [
        migrations.AddField(
            model_name="inboundevent",
            name="sequenced",
            field=models.BooleanField(db_default=False, default=False),
        ),
        add_index_concurrently("ingest", "InboundEvent", INDEX),
    ]
