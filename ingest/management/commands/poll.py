from collections import Counter

from django.core.management.base import BaseCommand, CommandError

from deliveries.jobs.loop import StopFlag, recorded_run
from ingest.models import PollSource
from ingest.poll_sources import poll_source_run


class Command(BaseCommand):
    help = (
        "Poll a source for changed records (a cursor over the data; see docs/polling.md). "
        "Overlapping runs of one source are safe: a second one finds the lease held. "
        "Without --once it keeps polling, and records its run and heartbeat (LoopRun)."
    )

    def add_arguments(self, parser):
        parser.add_argument("source", help="The poll source's slug.")
        parser.add_argument("--once", action="store_true", help="Poll once and exit (cron).")
        parser.add_argument(
            "--interval",
            type=float,
            help="Seconds between polls (default: the source's every_minutes).",
        )

    def handle(self, *args, source, once=False, interval=None, **options):
        try:
            poll = PollSource.objects.select_related("source").get(source__slug=source)
        except PollSource.DoesNotExist:
            raise CommandError(f"no poll source {source!r}") from None
        stop = StopFlag()
        stop.install()
        if once:
            result = self._poll(source, stop)
            if result.outcome == "failed":
                raise CommandError(f"poll of {source} failed")
            return
        interval = interval if interval is not None else poll.every_minutes * 60
        totals: Counter = Counter()
        polls = 0
        with recorded_run("poll", stop, lambda: (polls, dict(totals))) as run:
            while run is not None:
                result = self._poll(source, stop)
                polls += 1
                totals.update(result.counts)
                totals[result.outcome] += 1
                if stop.event.wait(interval):
                    return

    def _poll(self, source: str, stop: StopFlag):
        result = poll_source_run(slug=source, should_stop=lambda: stop.is_set)
        counts = " ".join(f"{k}={v}" for k, v in sorted(result.counts.items()))
        cursor = result.cursor.at.isoformat() if result.cursor.at else "-"
        self.stdout.write(f"{source}: {result.outcome} {counts} cursor={cursor}".rstrip())
        if result.error:
            self.stderr.write(f"{source}: {result.error}")
        return result
