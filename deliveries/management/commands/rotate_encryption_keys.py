from django.apps import apps
from django.core.management.base import BaseCommand, CommandError

from deliveries.core.encryption import UnreadableSecret, rotate_all


class Command(BaseCommand):
    help = (
        "Re-encrypt every stored secret (endpoint signing secrets, inbound source secrets, "
        "poll sources' auth secrets) under the first of SECRETS_ENCRYPTION_KEYS, and encrypt "
        "any still in plain text. Run it after putting a new key first; once it has run, the "
        "old keys can be removed. Safe while the service runs."
    )

    def handle(self, *args, **options):
        try:
            counts = rotate_all(apps.get_models())
        except UnreadableSecret as exc:
            raise CommandError(f"{exc}; put the key that made it back in the list") from exc
        for name, n in sorted(counts.items()):
            self.stdout.write(f"{name}: {n} re-encrypted")
