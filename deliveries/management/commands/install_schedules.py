from django.core.management.base import BaseCommand

from deliveries.schedules import MAINTENANCE_SCHEDULES, install_schedules


class Command(BaseCommand):
    help = (
        "Create the django-q2 Schedule rows of the maintenance tasks (prune hourly, alert "
        "checks every minute). Idempotent; a qcluster runs them."
    )

    def handle(self, *args, **options):
        changed = install_schedules()
        for name, (func, minutes) in MAINTENANCE_SCHEDULES.items():
            mark = "installed" if name in changed else "unchanged"
            self.stdout.write(f"{name}: {func} every {minutes} min ({mark})")
