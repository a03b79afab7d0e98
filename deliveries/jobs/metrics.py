"""The background jobs' Prometheus metrics. They live here, in the machinery, because
the worker that counts runs (``runner``) may import no product module, and
``deliveries.core.prometheus`` is the deliveries app's: these are plain prometheus-client
metrics, so the ``/metrics`` view exposes them with the rest (summed over
``PROMETHEUS_MULTIPROC_DIR`` like every process metric). The database gauges,
``job_gauges``, are registered with ``deliveries.core.prometheus.register_provider`` by the
deliveries app at start, and computed at scrape time like its own.

Labels are bounded: ``type`` is a type registered with ``@job`` in the process (any
other is ``unknown``), ``queue`` what the pending jobs name. Catalogue:
docs/observability.md."""

from collections import Counter as CountOf
from collections.abc import Iterable
from datetime import UTC, datetime

from django.db.models import Count, Min, Q
from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from .background.registry import JOB_TYPES
from .models import Job, JobState

JOB_RUNS = Counter(
    "webhooks_job_runs_total",
    "Background job runs recorded by run_jobs, by job type and outcome (done, retry, "
    "error, timeout, failed, unreadable, released).",
    ["type", "outcome"],
)
JOB_RUN_DURATION = Histogram(
    "webhooks_job_run_duration_seconds",
    "Duration of background job runs, by job type.",
    ["type"],
    buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600),
)


def type_label(job_type: str) -> str:
    return job_type if job_type in JOB_TYPES else "unknown"


def count_runs(runs: Iterable[tuple[str, str, float]]) -> None:
    """Recorded runs, each (job type, outcome, seconds), as ``runner`` records a batch:
    the label lookups and the counter's increment once per type and outcome, the
    durations observed one by one. A job given back for a busy entity lock (outcome "")
    is no run."""
    durations: dict[tuple[str, str], list[float]] = {}
    for job_type, outcome, seconds in runs:
        if outcome:
            durations.setdefault((job_type, outcome), []).append(seconds)
    for (job_type, outcome), seconds in durations.items():
        label = type_label(job_type)
        JOB_RUNS.labels(label, outcome).inc(len(seconds))
        histogram = JOB_RUN_DURATION.labels(label)
        for value in seconds:
            histogram.observe(value)


def job_gauges(now: float) -> Iterable[Metric]:
    """Depth and oldest due age per queue, and dead jobs by type. The pending figures
    read the partial index job_claimable (queue, priority, run_at: an index-only scan);
    the dead ones the partial index job_dead."""
    now_dt = _utc(now)
    depth = GaugeMetricFamily(
        "webhooks_job_queue_depth",
        "Pending background jobs per queue: due (run_at passed) or scheduled (later).",
        labels=["queue", "due"],
    )
    oldest = GaugeMetricFamily(
        "webhooks_job_oldest_due_age_seconds",
        "How long the oldest due pending job of a queue has been due (0: none is due). "
        "Grows when no run_jobs serves the queue or its workers are full.",
        labels=["queue"],
    )
    rows = (
        Job.objects.filter(state=JobState.PENDING)
        .values("queue")
        .annotate(
            due=Count("run_at", filter=Q(run_at__lte=now_dt)),
            total=Count("*"),
            first=Min("run_at", filter=Q(run_at__lte=now_dt)),
        )
        .order_by()
    )
    for row in rows:
        depth.add_metric([row["queue"], "yes"], row["due"])
        depth.add_metric([row["queue"], "no"], row["total"] - row["due"])
        first = row["first"]
        oldest.add_metric([row["queue"]], max(0.0, now - first.timestamp()) if first else 0.0)
    yield depth
    yield oldest

    dead = GaugeMetricFamily(
        "webhooks_jobs_dead",
        "Dead background jobs by type, cancelled ones included (index job_dead).",
        labels=["type"],
    )
    by_type = CountOf()
    for job_type, n in (
        Job.objects.filter(state=JobState.DEAD)
        .values_list("type")
        .annotate(n=Count("*"))
        .order_by()
    ):
        by_type[type_label(job_type)] += n
    for label, n in sorted(by_type.items()):
        dead.add_metric([label], n)
    yield dead


def _utc(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)
