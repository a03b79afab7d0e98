from django.core.management.base import BaseCommand

from deliveries.core.conf import settings
from deliveries.jobs import wakeup
from deliveries.jobs.loop import StopFlag, run_loop
from deliveries.scheduler import SchedulerPasses

from ._loop import add_loop_arguments, settle_if_long_running


class Command(BaseCommand):
    help = (
        "The recovery clock: admit due deliveries to the outbox, return expired leases and "
        "lost dispatches to pending. Safe to run several at once."
    )

    def add_arguments(self, parser):
        add_loop_arguments(parser)

    def handle(self, *args, once=False, until_idle=False, **options):
        stop = StopFlag()
        stop.install()
        settle_if_long_running(once=once, until_idle=until_idle)
        totals = run_loop(
            "scheduler",
            SchedulerPasses(),
            once=once,
            until_idle=until_idle,
            interval=settings.SCHEDULER_INTERVAL,
            stop=stop,
            listen=(wakeup.FREED, wakeup.DUE),
        )
        self.stdout.write(" ".join(f"{k}={v}" for k, v in sorted(totals.items())) or "idle")
