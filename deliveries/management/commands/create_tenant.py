from django.core.management.base import BaseCommand, CommandError

from deliveries.services import DomainError, tenant_create


class Command(BaseCommand):
    help = "Create a tenant and an API key. The key is printed once, alone on the last line."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument(
            "--time-zone",
            default="UTC",
            help="IANA name (e.g. Europe/Berlin) for the tenant's local schedules; UTC.",
        )

    def handle(self, *args, name, time_zone="UTC", **options):
        try:
            tenant, key = tenant_create(name=name, time_zone=time_zone)
        except DomainError as exc:
            raise CommandError(exc.message) from exc
        self.stdout.write(f"Created tenant {tenant.name} ({tenant.id}). API key (shown once):")
        self.stdout.write(key)
