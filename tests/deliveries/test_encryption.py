"""Secrets at rest: what the database holds for every stored secret, key rotation, the
migrations that encrypt rows written before encryption, and the checks."""

import base64
import importlib
import logging
import uuid

import pytest
from cryptography.fernet import Fernet
from django.apps import apps
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient
from standardwebhooks.webhooks import Webhook

from deliveries import services
from deliveries.checks import check_encryption_keys, check_encryption_keys_set
from deliveries.core import encryption
from deliveries.models import EndpointSecret
from ingest.models import PollSource, SourceSecret
from ingest.poll_sources import poll_source_create
from ingest.sources import source_create
from tests.conftest import drain

pytestmark = pytest.mark.django_db

KEY_OLD = Fernet.generate_key().decode()
KEY_NEW = Fernet.generate_key().decode()

# Every column of every table that holds a secret (the legacy plain-text column included).
SECRET_COLUMNS = {
    "deliveries_endpointsecret": ("secret", "secret_encrypted"),
    "ingest_sourcesecret": ("secret", "secret_encrypted"),
    "ingest_pollsource": ("auth_secret", "auth_secret_encrypted"),
}


def stored_text() -> str:
    """Everything the secret columns hold, as one string."""
    parts = []
    with connection.cursor() as cursor:
        for table, columns in SECRET_COLUMNS.items():
            cursor.execute(f"SELECT {', '.join(columns)} FROM {table}")
            parts += [str(value) for row in cursor.fetchall() for value in row]
    return "\n".join(parts)


def spellings(secret: str) -> list[str]:
    """The secret and the encodings it could be stored in by mistake."""
    forms = [secret, base64.b64encode(secret.encode()).decode()]
    forms.append(base64.urlsafe_b64encode(secret.encode()).decode())
    bare = secret.removeprefix("whsec_")
    if bare != secret:  # a Standard Webhooks secret: its base64 part is the key
        forms += [bare, base64.b64decode(bare).hex()]
    return [f.rstrip("=") for f in forms]


def assert_not_stored(*secrets: str) -> None:
    text = stored_text()
    assert text.strip(), "no secret rows: the check is looking at nothing"
    for secret in secrets:
        for form in spellings(secret):
            assert form not in text, form[:10]


@pytest.fixture
def api():
    tenant, key = services.tenant_create(name="acme")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client, tenant


def test_no_secret_column_holds_a_secret_made_through_the_api_and_the_services(api):
    client, _tenant = api
    created = client.post("/api/v1/endpoints/", {"url": "https://example.com/h"}, format="json")
    assert created.status_code == 201, created.content
    rotated = client.post(f"/api/v1/endpoints/{created.json()['id']}/rotate-secret/")
    source_secret = "whsec_" + base64.b64encode(b"inbound-source-secret-0123456").decode()
    source_create(slug="stripe-in", scheme="standard", secrets=[source_secret, "shopify-s3cr3t"])
    poll_source_create(
        slug="crm", config={"url": "https://crm.example/changes"}, auth_secret="Bearer tok-42"
    )

    assert_not_stored(
        created.json()["secret"],
        rotated.json()["secret"],
        source_secret,
        "shopify-s3cr3t",
        "Bearer tok-42",
    )
    # And each reads back whole through the model.
    endpoint_id = uuid.UUID(created.json()["id"])
    active = services.active_secrets([endpoint_id], now=timezone.now())[endpoint_id]
    assert active == [rotated.json()["secret"], created.json()["secret"]]
    assert sorted(s.secret for s in SourceSecret.objects.all()) == sorted(
        [source_secret, "shopify-s3cr3t"]
    )
    assert PollSource.objects.get().auth_secret == "Bearer tok-42"


@pytest.mark.django_db(transaction=True)  # the workers' threads read what the test wrote
def test_a_delivery_signed_after_a_key_rotation_verifies_with_the_standardwebhooks_package(
    api, receiver, settings
):
    settings.SECRETS_ENCRYPTION_KEYS = [KEY_OLD]
    client, tenant = api
    created = client.post("/api/v1/endpoints/", {"url": receiver.url("/hook")}, format="json")
    secret = created.json()["secret"]

    settings.SECRETS_ENCRYPTION_KEYS = [KEY_NEW, KEY_OLD]  # new key first, old still read
    assert call_command("rotate_encryption_keys") is None
    settings.SECRETS_ENCRYPTION_KEYS = [KEY_NEW]  # the old key retired
    services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"n": 1})
    drain()

    (request,) = receiver.requests_to("/hook")
    assert Webhook(secret).verify(request.body, request.headers) == {"n": 1}
    assert_not_stored(secret)


def test_rotation_re_encrypts_every_secret_under_the_newest_key(settings):
    settings.SECRETS_ENCRYPTION_KEYS = [KEY_OLD]
    tenant = services.tenant_create(name="acme")[0]
    _, endpoint_secret = services.endpoint_create(tenant=tenant, url="https://a.example/h")
    source_create(slug="gh", scheme="github", secrets=["gh-secret"])
    poll_source_create(slug="crm", config={"url": "https://crm.example/c"}, auth_secret="tok")

    settings.SECRETS_ENCRYPTION_KEYS = [KEY_NEW, KEY_OLD]
    # Decrypts with any key before the rotation; encrypts new secrets with the first.
    assert EndpointSecret.objects.get().secret == endpoint_secret
    counts = encryption.rotate_all(apps.get_models())
    assert counts == {
        "deliveries.EndpointSecret.secret_encrypted": 1,
        "ingest.SourceSecret.secret_encrypted": 1,
        "ingest.PollSource.auth_secret_encrypted": 1,
    }

    settings.SECRETS_ENCRYPTION_KEYS = [KEY_NEW]
    assert EndpointSecret.objects.get().secret == endpoint_secret
    assert SourceSecret.objects.get().secret == "gh-secret"
    assert PollSource.objects.get().auth_secret == "tok"
    settings.SECRETS_ENCRYPTION_KEYS = [KEY_OLD]  # nothing is left under the old key
    with pytest.raises(encryption.UnreadableSecret):
        _ = EndpointSecret.objects.get().secret


def test_a_secret_no_key_opens_is_left_out_and_logged_without_its_token(settings, caplog):
    settings.SECRETS_ENCRYPTION_KEYS = [KEY_OLD]
    tenant = services.tenant_create(name="acme")[0]
    endpoint, lost = services.endpoint_create(tenant=tenant, url="https://a.example/h")
    token = EndpointSecret.objects.get().secret_encrypted
    settings.SECRETS_ENCRYPTION_KEYS = [KEY_NEW]  # the old key removed too soon
    kept = services.endpoint_rotate_secret(endpoint=endpoint)

    with caplog.at_level(logging.ERROR, logger="deliveries.encryption"):
        active = services.active_secrets([endpoint.id], now=timezone.now())
    assert active == {endpoint.id: [kept]}
    (record,) = caplog.records
    assert record.action == "secrets.unreadable"
    assert token not in record.getMessage() and lost not in record.getMessage()


endpoint_migration = importlib.import_module("deliveries.migrations.0019_encrypt_endpoint_secrets")
source_migration = importlib.import_module("ingest.migrations.0007_encrypt_source_secrets")


def as_previous_release_wrote_it(table: str, plain_column: str, token_column: str) -> None:
    """Put every row of ``table`` back in the shape a release before encryption wrote:
    the secret in plain text, no token."""
    model = {
        "deliveries_endpointsecret": EndpointSecret,
        "ingest_sourcesecret": SourceSecret,
        "ingest_pollsource": PollSource,
    }[table]
    with connection.cursor() as cursor:
        for row in model.objects.all():
            plain = row.auth_secret if model is PollSource else row.secret
            cursor.execute(
                f"UPDATE {table} SET {plain_column} = %s, {token_column} = NULL WHERE id = %s",
                [plain, row.pk],
            )


def test_the_data_migrations_encrypt_rows_written_before_them_in_batches(monkeypatch):
    monkeypatch.setattr(encryption, "BATCH", 2)  # several batches
    tenant = services.tenant_create(name="acme")[0]
    made = [services.endpoint_create(tenant=tenant, url=f"https://{i}.example/h") for i in "abc"]
    source_create(slug="gh", scheme="github", secrets=["gh-1", "gh-2", "gh-3"])
    poll_source_create(slug="crm", config={"url": "https://crm.example/c"}, auth_secret="tok")
    for table, (plain, token) in SECRET_COLUMNS.items():
        as_previous_release_wrote_it(table, plain, token)
    assert "gh-2" in stored_text()  # the old shape, as the migrations find it

    with connection.schema_editor(atomic=False) as editor:
        endpoint_migration.encrypt(apps, editor)
        source_migration.encrypt(apps, editor)

    assert_not_stored(*(secret for _, secret in made), "gh-1", "gh-2", "gh-3", "tok")
    assert not EndpointSecret.objects.filter(secret_encrypted__isnull=True).exists()
    assert sorted(s.secret for s in EndpointSecret.objects.all()) == sorted(s for _, s in made)
    assert sorted(s.secret for s in SourceSecret.objects.all()) == ["gh-1", "gh-2", "gh-3"]
    assert PollSource.objects.get().auth_secret == "tok"

    # Reversible: back to the plain-text shape a previous release reads.
    with connection.schema_editor(atomic=False) as editor:
        endpoint_migration.decrypt(apps, editor)
    with connection.cursor() as cursor:
        cursor.execute("SELECT secret, secret_encrypted FROM deliveries_endpointsecret")
        rows = cursor.fetchall()
    assert sorted(rows) == sorted((secret, None) for _, secret in made)


def test_rows_a_previous_release_writes_during_the_deploy_are_read_and_then_encrypted():
    tenant = services.tenant_create(name="acme")[0]
    endpoint, secret = services.endpoint_create(tenant=tenant, url="https://a.example/h")
    as_previous_release_wrote_it("deliveries_endpointsecret", "secret", "secret_encrypted")

    assert services.active_secrets([endpoint.id], now=timezone.now()) == {endpoint.id: [secret]}
    call_command("rotate_encryption_keys")
    assert_not_stored(secret)
    assert services.active_secrets([endpoint.id], now=timezone.now()) == {endpoint.id: [secret]}


def test_check_deploy_warns_while_secrets_are_encrypted_under_the_secret_key(settings):
    settings.SECRETS_ENCRYPTION_KEYS = []
    assert [w.id for w in check_encryption_keys_set(None)] == ["deliveries.W030"]
    settings.SECRETS_ENCRYPTION_KEYS = [encryption.FROM_SECRET_KEY, KEY_OLD]
    assert [w.id for w in check_encryption_keys_set(None)] == ["deliveries.W030"]
    settings.SECRETS_ENCRYPTION_KEYS = [KEY_NEW, encryption.FROM_SECRET_KEY]
    assert check_encryption_keys_set(None) == []
    assert check_encryption_keys(None) == []


def test_a_key_that_is_not_a_fernet_key_is_a_check_error_that_shows_no_key(settings):
    settings.SECRETS_ENCRYPTION_KEYS = [KEY_NEW, "not-a-key-hunter2"]
    (error,) = check_encryption_keys(None)
    assert error.id == "deliveries.E030"
    assert "key 2" in error.msg and "hunter2" not in error.msg and KEY_NEW not in error.msg


def test_a_deployment_without_keys_moves_to_its_own_key_without_losing_a_secret(settings):
    settings.SECRETS_ENCRYPTION_KEYS = []  # encrypted under the key derived from SECRET_KEY
    tenant = services.tenant_create(name="acme")[0]
    endpoint, secret = services.endpoint_create(tenant=tenant, url="https://a.example/h")

    settings.SECRETS_ENCRYPTION_KEYS = [KEY_NEW, encryption.FROM_SECRET_KEY]
    call_command("rotate_encryption_keys")
    settings.SECRETS_ENCRYPTION_KEYS = [KEY_NEW]
    settings.SECRET_KEY = "a-new-secret-key-" + "y" * 40  # no longer tied to SECRET_KEY
    assert services.active_secrets([endpoint.id], now=timezone.now()) == {endpoint.id: [secret]}


def test_the_admin_sets_a_poll_source_secret_encrypted_and_never_shows_it(admin_client):
    poll = poll_source_create(
        slug="crm", config={"url": "https://crm.example/c"}, auth_secret="Bearer old-tok"
    )
    url = f"/admin/ingest/pollsource/{poll.pk}/change/"
    page = admin_client.get(url)
    assert page.status_code == 200
    assert "old-tok" not in page.content.decode()
    assert poll.auth_secret_encrypted not in page.content.decode()

    form = {
        "tenant": "",
        "adapter": "http_json",
        "config": '{"url": "https://crm.example/c"}',
        "enabled": "on",
        "every_minutes": "5",
    }
    assert admin_client.post(url, {**form, "auth_secret": ""}).status_code == 302
    assert PollSource.objects.get().auth_secret == "Bearer old-tok"  # blank keeps it
    assert admin_client.post(url, {**form, "auth_secret": "Bearer new-tok"}).status_code == 302
    assert PollSource.objects.get().auth_secret == "Bearer new-tok"
    assert_not_stored("Bearer new-tok", "Bearer old-tok")
