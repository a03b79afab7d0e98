"""Encrypt the source secrets and poll sources' auth secrets written before 0006 and
blank their plain text.

Batches of 500 rows in primary-key order, one short transaction each (hence not atomic);
each UPDATE is guarded on the row still having no token. Reversible: going back to 0006
writes the secrets back in plain text (what a release before encryption reads), so keep
SECRETS_ENCRYPTION_KEYS until then."""

from django.db import migrations

from deliveries.core import encryption

TABLES = [
    ("SourceSecret", {"token_field": "secret_encrypted", "plaintext_field": "legacy_plaintext"}),
    (
        "PollSource",
        {"token_field": "auth_secret_encrypted", "plaintext_field": "legacy_auth_secret"},
    ),
]


def encrypt(apps, schema_editor):
    for name, fields in TABLES:
        encryption.encrypt_plaintext_rows(apps.get_model("ingest", name), **fields)


def decrypt(apps, schema_editor):
    for name, fields in TABLES:
        encryption.decrypt_to_plaintext_rows(apps.get_model("ingest", name), **fields)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("ingest", "0006_source_secrets_encrypted"),
    ]

    operations = [
        migrations.RunPython(encrypt, decrypt, elidable=False),
    ]
