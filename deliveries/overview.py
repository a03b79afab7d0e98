"""Reads for the console's overview: is anything wrong, where, since when.

Every figure comes from a table built for it or from a partial index, so the page costs
the same at a thousand deliveries as at millions:

- attempts per minute by outcome, and each endpoint's success rate and latency
  percentiles over the last 24 hours, from the tallies the workers keep as they record
  (models.AttemptMinute, EndpointHour): at most 1,440 minutes, and 24 hours per endpoint;
- dead letters by reason (the partial index delivery_dead) and their trend by the hour;
- the queue: deliveries due and in flight, broker depth, oldest due age, relay lag;
- the loops' heartbeats (looprun_kind_started);
- panels other apps register (``deliveries.core.console.register_panel``): inbound
  receipts and refusals come from ingest, which deliveries does not import.
"""

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Count, Sum
from django.db.models.functions import Trunc

from .jobs.brokers import get_broker
from .jobs.models import LoopRun, Outbox
from .models import (
    LATENCY_BOUNDS_MS,
    LATENCY_COLUMNS,
    AttemptMinute,
    Delivery,
    DeliveryState,
    Endpoint,
    EndpointHour,
    Outcome,
)
from .selectors import loop_stale_after
from .statements import admit, reads

WINDOW = timedelta(hours=24)

# The chart's series: which outcomes each counts, and what it is called. One chart per
# series, each with its own title, so that none is told apart by colour alone.
SERIES = (
    ("delivered", "Delivered", (Outcome.SUCCESS,)),
    ("retried", "Failed, to be retried", (Outcome.RETRY,)),
    (
        "failed",
        "Failed for good (refused, gone, blocked)",
        (Outcome.PERMANENT, Outcome.ENDPOINT_GONE, Outcome.BLOCKED),
    ),
)
FAILURES = frozenset(o for _, _, outcomes in SERIES[1:] for o in outcomes)


@dataclass
class Minutes:
    """Attempts per minute over the window, one list of 1,440 counts per series."""

    start: datetime
    series: dict[str, list[int]]

    def total(self, name: str) -> int:
        return sum(self.series[name])


def attempts_by_minute(now: datetime) -> Minutes:
    """The tallies of the last 24 hours (by the tally's unique key, which leads with the
    minute), one count per minute and series; minutes without attempts are 0."""
    end = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - WINDOW
    slots = int(WINDOW.total_seconds() // 60)
    series = {name: [0] * slots for name, _, _ in SERIES}
    of_outcome = {o: name for name, _, outcomes in SERIES for o in outcomes}
    rows = (
        AttemptMinute.objects.filter(minute__gte=start, minute__lt=end)
        .values_list("minute", "outcome")
        .annotate(n=Sum("attempts"))
        .order_by()
    )
    for minute, outcome, n in rows:
        name = of_outcome.get(outcome)
        if name is not None:
            series[name][int((minute - start).total_seconds() // 60)] += n
    return Minutes(start, series)


def percentile(histogram: list[int], fraction: float) -> str:
    """The bucket bound under which ``fraction`` of the attempts fell: "≤ 200 ms",
    "> 30 s"; "—" without attempts."""
    total = sum(histogram)
    if not total:
        return "—"
    wanted = math.ceil(fraction * total)
    seen = 0
    for bound, n in zip(LATENCY_BOUNDS_MS, histogram, strict=False):
        seen += n
        if seen >= wanted:
            return f"≤ {bound:,} ms" if bound < 1000 else f"≤ {bound / 1000:g} s"
    return f"> {LATENCY_BOUNDS_MS[-1] / 1000:g} s"


@dataclass
class EndpointHealth:
    endpoint: Endpoint
    attempts: int = 0
    delivered: int = 0
    failures: int = 0
    mean_ms: float | None = None
    histogram: list[int] = field(default_factory=lambda: [0] * len(LATENCY_COLUMNS))
    dead: int = 0

    @property
    def success_rate(self) -> float | None:
        return self.delivered / self.attempts if self.attempts else None

    @property
    def p50(self) -> str:
        return percentile(self.histogram, 0.50)

    @property
    def p95(self) -> str:
        return percentile(self.histogram, 0.95)

    @property
    def state(self) -> str:
        e = self.endpoint
        if not e.enabled:
            return "disabled"
        if e.paused_at is not None:
            return "paused"
        return "failing" if e.failing_since else "running"

    @property
    def badness(self) -> tuple:
        """Sort key, worst first: disabled and failing endpoints, then by the share of
        attempts that failed, then by dead letters, then by failures."""
        share = self.failures / self.attempts if self.attempts else 0.0
        troubled = self.state in ("disabled", "failing") or share > 0 or self.dead > 0
        return (not troubled, -share, -self.dead, -self.failures, str(self.endpoint.url))


def endpoint_tallies(now: datetime, endpoint_ids=None) -> dict:
    """Each endpoint's attempts of the last 24 hours (from the hour the window starts in)
    from EndpointHour: {endpoint id: {"attempts", "delivered", "failures", "ms",
    "histogram"}}; ``endpoint_ids`` narrows it (the endpoint list's page)."""
    since = (now - WINDOW).replace(minute=0, second=0, microsecond=0)
    sums = {c: Sum(c) for c in LATENCY_COLUMNS}
    found: dict = {}
    rows = EndpointHour.objects.filter(hour__gte=since)
    if endpoint_ids is not None:
        rows = rows.filter(endpoint_id__in=list(endpoint_ids))
    rows = (
        rows.values("endpoint_id", "outcome")
        .annotate(n=Sum("attempts"), ms=Sum("total_ms"), **sums)
        .order_by()
    )
    for row in rows:
        h = found.setdefault(row["endpoint_id"], {"attempts": 0, "delivered": 0, "failures": 0})
        h["attempts"] += row["n"]
        h["ms"] = h.get("ms", 0.0) + (row["ms"] or 0.0)
        if row["outcome"] == Outcome.SUCCESS:
            h["delivered"] += row["n"]
        elif row["outcome"] in FAILURES:
            h["failures"] += row["n"]
        hist = h.setdefault("histogram", [0] * len(LATENCY_COLUMNS))
        for i, column in enumerate(LATENCY_COLUMNS):
            hist[i] += row[column] or 0
    return found


def health_of(endpoint: Endpoint, tallies: dict, dead: int = 0) -> EndpointHealth:
    h = tallies.get(endpoint.id, {})
    attempts = h.get("attempts", 0)
    return EndpointHealth(
        endpoint=endpoint,
        attempts=attempts,
        delivered=h.get("delivered", 0),
        failures=h.get("failures", 0),
        mean_ms=h["ms"] / attempts if attempts else None,
        histogram=h.get("histogram", [0] * len(LATENCY_COLUMNS)),
        dead=dead,
    )


def endpoint_health(now: datetime, *, limit: int = 20) -> list[EndpointHealth]:
    """The endpoints with attempts, dead letters or trouble, worst first (``badness``):
    their tallies (``endpoint_tallies``), and the dead letters by endpoint from the
    delivery_dead index."""
    found = endpoint_tallies(now)
    dead = dict(
        Delivery.objects.filter(state=DeliveryState.DEAD)
        .values_list("endpoint_id")
        .annotate(n=Count("*"))
        .order_by()
    )
    # Endpoints in trouble show even without attempts in the window.
    troubled = Endpoint.objects.filter(enabled=False) | Endpoint.objects.filter(
        failing_since__isnull=False
    )
    ids = set(found) | set(dead) | set(troubled.values_list("id", flat=True)[:200])
    endpoints = Endpoint.objects.select_related("tenant").in_bulk(ids)
    health = [health_of(e, found, dead.get(i, 0)) for i, e in endpoints.items()]
    health.sort(key=lambda e: e.badness)
    return health[:limit]


@dataclass
class DeadLetters:
    total: int
    by_reason: list[tuple[str, int]]
    # Deliveries that went dead in each hour of the window, oldest first.
    by_hour: list[int]
    hours_start: datetime


def dead_letters(now: datetime) -> DeadLetters:
    """By reason, and the last 24 hours' deaths by the hour: both from the partial index
    delivery_dead (its rows hold finished_at and last_outcome)."""
    dead = Delivery.objects.filter(state=DeliveryState.DEAD)
    by_reason = list(
        dead.values_list("last_outcome").annotate(n=Count("*")).order_by("-n", "last_outcome")
    )
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    start = end - WINDOW
    by_hour = [0] * 24
    hours = (
        dead.filter(finished_at__gte=start)
        .annotate(hour=Trunc("finished_at", "hour"))
        .values_list("hour")
        .annotate(n=Count("*"))
        .order_by()
    )
    for hour, n in hours:
        slot = int((hour - start).total_seconds() // 3600)
        if 0 <= slot < 24:
            by_hour[slot] += n
    return DeadLetters(sum(n for _, n in by_reason), by_reason, by_hour, start)


@dataclass
class Queue:
    due: int
    waiting: int
    held: int
    in_flight: int
    depth: int | None
    oldest_due_seconds: float
    relay_lag_seconds: float
    unpublished: int
    paused_endpoints: int


def queue(now: datetime) -> Queue:
    """The pipeline's backlog right now, each figure from a partial index: pending due and
    waiting (delivery_due), held by paused endpoints, in flight (delivery_in_flight), the
    broker's depth, the oldest due delivery, the relay's lag (outbox_unpublished)."""
    pending = Delivery.objects.filter(state=DeliveryState.PENDING)
    due = _capped(pending.filter(next_attempt_at__lte=now))
    waiting = _capped(pending.filter(next_attempt_at__gt=now))
    paused = [e for (e,) in admit.PAUSED_ENDPOINTS()]
    held = _capped(pending.filter(endpoint_id__in=paused)) if paused else 0
    in_flight = Delivery.objects.filter(
        state__in=[DeliveryState.ENQUEUED, DeliveryState.LEASED]
    ).count()
    (oldest,) = reads.OLDEST_DUE()
    unpublished = Outbox.objects.filter(published_at__isnull=True)
    first = unpublished.order_by("id").values_list("created_at", flat=True).first()

    try:
        depth = get_broker().queue_size()
    except Exception:  # a broker that is down must not take the page with it: unknown
        depth = None
    return Queue(
        due=due,
        waiting=waiting,
        held=held,
        in_flight=in_flight,
        depth=depth,
        oldest_due_seconds=max(0.0, (now - oldest).total_seconds()) if oldest else 0.0,
        relay_lag_seconds=max(0.0, (now - first).total_seconds()) if first else 0.0,
        unpublished=_capped(unpublished),
        paused_endpoints=len(paused),
    )


# Counts past this are shown as "at least" it: counting a backlog of millions row by row
# would cost the page more than knowing its exact size is worth.
COUNT_CAP = 100_000


def _capped(queryset) -> int:
    return queryset.order_by()[: COUNT_CAP + 1].count()


@dataclass
class Loop:
    kind: str
    run: LoopRun | None
    alive: bool


def loops(now: datetime) -> list[Loop]:
    """Each kind of long-running command: its freshest run, and whether it beats."""
    shown = []
    for kind in LoopRun.Kind.values:
        run = LoopRun.objects.filter(kind=kind).order_by("-started_at").first()
        if run is not None and run.finished_at is None:
            # The freshest heartbeat among the open runs of this kind (several processes).
            freshest = (
                LoopRun.objects.filter(kind=kind, finished_at__isnull=True)
                .order_by("-heartbeat_at")
                .first()
            )
            run = freshest or run
        alive = (
            run is not None
            and run.finished_at is None
            and run.heartbeat_at >= now - loop_stale_after()
        )
        shown.append(Loop(kind, run, alive))
    return shown


# --- Panels of other apps --------------------------------------------------------------
