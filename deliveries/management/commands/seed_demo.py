"""Seed the `make run` demo: a tenant, an endpoint at the local demo receiver, an admin
login and a fresh API key. Safe to run again: everything is reused, except the two
credentials, which are only stored hashed and so must be minted anew to be shown."""

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import make_password
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from deliveries import services
from deliveries.models import Endpoint, Tenant

DEMO_ENDPOINT_DESCRIPTION = "make run: the local demo receiver"


@dataclass(frozen=True)
class DemoSeed:
    tenant: Tenant
    endpoint: Endpoint
    endpoint_created: bool
    api_key: str
    admin_username: str
    admin_password: str
    secrets: list[str]


def demo_seed(*, tenant_name: str, receiver_url: str, admin_username: str) -> DemoSeed:
    """Create or reuse the demo tenant and endpoint; mint a new API key and admin
    password. Other demo endpoints of the tenant (a receiver on another port, from an
    earlier run) are disabled so that they do not fail and retry for days."""
    with transaction.atomic():
        tenant = Tenant.objects.filter(name=tenant_name).first()
        if tenant is None:
            tenant, api_key = services.tenant_create(name=tenant_name)
        else:
            _, api_key = services.api_key_create(tenant=tenant, name="make run")

        endpoint = (
            Endpoint.objects.filter(tenant=tenant, url=receiver_url).order_by("created_at").first()
        )
        created = endpoint is None
        if endpoint is None:
            endpoint, _ = services.endpoint_create(
                tenant=tenant, url=receiver_url, description=DEMO_ENDPOINT_DESCRIPTION
            )
        else:
            # An earlier run may have left it disabled (a receiver that was down for long).
            services.endpoint_enable(endpoint=endpoint)
        for stale in Endpoint.objects.filter(
            tenant=tenant, description=DEMO_ENDPOINT_DESCRIPTION, enabled=True
        ).exclude(id=endpoint.id):
            services.endpoint_disable(endpoint=stale, reason=f"replaced by {receiver_url}")
        signing_secrets = services.active_secrets([endpoint.id], now=timezone.now()).get(
            endpoint.id, []
        )

    password = secrets.token_urlsafe(12)
    # Hashing is slow by design, so it happens outside any transaction: on SQLite a write
    # transaction holds the database's one write lock, which the loops are waiting for.
    hashed = make_password(password)
    get_user_model().objects.update_or_create(
        username=admin_username,
        defaults={"password": hashed, "is_staff": True, "is_superuser": True, "is_active": True},
    )
    return DemoSeed(
        tenant=tenant,
        endpoint=endpoint,
        endpoint_created=created,
        api_key=api_key,
        admin_username=admin_username,
        admin_password=password,
        secrets=signing_secrets,
    )


def write_secret_file(path: Path, signing_secrets: list[str]) -> None:
    """One secret a line, readable by the owner only (it is a credential)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(s + "\n" for s in signing_secrets))
    # Atomic, so a receiver reloading the file never reads half of it.
    tmp.replace(path)


class Command(BaseCommand):
    help = (
        "Seed the demo: tenant, endpoint at the demo receiver, admin user and a new API "
        "key (printed), and the endpoint's signing secrets (written to --secret-file). "
        "Idempotent; every run prints a new API key and admin password."
    )

    def add_arguments(self, parser):
        parser.add_argument("--receiver-url", required=True, help="The demo receiver's URL.")
        parser.add_argument(
            "--secret-file",
            required=True,
            type=Path,
            help="Where to write the endpoint's signing secrets, one a line.",
        )
        parser.add_argument("--tenant", default="demo")
        parser.add_argument("--admin-username", default="admin")

    def handle(self, *args, receiver_url, secret_file, tenant, admin_username, **options):
        seed = demo_seed(
            tenant_name=tenant, receiver_url=receiver_url, admin_username=admin_username
        )
        write_secret_file(secret_file, seed.secrets)
        self.stdout.write(f"Tenant: {seed.tenant.name} ({seed.tenant.id})")
        self.stdout.write(
            f"Endpoint: {seed.endpoint.url} ({seed.endpoint.id}, "
            f"{'created' if seed.endpoint_created else 'reused'})"
        )
        self.stdout.write(f"Signing secret written to: {secret_file}")
        self.stdout.write(f"API key: {seed.api_key}")
        self.stdout.write(f"Admin login: {seed.admin_username} / {seed.admin_password}")
