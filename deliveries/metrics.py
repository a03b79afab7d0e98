"""The outbound side's database gauges (registered with ``deliveries.core.prometheus``) and the
bounded endpoint label of the dispatch metrics.

Every query here reads a partial index, so its cost follows the rows that matter now
(due, in flight, unpublished, dead), not the size of the history.
"""

import contextlib
import threading
import time
import uuid
from collections.abc import Iterable

from django.db.models import Count, Max
from prometheus_client.core import GaugeMetricFamily, Metric

from deliveries.core.conf import settings
from deliveries.core.prometheus import add_state_counts

from .jobs.brokers import get_broker
from .jobs.models import LoopRun, Outbox
from .models import Delivery, DeliveryState
from .statements import admit, reads

OTHER = "other"


def delivery_gauges(now: float) -> Iterable[Metric]:
    by_state = GaugeMetricFamily(
        "webhooks_deliveries",
        "Deliveries by state, for the states that are not history: pending (index "
        "delivery_due), enqueued and leased (delivery_in_flight), dead (delivery_dead). "
        "Succeeded deliveries are counted by webhooks_deliveries_finished_total.",
        labels=["state"],
    )
    add_state_counts(
        by_state,
        Delivery,
        pending=DeliveryState.PENDING,
        in_flight=[DeliveryState.ENQUEUED, DeliveryState.LEASED],
    )
    dead = dict(
        Delivery.objects.filter(state=DeliveryState.DEAD)
        .values_list("last_outcome")
        .annotate(n=Count("id"))
        .order_by()
    )
    by_state.add_metric(["dead"], sum(dead.values()))
    yield by_state

    dead_letters = GaugeMetricFamily(
        "webhooks_dead_letters",
        "Dead deliveries (the dead-letter view) by last outcome; from the index "
        "delivery_dead, which includes last_outcome.",
        labels=["outcome"],
    )
    for outcome, n in sorted(dead.items()):
        dead_letters.add_metric([outcome or "unknown"], n)
    yield dead_letters

    (oldest,) = reads.OLDEST_DUE()
    age = max(0.0, now - oldest.timestamp()) if oldest is not None else 0.0
    yield GaugeMetricFamily(
        "webhooks_oldest_due_delivery_age_seconds",
        "How long the oldest due pending delivery has been due (0: none is due). Grows "
        "when the scheduler is not running, ceilings hold work back, or a paused "
        "endpoint holds its deliveries (webhooks_endpoints_paused).",
        value=age,
    )
    yield GaugeMetricFamily(
        "webhooks_endpoints_paused",
        "Endpoints paused: their pending deliveries are held until they are resumed. "
        "Index endpoint_paused.",
        value=len(admit.PAUSED_ENDPOINTS()),
    )

    unpublished = Outbox.objects.filter(published_at__isnull=True)
    first = unpublished.order_by("id").values_list("created_at", flat=True).first()
    yield GaugeMetricFamily(
        "webhooks_outbox_relay_lag_seconds",
        "Age of the oldest unpublished outbox row (0: none); grows when no worker takes "
        "the rows (database broker) or the relay is not running or the broker refuses "
        "(other brokers). Index outbox_unpublished.",
        value=max(0.0, now - first.timestamp()) if first is not None else 0.0,
    )
    yield GaugeMetricFamily(
        "webhooks_outbox_unpublished",
        "Outbox rows not yet taken by a worker (database broker) or published to the "
        "broker (other brokers). Index outbox_unpublished.",
        value=unpublished.count(),
    )

    b = get_broker()
    depth = GaugeMetricFamily(
        "webhooks_queue_depth",
        "Messages on the broker: visible (waiting for a worker) and invisible (taken, "
        "not yet acknowledged; brokers that cannot tell leave it out).",
        labels=["queue", "visibility"],
    )
    depth.add_metric([b.list_key, "visible"], b.queue_size() or 0)
    with contextlib.suppress(NotImplementedError, AttributeError, TypeError):
        invisible = b.lock_size()
        if invisible is not None:
            depth.add_metric([b.list_key, "invisible"], invisible)
    yield depth

    beats = GaugeMetricFamily(
        "webhooks_loop_heartbeat_age_seconds",
        "Seconds since the freshest heartbeat of a long-running command (scheduler, relay, "
        "workers, poll loop, run_jobs), refreshed every LOOP_HEARTBEAT_SECONDS while it "
        "runs, busy or idle (absent: none has run). Index looprun_kind_started.",
        labels=["kind"],
    )
    for kind in LoopRun.Kind.values:
        recent = LoopRun.objects.filter(kind=kind).order_by("-started_at")[:50]
        latest = LoopRun.objects.filter(id__in=recent.values("id")).aggregate(
            m=Max("heartbeat_at")
        )["m"]
        if latest is not None:
            beats.add_metric([kind], max(0.0, now - latest.timestamp()))
    yield beats


class EndpointLabels:
    """The ``endpoint`` label of the dispatch metrics, with bounded cardinality.

    An endpoint gets its own label if it is listed in METRICS_ENDPOINTS, or if it was
    among the METRICS_ENDPOINT_TOP_K endpoints with the most deliveries in flight when
    this process looked (every ``refresh_every`` seconds, from the delivery_in_flight
    index). The automatic set only grows, up to K, and is kept for the process's life,
    so one process never writes more than K + len(METRICS_ENDPOINTS) + 1 series per
    metric; every other endpoint is counted as "other"."""

    def __init__(self, refresh_every: float = 60.0) -> None:
        self.refresh_every = refresh_every
        self._auto: set[str] = set()
        self._next = 0.0
        self._lock = threading.Lock()

    def label(self, endpoint_id: uuid.UUID) -> str:
        key = str(endpoint_id)
        if key in self._auto or key in settings.METRICS_ENDPOINTS:
            return key
        return OTHER

    def refresh_if_due(self) -> None:
        """Look for the busiest endpoints (database access: call it from a DB thread)."""
        k = settings.METRICS_ENDPOINT_TOP_K
        now = time.monotonic()
        if k <= 0 or len(self._auto) >= k or now < self._next:
            return
        with self._lock:
            self._next = now + self.refresh_every
            busiest = (
                Delivery.objects.filter(state__in=[DeliveryState.ENQUEUED, DeliveryState.LEASED])
                .values_list("endpoint_id")
                .annotate(n=Count("id"))
                .order_by("-n")[:k]
            )
            for endpoint_id, _ in busiest:
                if len(self._auto) >= k:
                    break
                self._auto.add(str(endpoint_id))


ENDPOINT_LABELS = EndpointLabels()
