"""The second inbound dedupe key: ``body_sha256`` for the schemes that do not sign the
event id, unique per source where set (docs/security.md, "Replayed inbound deliveries").

Expand only: the column is nullable (no rewrite, a previous release leaves it null and
never conflicts on it), and on PostgreSQL the partial unique index is built CONCURRENTLY
(a non-atomic migration), so receiving goes on meanwhile."""

from django.db import migrations, models
from django.db.models import Q

CONSTRAINT = models.UniqueConstraint(
    fields=["source", "body_sha256"],
    condition=Q(body_sha256__isnull=False),
    name="inbound_source_body",
)
CREATE = (
    "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS inbound_source_body"
    " ON ingest_inboundevent (source_id, body_sha256) WHERE body_sha256 IS NOT NULL"
)
DROP = "DROP INDEX CONCURRENTLY IF EXISTS inbound_source_body"


def _constraint(add: bool):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(CREATE if add else DROP)
            return
        model = apps.get_model("ingest", "InboundEvent")
        (schema_editor.add_constraint if add else schema_editor.remove_constraint)(
            model, CONSTRAINT
        )

    return run


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("ingest", "0007_encrypt_source_secrets")]

    operations = [
        migrations.AddField(
            model_name="inboundevent",
            name="body_sha256",
            field=models.CharField(blank=True, max_length=64, null=True),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddConstraint(model_name="inboundevent", constraint=CONSTRAINT)
            ],
            database_operations=[
                migrations.RunPython(_constraint(True), _constraint(False), elidable=False)
            ],
        ),
    ]
