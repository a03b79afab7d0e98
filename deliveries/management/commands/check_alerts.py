from django.core.management.base import BaseCommand

from deliveries.alerts import alerts_check


class Command(BaseCommand):
    help = (
        "One pass of the alert checks: record operational events (dead letters growing, "
        "endpoints disabled, verification failure spikes), resolve quiet ones, notify new "
        "ones once each. Run it every minute (cron or the django-q2 schedule)."
    )

    def handle(self, *args, **options):
        counts = alerts_check()
        self.stdout.write(" ".join(f"{k}={v}" for k, v in sorted(counts.items()) if v) or "quiet")
