import logging

from django.core.management.base import BaseCommand

from deliveries.core.conf import settings
from deliveries.jobs import brokers as broker
from deliveries.jobs import wakeup
from deliveries.jobs.loop import StopFlag, run_loop
from deliveries.jobs.relay import relay_tick

from ._loop import add_loop_arguments, settle_if_long_running

logger = logging.getLogger("deliveries")


class Command(BaseCommand):
    help = (
        "Publish outbox rows to a queue broker outside the database (Redis). Not needed "
        "with the database broker, whose workers take the outbox directly. Safe to run "
        "several at once."
    )

    def add_arguments(self, parser):
        add_loop_arguments(parser)

    def handle(self, *args, once=False, until_idle=False, **options):
        stop = StopFlag()
        stop.install()
        b = broker.get_broker()
        if broker.takes_outbox(b):
            # It keeps working: the rows it publishes go through the queue table, which
            # the workers' take also reads, one hop longer than their own claim.
            logger.warning(
                "run_relay is not needed with the database broker: the workers take the "
                "outbox directly",
                extra={"action": "relay.not_needed"},
            )
        settle_if_long_running(once=once, until_idle=until_idle)
        totals = run_loop(
            "relay",
            lambda: relay_tick(b=b),
            once=once,
            until_idle=until_idle,
            interval=settings.RELAY_INTERVAL,
            stop=stop,
            listen=(wakeup.OUTBOX,),
        )
        self.stdout.write(" ".join(f"{k}={v}" for k, v in sorted(totals.items())) or "idle")
