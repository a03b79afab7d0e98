import uuid

from django.core.management.base import BaseCommand, CommandError

from deliveries.services import delivery_replay


class Command(BaseCommand):
    help = "Send deliveries again with the same identity (webhook-id): back to pending, due now."

    def add_arguments(self, parser):
        parser.add_argument("delivery_ids", nargs="+")

    def handle(self, *args, delivery_ids, **options):
        try:
            ids = [uuid.UUID(d) for d in delivery_ids]
        except ValueError as exc:
            raise CommandError(f"not a delivery id: {exc}") from exc
        n = delivery_replay(delivery_ids=ids, via="command")
        self.stdout.write(f"{n} of {len(ids)} deliveries returned to pending")
