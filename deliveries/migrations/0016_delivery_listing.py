"""The listing table: whose each delivery is and when it was made, written once, so that
the delivery row sheds the four indexes its state changes kept rewriting
(docs/architecture.md, "The listing table").

Written for a large, busy delivery table and a previous release still running beside
this one (docs/compatibility.md), hence a non-atomic migration, in this order:

1. the table, without its indexes, and the delivery's foreign keys to its endpoint
   and tenant dropped (the listing's carry them now; on SQLite this rebuilds the
   delivery table, which would drop a trigger made before it);
2. the trigger that lists every delivery inserted from then on, whoever inserts it (a
   previous release's publish too). Creating it waits for the transactions inserting
   deliveries at that moment, so every delivery is either committed before it exists or
   listed by it;
3. the deliveries written before, listed in batches of 10,000 in primary-key order, one
   short transaction each (ON CONFLICT: a row the trigger listed meanwhile is skipped);
4. the listing's indexes, then the four delivery indexes they replace dropped, both
   CONCURRENTLY on PostgreSQL, so publishing and the drain go on meanwhile.

On PostgreSQL the listing's key to its delivery is ON DELETE CASCADE in the database
too: a previous release deletes deliveries without knowing the listing."""

import django.db.models.deletion
from django.db import migrations, models, transaction

import deliveries.models

LISTING_INDEXES = [
    models.Index(fields=["-created_at", "-delivery"], name="listing_created"),
    models.Index(fields=["tenant", "-created_at", "-delivery"], name="listing_tenant"),
    models.Index(fields=["endpoint", "-created_at", "-delivery"], name="listing_endpoint"),
]
DELIVERY_INDEXES = [
    models.Index(fields=["-created_at"], name="delivery_created"),
    models.Index(fields=["state", "-created_at"], name="delivery_state_created"),
    models.Index(fields=["tenant", "-created_at"], name="delivery_tenant_created"),
    models.Index(fields=["endpoint", "-created_at"], name="delivery_endpoint_created"),
]
BATCH = 10_000

# A statement-level trigger: one INSERT … SELECT for all the rows of a statement (a
# publish writes one per subscribed endpoint), not one call per row.
TRIGGER = {
    "postgresql": [
        """
        CREATE FUNCTION deliveries_list_deliveries() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO deliveries_deliverylisting (delivery_id, tenant_id, endpoint_id,
                created_at)
            SELECT id, tenant_id, endpoint_id, created_at FROM new_deliveries;
            RETURN NULL;
        END $$
        """,
        """
        CREATE TRIGGER deliveries_listing AFTER INSERT ON deliveries_delivery
        REFERENCING NEW TABLE AS new_deliveries FOR EACH STATEMENT
        EXECUTE FUNCTION deliveries_list_deliveries()
        """,
        """
        ALTER TABLE deliveries_deliverylisting ADD CONSTRAINT listing_delivery_fk
        FOREIGN KEY (delivery_id) REFERENCES deliveries_delivery (id) ON DELETE CASCADE
        DEFERRABLE INITIALLY DEFERRED
        """,
    ],
    "sqlite": [
        """
        CREATE TRIGGER deliveries_listing AFTER INSERT ON deliveries_delivery
        BEGIN
            INSERT INTO deliveries_deliverylisting (delivery_id, tenant_id, endpoint_id,
                created_at)
            VALUES (NEW.id, NEW.tenant_id, NEW.endpoint_id, NEW.created_at);
        END
        """,
    ],
}
DROP_TRIGGER = {
    "postgresql": [
        "DROP TRIGGER deliveries_listing ON deliveries_delivery",
        "DROP FUNCTION deliveries_list_deliveries()",
    ],
    "sqlite": ["DROP TRIGGER deliveries_listing"],
}

FILL_BATCH = """
WITH batch AS (
    SELECT id, tenant_id, endpoint_id, created_at FROM deliveries_delivery
    WHERE id > %s ORDER BY id LIMIT %s
), listed AS (
    INSERT INTO deliveries_deliverylisting (delivery_id, tenant_id, endpoint_id, created_at)
    SELECT * FROM batch ON CONFLICT (delivery_id) DO NOTHING
)
SELECT id FROM batch ORDER BY id DESC LIMIT 1
"""


def _statements(statements: dict):
    def run(apps, schema_editor):
        with transaction.atomic(using=schema_editor.connection.alias):
            for sql in statements[schema_editor.connection.vendor]:
                schema_editor.execute(sql)

    return run


# SQLite (the embedded default, one host): one statement.
FILL_SQLITE = """
INSERT OR IGNORE INTO deliveries_deliverylisting (delivery_id, tenant_id, endpoint_id,
    created_at)
SELECT id, tenant_id, endpoint_id, created_at FROM deliveries_delivery
"""


def fill(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        schema_editor.execute(FILL_SQLITE)
        return
    last = "00000000-0000-0000-0000-000000000000"
    while last is not None:
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            cursor.execute(FILL_BATCH, [last, BATCH])
            row = cursor.fetchone()
        last = row[0] if row else None


def _indexes(model_name: str, indexes: list, *, add: bool):
    """Add (or remove) indexes, CONCURRENTLY on PostgreSQL."""

    def run(apps, schema_editor):
        model = apps.get_model("deliveries", model_name)
        options = {"concurrently": True} if schema_editor.connection.vendor == "postgresql" else {}
        for index in indexes:
            if add:
                schema_editor.add_index(model, index, **options)
            else:
                schema_editor.remove_index(model, index, **options)

    return run


class Migration(migrations.Migration):
    atomic = False  # CREATE/DROP INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("deliveries", "0015_uuid7_ids")]

    operations = [
        migrations.CreateModel(
            name="DeliveryListing",
            fields=[
                (
                    "delivery",
                    models.OneToOneField(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="listing",
                        serialize=False,
                        to="deliveries.delivery",
                    ),
                ),
                (
                    "tenant",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=deliveries.models.cascade_to_deliveries,
                        related_name="+",
                        to="deliveries.tenant",
                    ),
                ),
                (
                    "endpoint",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=deliveries.models.cascade_to_deliveries,
                        related_name="+",
                        to="deliveries.endpoint",
                    ),
                ),
                ("created_at", models.DateTimeField()),
            ],
        ),
        migrations.AlterField(
            model_name="delivery",
            name="endpoint",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="+",
                to="deliveries.endpoint",
            ),
        ),
        migrations.AlterField(
            model_name="delivery",
            name="tenant",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="+",
                to="deliveries.tenant",
            ),
        ),
        migrations.RunPython(_statements(TRIGGER), _statements(DROP_TRIGGER), elidable=False),
        migrations.RunPython(fill, migrations.RunPython.noop, elidable=False),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(model_name="deliverylisting", index=index)
                for index in LISTING_INDEXES
            ],
            database_operations=[
                migrations.RunPython(
                    _indexes("DeliveryListing", LISTING_INDEXES, add=True),
                    _indexes("DeliveryListing", LISTING_INDEXES, add=False),
                    elidable=False,
                )
            ],
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="delivery", name=index.name)
                for index in DELIVERY_INDEXES
            ],
            database_operations=[
                migrations.RunPython(
                    _indexes("Delivery", DELIVERY_INDEXES, add=False),
                    _indexes("Delivery", DELIVERY_INDEXES, add=True),
                    elidable=False,
                )
            ],
        ),
    ]
