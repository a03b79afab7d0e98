from django.core.management.base import BaseCommand, CommandError

from deliveries.core.conf import settings
from deliveries.core.retention import PRUNERS, prune


class Command(BaseCommand):
    help = (
        "Delete history past its retention window (terminal deliveries and their attempts, "
        "published outbox rows, events, finished inbound events, loop runs, resolved "
        "operational events) in bounded batches. Safe while the workers run."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would go; delete nothing."
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=settings.PRUNE_BATCH_SIZE,
            help="Rows per transaction (PRUNE_BATCH_SIZE).",
        )
        parser.add_argument(
            "--max-batches", type=int, default=None, help="Stop each kind after N batches."
        )
        parser.add_argument(
            "--only", action="append", choices=sorted(PRUNERS), help="Prune only this kind."
        )
        parser.add_argument(
            "--pause", type=float, default=0.0, help="Seconds to wait between batches."
        )

    def handle(self, *args, dry_run, batch_size, max_batches, only, pause, **options):
        if batch_size < 1:
            raise CommandError("--batch-size must be at least 1")
        totals = prune(
            batch_size=batch_size, max_batches=max_batches, dry_run=dry_run, only=only, pause=pause
        )
        verb = "would delete" if dry_run else "deleted"
        for name, n in sorted(totals.items()):
            self.stdout.write(f"{name}: {verb} {n}")
