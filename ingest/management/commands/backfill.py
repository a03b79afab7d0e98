import re
import sys
import time
from datetime import UTC, datetime

from django.core.management.base import BaseCommand, CommandError
from django.utils.dateparse import parse_date, parse_datetime

from deliveries.jobs.loop import StopFlag
from ingest.backfill import (
    BackfillError,
    backfill_dry_run,
    backfill_run_create,
    backfill_run_execute,
)
from ingest.models import BackfillRun
from ingest.selectors import backfill_progress

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(?:/\s*(s|sec|second|m|min|minute|h|hour))?\s*$")
_PER = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}


def parse_rate(value: str) -> float:
    """``"5"``, ``"5/s"``, ``"120/m"``, ``"0.5/s"`` → requests per second."""
    match = _RATE.match(value)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--rate {value!r}: use requests per second, e.g. 5/s or 120/m")
    return float(match.group(1)) / _PER[match.group(2) or "s"]


def parse_time(value: str) -> datetime:
    parsed = parse_datetime(value)
    if parsed is None:
        day = parse_date(value)
        if day is None:
            raise ValueError(f"{value!r} is not a date or an ISO 8601 time")
        parsed = datetime(day.year, day.month, day.day)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "--"
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class ProgressBar:
    """One line, redrawn in place on a terminal; on a pipe, a line every few seconds."""

    WIDTH = 24

    def __init__(self, stream, *, every: float = 2.0) -> None:
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.every = every
        self._last = 0.0

    def show(self, line_fn, *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and not self.tty and now - self._last < self.every:
            return
        self._last = now
        line = line_fn()
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    @classmethod
    def bar(cls, fraction: float) -> str:
        done = int(fraction * cls.WIDTH)
        return "[" + "#" * done + "-" * (cls.WIDTH - done) + "]"


DEFAULT_RATE = "2/s"


class Command(BaseCommand):
    help = (
        "Read a window of a poll source's history into inbound events: rate limited, "
        "checkpointed after every page, resumable (--resume RUN). See docs/polling.md."
    )

    def add_arguments(self, parser):
        parser.add_argument("source", help="The poll source's slug.")
        parser.add_argument("--since", help="Start of the window (ISO 8601 time or date).")
        parser.add_argument("--until", help="End of the window, exclusive (default: now).")
        parser.add_argument(
            "--rate", help=f"Requests at most, e.g. 5/s, 120/m (default {DEFAULT_RATE})."
        )
        parser.add_argument("--page-size", type=int, help="Records per request.")
        parser.add_argument("--dry-run", action="store_true", help="Read and count; store nothing.")
        parser.add_argument("--resume", metavar="RUN", help="Resume a run from its checkpoint.")

    def handle(self, *args, source, since, until, rate, page_size, dry_run, resume, **options):
        stop = StopFlag()
        stop.install()
        self.bar = ProgressBar(getattr(self.stderr, "_out", sys.stderr))
        try:
            if resume:
                if since or until or dry_run or rate or page_size:
                    raise CommandError(
                        "--resume goes on with the run's own window, rate and page size; "
                        "drop --since/--until/--rate/--page-size/--dry-run"
                    )
                run = self._run_for(resume, source)
                start = run.checkpoint_at or run.since
                self.stdout.write(f"Resuming backfill {run.id} from {start.isoformat()}")
            else:
                if not since:
                    raise CommandError("--since is required (or --resume RUN)")
                window = (parse_time(since), parse_time(until) if until else None)
                per_second = parse_rate(rate or DEFAULT_RATE)
                if dry_run:
                    return self._dry_run(source, window, per_second, page_size, stop)
                run = backfill_run_create(
                    slug=source,
                    since=window[0],
                    until=window[1],
                    rate=per_second,
                    page_size=page_size,
                )
                self.stdout.write(
                    f"Backfill {run.id}: {source} from {run.since.isoformat()} until "
                    f"{run.until.isoformat()} at {run.rate:g} requests/s, {run.page_size} a page"
                )
            self.stdout.flush()
            segment = backfill_run_execute(
                run_id=run.id,
                should_stop=lambda: stop.is_set,
                on_page=lambda seg: self.bar.show(lambda: self._line(seg)),
            )
        except (BackfillError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        self.bar.show(lambda: self._line(segment), final=True)
        self._summary(segment)
        if segment.run.state == "failed":
            raise CommandError(f"backfill {segment.run.id} failed: {segment.run.error}")

    def _run_for(self, run_id: str, source: str) -> BackfillRun:
        try:
            run = BackfillRun.objects.select_related("source__source").get(id=run_id)
        except (BackfillRun.DoesNotExist, ValueError, Exception):
            raise CommandError(f"no backfill run {run_id!r}") from None
        if run.source.source.slug != source:
            raise CommandError(f"run {run.id} backfills {run.source.source.slug}, not {source}")
        return run

    def _line(self, segment) -> str:
        run, counts = segment.run, segment.counts
        p = backfill_progress(
            run,
            processed=segment.processed_before + counts["processed"],
            requests=segment.requests_before + counts["requests"],
            active_seconds=segment.active_before + segment.elapsed,
            checkpoint=segment.checkpoint,
            total=segment.total,
        )
        rps = counts["requests"] / segment.elapsed if segment.elapsed > 0 else 0.0
        at = f"{p.checkpoint:%Y-%m-%dT%H:%M:%SZ}" if p.checkpoint else "-"
        records = f"{p.processed:,} of {p.total:,}" if p.total else f"{p.processed:,}"
        return (
            f"{ProgressBar.bar(p.fraction)} {p.fraction:6.1%}  {records} records  "
            f"{p.records_per_second:,.0f} rec/s  {rps:.2f} req/s  ETA {duration(p.eta_seconds)}"
            f"  at {at}"
        )

    def _summary(self, segment) -> None:
        run, c = segment.run, segment.counts
        rate = c["requests"] / segment.elapsed if segment.elapsed > 0 else 0.0
        self.stdout.write(
            f"Backfill {run.id} {run.state}: {run.processed:,} records read, "
            f"{run.stored:,} stored, "
            f"{run.duplicates:,} already there, {run.pages:,} pages, {run.requests:,} requests. "
            f"This run: {c['processed']:,} records, {c['requests']:,} requests in "
            f"{duration(segment.elapsed)} ({rate:.2f} requests/s, limit {run.rate:g}/s)."
        )
        if run.state == "interrupted":
            self.stdout.write(
                f"Resume with: manage.py backfill {run.source.source.slug} --resume {run.id}"
            )

    def _dry_run(self, source, window, per_second, page_size, stop) -> None:
        started = time.monotonic()

        def line(counts):
            elapsed = time.monotonic() - started
            rate = counts["requests"] / elapsed if elapsed else 0.0
            return (
                f"dry run: {counts['processed']:,} records in {counts['pages']:,} pages, "
                f"{rate:.2f} req/s"
            )

        counts = backfill_dry_run(
            slug=source,
            since=window[0],
            until=window[1],
            rate=per_second,
            page_size=page_size,
            should_stop=lambda: stop.is_set,
            on_page=lambda c: self.bar.show(lambda: line(c)),
        )
        self.stdout.write(
            f"Dry run of {source}: {counts['processed']:,} records in {counts['pages']:,} pages "
            f"({counts['requests']:,} requests); {counts['new']:,} would be stored, "
            f"{counts['present']:,} are stored already. Nothing was written."
        )
