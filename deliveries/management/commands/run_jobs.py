import logging
import signal

from django.core.management.base import BaseCommand

from deliveries.jobs.background.worker import JobWorker
from deliveries.jobs.loop import StopFlag, recorded_run

from ._loop import add_loop_arguments, settle_if_long_running

logger = logging.getLogger("deliveries.jobs")


def queue_names(values: list[str] | None) -> list[str]:
    """``--queue a --queue b,c`` as ["a", "b", "c"]; "default" when none is named."""
    names = [name.strip() for value in values or () for name in value.split(",")]
    return list(dict.fromkeys(name for name in names if name)) or ["default"]


class Command(BaseCommand):
    help = (
        "Run the host's background jobs (@job functions) of the named queues: claim up to "
        "the free slots, run, record in batches. SIGTERM lets the jobs in flight finish "
        "within WORKER_SHUTDOWN_GRACE seconds, records them and gives back the others; a "
        "second SIGTERM cuts the grace short."
    )

    def add_arguments(self, parser):
        add_loop_arguments(parser)
        parser.add_argument(
            "--queue",
            action="append",
            help="A queue to serve (repeat it, or a comma-separated list); default: default.",
        )
        parser.add_argument(
            "--concurrency", type=int, default=None, help="Jobs at once (JOBS_CONCURRENCY)."
        )

    def handle(self, *args, once=False, until_idle=False, queue=None, concurrency=None, **options):
        queues = queue_names(queue)
        worker = JobWorker(queues=queues, concurrency=concurrency)
        stop = StopFlag()  # the run row's waits; the worker's own flag stops its loop
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: (stop.event.set(), worker.request_stop()))

        def progress():
            return worker.counts["claimed"], dict(worker.counts)

        with recorded_run("jobs", stop, progress) as run:
            if run is None:
                return
            worker.run_id = run.id
            settle_if_long_running(once=once, until_idle=until_idle)
            logger.info(
                "jobs started",
                extra={"action": "jobs.start", "run_id": str(run.id), "queues": queues},
            )
            counts = worker.run(once=once, until_idle=until_idle)
        logger.info(
            "jobs stopped", extra={"action": "jobs.stop", "run_id": str(run.id), **dict(counts)}
        )
        self.stdout.write(" ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "idle")
