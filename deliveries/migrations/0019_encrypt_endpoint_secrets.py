"""Encrypt the endpoint secrets written before 0017 and blank their plain text.

Batches of 500 rows in primary-key order, one short transaction each (hence not atomic);
each UPDATE is guarded on the row still having no token. Reversible: going back to 0017
writes the secrets back in plain text (what a release before encryption reads), so keep
SECRETS_ENCRYPTION_KEYS until then."""

from django.db import migrations

from deliveries.core import encryption

FIELDS = {"token_field": "secret_encrypted", "plaintext_field": "legacy_plaintext"}


def encrypt(apps, schema_editor):
    encryption.encrypt_plaintext_rows(apps.get_model("deliveries", "EndpointSecret"), **FIELDS)


def decrypt(apps, schema_editor):
    encryption.decrypt_to_plaintext_rows(apps.get_model("deliveries", "EndpointSecret"), **FIELDS)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("deliveries", "0018_endpointsecret_secret_encrypted"),
    ]

    operations = [
        migrations.RunPython(encrypt, decrypt, elidable=False),
    ]
