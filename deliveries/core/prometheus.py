"""Prometheus metrics at ``/metrics``: two sources, one scrape.

1. **Process counters and histograms** (attempts, dispatch latency, inbound receipts and
   refusals, handler durations, lease expiries…) are incremented by whichever process
   does the work: a gunicorn worker, the scheduler, the relay, a delivery worker. With
   ``PROMETHEUS_MULTIPROC_DIR`` set (the same directory for every process on a host)
   prometheus-client writes them to memory-mapped files there, and the scrape sums the
   files of all processes, living and dead. Without it, each process counts in its own
   registry and the scrape sees only the web process that answered.
2. **Database gauges** (deliveries by state, oldest due delivery, relay lag, queue depth,
   dead letters…) are computed at scrape time by the providers registered with
   ``register_provider``: fleet-wide truths read from the database, so they are right
   whichever host is scraped and however many hosts run loops. Each provider's queries
   use partial indexes and run under a statement timeout (``METRICS_DB_BUDGET_MS``); the
   result is cached for ``METRICS_CACHE_SECONDS`` per process, so a scrape every few
   seconds by several Prometheus servers costs one set of queries per cache period.

The catalogue of every metric is docs/observability.md.
"""

import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from django.db import connection, transaction
from django.db.models import Count
from django.http import HttpResponse, HttpResponseForbidden
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from deliveries.core.conf import settings

logger = logging.getLogger("deliveries.prometheus")

# --- Process counters and histograms ---------------------------------------------------

INBOUND_REFUSED = Counter(
    "webhooks_inbound_refused_total",
    "Inbound requests refused, by source and reason (signature failures, size, type, "
    "unparseable bodies).",
    ["source", "reason"],
)
INBOUND_SIGNATURE_FAILURES = Counter(
    "webhooks_inbound_signature_failures_total",
    "Inbound requests whose signature did not verify, by source and reason.",
    ["source", "reason"],
)
INBOUND_RECEIVED = Counter(
    "webhooks_inbound_received_total",
    "Authentic inbound requests stored, by source and whether they were duplicates.",
    ["source", "duplicate"],
)
INBOUND_EMAILS = Counter(
    "webhooks_inbound_emails_total",
    "Inbound emails by source and outcome, one per accepted recipient: accepted (stored "
    "for processing), duplicate (its Message-ID was stored for that recipient already), "
    "rejected (stored as evidence, never processed). Refusals are counted in "
    "webhooks_inbound_refused_total.",
    ["source", "outcome"],
)
INBOUND_HANDLER_DURATION = Histogram(
    "webhooks_inbound_handler_duration_seconds",
    "Time one registered inbound handler took on one event, by handler and outcome.",
    ["handler", "outcome"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
INBOUND_PROCESSED = Counter(
    "webhooks_inbound_processed_total",
    "Inbound events taken by a worker, by source and result (processed, skipped, stale, "
    "failed, entity_busy, held, lease_lost).",
    ["source", "result"],
)
ATTEMPTS = Counter(
    "webhooks_attempts_total",
    "Outbound delivery attempts by outcome and HTTP status class (2xx…5xx, or none when "
    "there was no answer).",
    ["outcome", "status_class"],
)
DISPATCH_DURATION = Histogram(
    "webhooks_dispatch_duration_seconds",
    "Duration of outbound attempts by endpoint (bounded: see METRICS_ENDPOINT_TOP_K); "
    "its _count is the dispatch rate.",
    ["endpoint"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30),
)
DISPATCH_FAILURES = Counter(
    "webhooks_dispatch_failures_total",
    "Outbound attempts that did not succeed, by endpoint (bounded like the histogram).",
    ["endpoint"],
)
DELIVERIES_FINISHED = Counter(
    "webhooks_deliveries_finished_total",
    "Deliveries that reached a terminal state in a worker, by state.",
    ["state"],
)
LEASE_EXPIRIES = Counter(
    "webhooks_lease_expiries_total",
    "Leases that ran out (the worker died or hung) and were returned by the scheduler, "
    "by job kind.",
    ["job"],
)
LOST_DISPATCHES = Counter(
    "webhooks_lost_dispatches_total",
    "Jobs that sat enqueued past SCHEDULER_STALE_ENQUEUED_SECONDS and were dispatched "
    "again, by job kind.",
    ["job"],
)
OPERATIONAL_EVENTS = Counter(
    "webhooks_operational_events_total",
    "Operational events (incidents) opened, by kind.",
    ["kind"],
)
EVENT_SCHEMA_MISMATCHES = Counter(
    "webhooks_event_schema_mismatches_total",
    "Published payloads that did not match their type's schema, by type and mode (reject: "
    "refused; warn: published anyway). Only catalogued types with a schema count.",
    ["event_type", "mode"],
)
TENANT_NOTIFICATIONS = Counter(
    "webhooks_tenant_notifications_total",
    "Notifications sent to tenants about their endpoints, by kind, channel and outcome.",
    ["kind", "channel", "outcome"],
)
PRUNED_ROWS = Counter(
    "webhooks_pruned_rows_total",
    "Rows deleted by retention, by table.",
    ["table"],
)


def status_class(status: int | None) -> str:
    return f"{status // 100}xx" if status else "none"


# --- Database gauges -------------------------------------------------------------------

Provider = Callable[[float], Iterable[Metric]]
PROVIDERS: dict[str, Provider] = {}


def add_state_counts(family, model, *, pending: str, in_flight: Iterable[str]) -> None:
    """Add one sample per state to ``family`` (labelled by state) for a job table with
    a partial index on its ``pending`` rows and one on its ``in_flight`` rows: each filter
    is exactly an index's condition, so the counts read only the rows that index holds
    (deliveries and inbound events alike)."""
    family.add_metric([pending], model.objects.filter(state=pending).count())
    in_flight = list(in_flight)
    counts = dict(
        model.objects.filter(state__in=in_flight)
        .values_list("state")
        .annotate(n=Count("pk"))
        .order_by()
    )
    for state in in_flight:
        family.add_metric([state], counts.get(state, 0))


def register_provider(name: str, provider: Provider) -> None:
    """Register a function ``provider(now: float) -> Iterable[Metric]`` (prometheus-client
    metric families, e.g. ``GaugeMetricFamily``) computed from the database at scrape
    time. It runs in its own transaction under ``METRICS_DB_BUDGET_MS``; if it fails, its
    families are left out and ``webhooks_metrics_provider_up{provider=name}`` is 0.

    Apps register from ``AppConfig.ready``: deliveries (deliveries/metrics.py), inbound
    (ingest/metrics.py), and any later app, polling and backfill progress included."""
    PROVIDERS[name] = provider


class DatabaseCollector:
    """Runs the providers, caching their families for METRICS_CACHE_SECONDS."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cached: list[Metric] = []
        self._at = float("-inf")

    def collect(self) -> list[Metric]:
        with self._lock:
            now = time.time()
            if now - self._at >= settings.METRICS_CACHE_SECONDS:
                self._cached = self._compute(now)
                self._at = now
            return self._cached

    def clear(self) -> None:
        with self._lock:
            self._at = float("-inf")

    def _compute(self, now: float) -> list[Metric]:
        families: list[Metric] = []
        up = GaugeMetricFamily(
            "webhooks_metrics_provider_up",
            "1 when the database gauges of this provider were computed at the last refresh.",
            labels=["provider"],
        )
        for name, provider in PROVIDERS.items():
            try:
                families.extend(_run_provider(provider, now))
                up.add_metric([name], 1)
            except Exception as exc:  # a broken provider must not break the scrape
                logger.warning(
                    "metrics provider failed",
                    extra={
                        "action": "metrics.provider_failed",
                        "provider": name,
                        "error": str(exc),
                    },
                )
                up.add_metric([name], 0)
        families.append(up)
        return families


def _run_provider(provider: Provider, now: float) -> list[Metric]:
    if connection.vendor != "postgresql":
        return list(provider(now))
    with connection.cursor() as cursor:
        cursor.execute("SHOW statement_timeout")
        previous = cursor.fetchone()[0]
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = %s", [settings.METRICS_DB_BUDGET_MS])
            return list(provider(now))
    finally:
        # SET LOCAL outlives a released savepoint: restore it for an enclosing transaction.
        if connection.in_atomic_block and not connection.needs_rollback:
            with connection.cursor() as cursor:
                cursor.execute("SELECT set_config('statement_timeout', %s, true)", [previous])


DATABASE_COLLECTOR = DatabaseCollector()


# --- The view --------------------------------------------------------------------------


# Headers a proxy adds to what it relays. A relayed request's REMOTE_ADDR is the proxy's
# (loopback, for one on the same host), not the client's.
PROXY_HEADERS = ("X-Forwarded-For", "Forwarded", "X-Real-IP")


def _allowed(request) -> bool:
    """A Bearer METRICS_TOKEN, or an address in METRICS_ALLOW_IPS on a request that no
    proxy relayed."""
    token = settings.METRICS_TOKEN
    offered = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if token and hmac.compare_digest(offered.encode(), token.encode()):
        return True
    if any(name in request.headers for name in PROXY_HEADERS):
        return False
    return request.META.get("REMOTE_ADDR") in settings.METRICS_ALLOW_IPS


def render() -> bytes:
    """The exposition text: process metrics (summed over the multiprocess directory when
    there is one) followed by the database gauges."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)
        process = generate_latest(registry)
    else:
        process = generate_latest(REGISTRY)
    database = CollectorRegistry()
    database.register(DATABASE_COLLECTOR)
    return process + generate_latest(database)


def metrics_view(request):
    """``/metrics``: allowed for a Bearer METRICS_TOKEN, or from METRICS_ALLOW_IPS
    directly (docs/observability.md, "Scraping /metrics")."""
    if not _allowed(request):
        return HttpResponseForbidden("forbidden\n", content_type="text/plain")
    return HttpResponse(render(), content_type=CONTENT_TYPE_LATEST)
