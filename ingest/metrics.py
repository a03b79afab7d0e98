"""The inbound side's database gauges, registered with ``deliveries.core.prometheus``."""

from collections.abc import Iterable

from django.db.models import Count
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from deliveries.core.prometheus import add_state_counts

from .models import (
    BackfillRun,
    BackfillState,
    InboundEvent,
    InboundState,
    PollSource,
    VerificationFailure,
)
from .selectors import backfill_progress


def inbound_gauges(now: float) -> Iterable[Metric]:
    events = GaugeMetricFamily(
        "webhooks_inbound_events",
        "Inbound events waiting or being processed, by state: pending (index "
        "inbound_due), enqueued and processing (inbound_in_flight).",
        labels=["state"],
    )
    add_state_counts(
        events,
        InboundEvent,
        pending=InboundState.PENDING,
        in_flight=[InboundState.ENQUEUED, InboundState.PROCESSING],
    )
    yield events

    # One row per (source, reason), kept by every web process: the fleet-wide count,
    # surviving restarts, unlike the per-process webhooks_inbound_refused_total.
    failures = CounterMetricFamily(
        "webhooks_inbound_verification_failures",
        "Refused inbound requests recorded in the database since the source existed, by "
        "source and reason (signature reasons, too_large, content_type, unparseable_*).",
        labels=["source", "reason"],
    )
    for slug, reason, count in VerificationFailure.objects.values_list(
        "source__slug", "reason", "count"
    ).order_by("source__slug", "reason"):
        failures.add_metric([slug, reason], count)
    yield failures


# Backfill runs shown one by one (label `run`): the newest this many unfinished ones.
BACKFILL_RUNS_SHOWN = 20


def polling_gauges(now: float) -> Iterable[Metric]:
    """Poll sources' cursors and the backfill runs' progress. One row per poll source
    (a handful) and at most BACKFILL_RUNS_SHOWN runs (index backfill_created)."""
    cursor_age = GaugeMetricFamily(
        "webhooks_poll_cursor_age_seconds",
        "Age of each poll source's data cursor (the newest updated_at stored); grows when "
        "the provider has no changes or the poller stopped.",
        labels=["source"],
    )
    run_age = GaugeMetricFamily(
        "webhooks_poll_last_run_age_seconds",
        "Seconds since each poll source's last poll run finished.",
        labels=["source"],
    )
    last_records = GaugeMetricFamily(
        "webhooks_poll_last_run_records",
        "What the last poll run did with the records it read (stored, duplicates, ...).",
        labels=["source", "outcome"],
    )
    for slug, cursor_at, last_poll_at, counts in PollSource.objects.values_list(
        "source__slug", "cursor_at", "last_poll_at", "last_poll_counts"
    ).order_by("source__slug"):
        if cursor_at is not None:
            cursor_age.add_metric([slug], now - cursor_at.timestamp())
        if last_poll_at is not None:
            run_age.add_metric([slug], now - last_poll_at.timestamp())
        for outcome, n in sorted((counts or {}).items()):
            if isinstance(n, int | float):
                last_records.add_metric([slug, outcome], n)
    yield cursor_age
    yield run_age
    yield last_records

    runs = GaugeMetricFamily("webhooks_backfill_runs", "Backfill runs by state.", labels=["state"])
    by_state = dict(BackfillRun.objects.values_list("state").annotate(n=Count("id")).order_by())
    for state in BackfillState.values:
        runs.add_metric([state], by_state.get(state, 0))
    yield runs

    records = GaugeMetricFamily(
        "webhooks_backfill_records",
        "Records of an unfinished backfill run: processed (read in the window), stored "
        "(new inbound events), duplicates (already stored).",
        labels=["run", "source", "kind"],
    )
    progress = GaugeMetricFamily(
        "webhooks_backfill_progress_ratio",
        "How far an unfinished backfill run is through its window (0 to 1): records "
        "processed over the provider's total when it gives one, else the checkpoint's "
        "position in the time window.",
        labels=["run", "source"],
    )
    rate = GaugeMetricFamily(
        "webhooks_backfill_rate",
        "Records per second an unfinished backfill run has processed while running.",
        labels=["run", "source"],
    )
    eta = GaugeMetricFamily(
        "webhooks_backfill_eta_seconds",
        "Seconds a running backfill still needs at its rate so far.",
        labels=["run", "source"],
    )
    unfinished = (
        BackfillRun.objects.exclude(state=BackfillState.COMPLETED)
        .select_related("source__source")
        .order_by("-created_at")[:BACKFILL_RUNS_SHOWN]
    )
    for run in unfinished:
        labels = [str(run.id), run.source.source.slug]
        for kind in ("processed", "stored", "duplicates"):
            records.add_metric([*labels, kind], getattr(run, kind))
        state = backfill_progress(run)
        progress.add_metric(labels, state.fraction)
        rate.add_metric(labels, state.records_per_second)
        if state.eta_seconds is not None:
            eta.add_metric(labels, state.eta_seconds)
    yield records
    yield progress
    yield rate
    yield eta
