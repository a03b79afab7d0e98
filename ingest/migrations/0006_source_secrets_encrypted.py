"""Expand: inbound source secrets and poll sources' auth secrets get encrypted columns
(deliveries/core/encryption.py).

Nullable: a previous release still running inserts rows without them, with the secret
in the old column, and this release reads both shapes. The old columns stay in the
database, renamed in the models' state only (no SQL), so that those inserts keep
working; 0007 encrypts the existing rows and blanks them, and a later release drops them
(docs/compatibility.md, "Secrets at rest")."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("ingest", "0005_uuid7_ids"),
    ]

    operations = [
        migrations.AddField(
            model_name="sourcesecret",
            name="secret_encrypted",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="pollsource",
            name="auth_secret_encrypted",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RenameField(
                    model_name="sourcesecret", old_name="secret", new_name="legacy_plaintext"
                ),
                migrations.AlterField(
                    model_name="sourcesecret",
                    name="legacy_plaintext",
                    field=models.CharField(
                        blank=True, db_column="secret", default="", max_length=500
                    ),
                ),
                migrations.RenameField(
                    model_name="pollsource", old_name="auth_secret", new_name="legacy_auth_secret"
                ),
                migrations.AlterField(
                    model_name="pollsource",
                    name="legacy_auth_secret",
                    field=models.CharField(
                        blank=True, db_column="auth_secret", default="", max_length=2000
                    ),
                ),
            ],
        ),
    ]
