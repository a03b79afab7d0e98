import asyncio
import logging
import signal

from django.core.management.base import BaseCommand, CommandError

from deliveries.jobs.loop import StopFlag, recorded_run
from ingest.models import Source
from ingest.smtp import Listener, quiet_library_log

logger = logging.getLogger("ingest.smtp")


class Command(BaseCommand):
    help = (
        "Receive mail for an smtp source: accept it for the source's addresses only, store "
        "each message once, answer 250 only after it is committed. SIGTERM lets messages "
        "being stored finish (SMTP_SHUTDOWN_SECONDS), answers 421 to the rest and exits."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--source",
            default="",
            help="The smtp source's slug (default: the only enabled smtp source).",
        )
        parser.add_argument("--host", default=None, help="Address to listen on (SMTP_HOST).")
        parser.add_argument(
            "--port", type=int, default=None, help="Port (SMTP_PORT; 0: any free port)."
        )

    def handle(self, *args, source="", host=None, port=None, **options):
        quiet_library_log()
        slug = source or self._only_source()
        listener = Listener(slug, host=host, port=port)

        def ready(bound: int) -> None:
            # On its own line, flushed: a supervisor (or a test) waits for it.
            self.stdout.write(f"listening on {listener.host}:{bound} for source {slug}")
            self.stdout.flush()

        # Until the event loop takes them over, a SIGTERM while the run is being
        # recorded (the database may be away) stops the command as the loops do.
        flag = StopFlag()
        flag.install()

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            if flag.is_set:
                stop.set()
            await listener.run(stop, ready)

        def progress():
            # Read by the heartbeat's thread: messages stored, and what became of them.
            return listener.counts["messages"], dict(listener.counts)

        with recorded_run("smtp", flag, progress) as run:
            if run is None:
                return
            try:
                asyncio.run(main())
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
        logger.info(
            "smtp counts", extra={"action": "smtp.counts", "run_id": str(run.id), **listener.counts}
        )
        self.stdout.write("stopped")

    @staticmethod
    def _only_source() -> str:
        slugs = list(
            Source.objects.filter(scheme="smtp", enabled=True).values_list("slug", flat=True)[:2]
        )
        if len(slugs) != 1:
            raise CommandError(
                "name the source with --source: "
                + ("there is no enabled smtp source" if not slugs else "there are several")
            )
        return slugs[0]
