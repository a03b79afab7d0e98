"""The overview's figures: the tallies the workers keep as they record, and what the
overview reads from them and from the partial indexes."""

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Count, Sum
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from deliveries import overview, services, state
from deliveries.core import charts
from deliveries.core.retry import RetryPolicy
from deliveries.models import (
    LATENCY_COLUMNS,
    Attempt,
    AttemptMinute,
    Delivery,
    EndpointHour,
    Tenant,
)
from deliveries.policy import Classification
from deliveries.scheduler import scheduler_tick
from deliveries.statements import worker
from tests.conftest import drain, in_thread
from tests.receiver import always, fail_first

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


def tallied_minutes() -> dict:
    return dict(AttemptMinute.objects.values_list("outcome").annotate(n=Sum("attempts")).order_by())


def test_the_tallies_count_every_attempt_the_workers_record(tenant, receiver, settings):
    settings.DELIVERY_RETRY_SCHEDULE = [0]
    receiver.behaviours["/flaky"] = fail_first(1)
    receiver.behaviours["/no"] = always(400)
    ok, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    flaky, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/flaky"))
    refused, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/no"))
    for i in range(6):
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
    drain()

    by_outcome = dict(Attempt.objects.values_list("outcome").annotate(n=Count("id")).order_by())
    assert by_outcome == {"success": 12, "retry": 6, "permanent": 6}
    assert tallied_minutes() == by_outcome
    hours = {
        (row["endpoint_id"], row["outcome"]): row
        for row in EndpointHour.objects.values("endpoint_id", "outcome").annotate(
            n=Sum("attempts"), ms=Sum("total_ms"), **{c: Sum(c) for c in LATENCY_COLUMNS}
        )
    }
    for (endpoint_id, outcome), row in hours.items():
        attempts = Attempt.objects.filter(endpoint_id=endpoint_id, outcome=outcome)
        assert row["n"] == attempts.count()
        assert row["ms"] == pytest.approx(attempts.aggregate(s=Sum("duration_ms"))["s"])
        assert sum(row[c] for c in LATENCY_COLUMNS) == row["n"]  # each in one bucket
    assert set(hours) == {
        (ok.id, "success"),
        (flaky.id, "retry"),
        (flaky.id, "success"),
        (refused.id, "permanent"),
    }


def test_a_batch_is_tallied_into_its_minute_hour_and_latency_bucket(tenant, make_endpoint):
    """Attempts of one batch that started in two minutes, with latencies on each side of
    a bucket's bound, tallied by the one statement; a second batch adds to the rows."""
    endpoint = make_endpoint("http://127.0.0.1:9/x")
    for i in range(4):
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
    scheduler_tick()
    ids = list(Delivery.objects.order_by("id").values_list("id", flat=True))
    now = timezone.now().replace(minute=30, second=0, microsecond=0)
    leased, _ = state.lease([(i, 1) for i in ids], now=now, lease_seconds=60)
    starts = [now - timedelta(seconds=1), now, now, now + timedelta(seconds=59)]
    durations = [10.0, 10.01, 999.0, 45_000.0]
    results = [
        state.AttemptResult(
            leased=item,
            classification=Classification("success"),
            started_at=started,
            duration_ms=ms,
            status_code=200,
        )
        for item, started, ms in zip(leased, starts, durations, strict=True)
    ]
    state.record(results[:3], now=now, policy=RetryPolicy(schedule=(1,), jitter=0))
    state.record(results[3:], now=now, policy=RetryPolicy(schedule=(1,), jitter=0))

    minutes = dict(
        AttemptMinute.objects.values_list("minute").annotate(n=Sum("attempts")).order_by()
    )
    assert minutes == {now - timedelta(minutes=1): 1, now: 3}
    [hour] = EndpointHour.objects.values("hour", "endpoint_id").annotate(
        n=Sum("attempts"), **{c: Sum(c) for c in LATENCY_COLUMNS}
    )
    assert (hour["hour"], hour["endpoint_id"], hour["n"]) == (
        now.replace(minute=0),
        endpoint.id,
        4,
    )
    assert (hour["le_10ms"], hour["le_20ms"], hour["le_1000ms"], hour["slower"]) == (1, 1, 1, 1)
    assert sum(hour[c] for c in LATENCY_COLUMNS) == 4


def test_workers_recording_at_once_lose_no_count_and_never_wait_on_a_tally(tenant, make_endpoint):
    """Two recording transactions open at once, each adding the same minute, endpoint
    and outcome: on PostgreSQL each connection has its rows (its writer), so the second
    does not wait for the first's commit; every attempt is counted either way."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has one writer at a time: there is no concurrency to test")
    endpoint = make_endpoint("http://127.0.0.1:9/x")
    now = timezone.now()
    params = {"endpoints": [endpoint.id] * 5, "outcomes": ["success"] * 5}
    params.update(started=[now] * 5, durations=[3.0] * 5)
    first_holds = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def first():
        from django.db import transaction

        with transaction.atomic():
            worker.TALLY_ATTEMPTS(params)
            first_holds.set()
            assert release.wait(10)

    def second():
        from django.db import transaction

        assert first_holds.wait(10)
        with transaction.atomic():
            worker.TALLY_ATTEMPTS(params)  # would block here if it shared a row
        release.set()

    threads = [in_thread(first, errors), in_thread(second, errors)]
    for thread in threads:
        thread.join(20)
    assert not errors and release.is_set()
    assert AttemptMinute.objects.aggregate(n=Sum("attempts"))["n"] == 10
    assert EndpointHour.objects.aggregate(n=Sum("attempts"))["n"] == 10
    assert AttemptMinute.objects.values("writer").distinct().count() == 2


def test_percentiles_read_the_bucket_that_holds_them():
    histogram = [0] * len(LATENCY_COLUMNS)
    assert overview.percentile(histogram, 0.5) == "—"
    histogram[LATENCY_COLUMNS.index("le_20ms")] = 50
    histogram[LATENCY_COLUMNS.index("le_200ms")] = 45
    histogram[LATENCY_COLUMNS.index("le_2000ms")] = 5
    assert overview.percentile(histogram, 0.50) == "≤ 20 ms"
    assert overview.percentile(histogram, 0.51) == "≤ 200 ms"
    assert overview.percentile(histogram, 0.95) == "≤ 200 ms"
    assert overview.percentile(histogram, 0.96) == "≤ 2 s"
    histogram[-1] = 1000
    assert overview.percentile(histogram, 0.95) == "> 30 s"


def test_the_endpoints_come_worst_first(tenant, receiver, settings):
    settings.DELIVERY_RETRY_SCHEDULE = []
    receiver.behaviours["/down"] = always(503)
    good, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    down, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/down"))
    other = Tenant.objects.create(name="other")
    quiet, _ = services.endpoint_create(tenant=other, url=receiver.url("/ok"))
    for i in range(4):
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
    drain()

    health = overview.endpoint_health(timezone.now())
    assert [h.endpoint.id for h in health] == [down.id, good.id]  # quiet: nothing to show
    worst = health[0]
    assert (worst.attempts, worst.failures, worst.dead, worst.success_rate) == (4, 4, 4, 0.0)
    assert worst.state == "failing"
    assert (health[1].attempts, health[1].success_rate, health[1].state) == (4, 1.0, "running")
    assert quiet.id not in {h.endpoint.id for h in health}


def test_the_overview_reads_the_same_few_statements_however_much_history(
    tenant, receiver, settings
):
    from tests.deliveries.test_admin import staff

    settings.DELIVERY_RETRY_SCHEDULE = []
    receiver.behaviours["/down"] = always(503)
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    services.endpoint_create(tenant=tenant, url=receiver.url("/down"))
    client = staff()
    counts = []
    for n in (2, 40):
        for i in range(n):
            services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
        drain()
        with CaptureQueriesContext(connection) as ctx:
            page = client.get("/admin/deliveries/delivery/overview/")
        assert page.status_code == 200
        counts.append(len(ctx))
    assert counts[0] == counts[1]
    body = page.content.decode()
    assert "84 attempts in 24 h" in body  # 42 events to two endpoints
    assert "50.0%" in body
    assert body.count('<svg class="chart') == 4


def test_a_chart_draws_its_bars_from_the_values_and_escapes_its_text():
    start = timezone.now().replace(second=0, microsecond=0)
    values = [0] * 1440
    values[10], values[11], values[700] = 3, 5, 12
    svg = charts.bar_chart(
        values,
        start=start,
        step=timedelta(minutes=1),
        title="<b>Delivered</b>",
        unit="per minute",
        bins=288,
    )
    assert 'data-bars="288"' in svg and 'data-nonzero="2"' in svg and 'data-total="20"' in svg
    assert "&lt;b&gt;Delivered&lt;/b&gt;" in svg and "<b>" not in svg
    assert "20 in all; the highest bar is 2.4 per minute" in svg
    assert charts.nice_ceiling(2.4) == 2.5 and charts.nice_ceiling(0) == 1.0
