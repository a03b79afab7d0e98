"""Expand: endpoint signing secrets get an encrypted column (deliveries/core/encryption.py).

The new column is nullable: a previous release still running inserts rows without it,
with the secret in the old column, and this release reads both shapes. The old column
stays in the database, as ``legacy_plaintext`` in the model (a rename in the model's
state only, no SQL), so that those inserts keep working; 0018 encrypts the existing rows
and blanks it, and a later release drops it (docs/compatibility.md, "Secrets at rest")."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("deliveries", "0017_admin_permissions"),
    ]

    operations = [
        migrations.AddField(
            model_name="endpointsecret",
            name="secret_encrypted",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RenameField(
                    model_name="endpointsecret", old_name="secret", new_name="legacy_plaintext"
                ),
                migrations.AlterField(
                    model_name="endpointsecret",
                    name="legacy_plaintext",
                    field=models.CharField(
                        blank=True, db_column="secret", default="", max_length=200
                    ),
                ),
            ],
        ),
    ]
