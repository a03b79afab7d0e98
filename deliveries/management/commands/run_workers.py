import asyncio
import logging
import signal

from django.core.management.base import BaseCommand, CommandError

from deliveries.core.conf import settings
from deliveries.jobs.loop import StopFlag, recorded_run
from deliveries.worker import Worker

from ._loop import add_loop_arguments, settle_if_long_running

logger = logging.getLogger("deliveries.worker")


class Command(BaseCommand):
    help = (
        "Deliver queued webhooks: dequeue in batches, lease, send with aiohttp, record, "
        "acknowledge. SIGTERM lets the requests in flight finish within "
        "WORKER_SHUTDOWN_GRACE seconds, records them, gives back the leases of any still "
        "running, then exits; a second SIGTERM cuts the grace short."
    )

    def add_arguments(self, parser):
        add_loop_arguments(parser)
        parser.add_argument(
            "--lanes", type=int, default=None, help="Batches taken at once (WORKER_LANES)."
        )
        parser.add_argument(
            "--batch-size", type=int, default=None, help="Messages per take (WORKER_BATCH_SIZE)."
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=None,
            help="Requests in flight at most (WORKER_CONCURRENCY).",
        )

    def handle(
        self,
        *args,
        once=False,
        until_idle=False,
        lanes=None,
        batch_size=None,
        concurrency=None,
        **options,
    ):
        lanes = settings.WORKER_LANES if lanes is None else lanes
        given = {"--lanes": lanes, "--batch-size": batch_size, "--concurrency": concurrency}
        for name, value in given.items():
            if value is not None and value < 1:
                raise CommandError(f"{name} must be at least 1, not {value}.")
        # The database may be away when the process starts (a restart in progress): wait
        # for it like the loops do rather than exit.
        stop = StopFlag()
        stop.install()
        worker = Worker(batch_size=batch_size, concurrency=concurrency, lanes=lanes)

        async def main():
            stopped = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, worker.request_stop, stopped)
            if stop.is_set:
                stopped.set()
            return await worker.run(stop=stopped, once=once, until_idle=until_idle)

        def progress():
            # Read by the heartbeat while the lanes deliver.
            return worker.counts["messages"], dict(worker.counts)

        with recorded_run("workers", stop, progress) as run:
            if run is None:
                return
            settle_if_long_running(once=once, until_idle=until_idle)
            logger.info("workers started", extra={"action": "workers.start", "run_id": str(run.id)})
            counts = asyncio.run(main())
        logger.info(
            "workers stopped",
            extra={"action": "workers.stop", "run_id": str(run.id), **dict(counts)},
        )
        self.stdout.write(" ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "idle")
