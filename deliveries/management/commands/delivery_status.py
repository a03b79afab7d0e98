import uuid

from django.core.management.base import BaseCommand, CommandError

from deliveries.models import Delivery
from deliveries.selectors import delivery_explain


class Command(BaseCommand):
    help = "Explain where one delivery stands: late by policy, in transport, leased, done, or lost."

    def add_arguments(self, parser):
        parser.add_argument("delivery_id")

    def handle(self, *args, delivery_id, **options):
        try:
            delivery = Delivery.objects.select_related("endpoint", "event").get(
                id=uuid.UUID(delivery_id)
            )
        except (ValueError, Delivery.DoesNotExist) as exc:
            raise CommandError(f"no delivery {delivery_id}") from exc
        explanation = delivery_explain(delivery)
        self.stdout.write(explanation.sentence)
        for line in explanation.details:
            self.stdout.write(f"  {line}")
