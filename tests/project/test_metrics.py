"""/metrics: one test per metric family, scraped through the real view."""

import json
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from deliveries import services, state
from deliveries.core import prometheus as metrics
from deliveries.jobs.models import LoopRun, Outbox
from deliveries.jobs.relay import relay_tick
from deliveries.metrics import EndpointLabels
from deliveries.models import Delivery
from deliveries.scheduler import scheduler_tick
from ingest import handlers
from ingest.schemes import get_scheme
from ingest.sources import source_create
from tests.conftest import drain, run_workers, scrape, value
from tests.receiver import always

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


@pytest.fixture(autouse=True)
def _scraped_from_loopback(settings):
    # The test client's requests come from 127.0.0.1, which no address list admits by
    # default: these tests scrape as an allow-listed Prometheus on the same host would.
    settings.METRICS_ALLOW_IPS = ["127.0.0.1"]


def test_metrics_need_the_token_or_an_allowed_address(settings):
    settings.METRICS_TOKEN = "metrics-token-1234"
    outside = {"REMOTE_ADDR": "203.0.113.9"}
    assert Client(**outside).get("/metrics").status_code == 403
    assert Client(**outside, HTTP_AUTHORIZATION="Bearer wrong").get("/metrics").status_code == 403
    ok = Client(**outside, HTTP_AUTHORIZATION="Bearer metrics-token-1234").get("/metrics")
    assert ok.status_code == 200
    assert b"webhooks_deliveries" in ok.content
    settings.METRICS_TOKEN = ""
    assert Client(**outside, HTTP_AUTHORIZATION="Bearer ").get("/metrics").status_code == 403
    assert Client().get("/metrics").status_code == 200  # 127.0.0.1 is in METRICS_ALLOW_IPS


def test_with_no_address_allowed_loopback_needs_the_token_too(settings):
    # The default outside DEBUG (tests/project/test_settings.py reads it).
    settings.METRICS_ALLOW_IPS = []
    settings.METRICS_TOKEN = "metrics-token-1234"
    assert Client().get("/metrics").status_code == 403  # from 127.0.0.1, without the token
    ok = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer metrics-token-1234")
    assert ok.status_code == 200


@pytest.mark.parametrize("header", ["HTTP_X_FORWARDED_FOR", "HTTP_FORWARDED", "HTTP_X_REAL_IP"])
def test_an_allowed_address_does_not_count_for_a_request_a_proxy_relayed(settings, header):
    # A proxy on the same host relays the internet from 127.0.0.1.
    settings.METRICS_TOKEN = "metrics-token-1234"
    relayed = Client(**{header: "203.0.113.9"})
    assert relayed.get("/metrics").status_code == 403
    ok = relayed.get("/metrics", HTTP_AUTHORIZATION="Bearer metrics-token-1234")
    assert ok.status_code == 200


def test_deliveries_by_state_dead_letters_relay_lag_and_queue_depth(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/x")
    events = [services.publish_event(tenant=tenant, event_type="t", payload={}) for _ in range(3)]
    state.cancel(delivery_ids=[Delivery.objects.get(event=events[0]).id], now=timezone.now())

    s = scrape()
    assert value(s, "webhooks_deliveries", state="pending") == 2
    assert value(s, "webhooks_deliveries", state="dead") == 1
    assert value(s, "webhooks_deliveries", state="enqueued") == 0
    assert value(s, "webhooks_dead_letters", outcome="cancelled") == 1

    scheduler_tick()
    Outbox.objects.update(created_at=timezone.now() - timedelta(seconds=30))
    s = scrape()
    assert value(s, "webhooks_deliveries", state="enqueued") == 2
    assert value(s, "webhooks_outbox_unpublished") == 2
    assert 30 <= value(s, "webhooks_outbox_relay_lag_seconds") < 60
    assert value(s, "webhooks_queue_depth", queue="webhooks", visibility="visible") == 0

    relay_tick()
    s = scrape()
    assert value(s, "webhooks_outbox_unpublished") == 0
    assert value(s, "webhooks_outbox_relay_lag_seconds") == 0
    assert value(s, "webhooks_queue_depth", queue="webhooks", visibility="visible") == 2
    # No LoopRun: no heartbeat series (absent, not an age of 0) ...
    assert ("webhooks_loop_heartbeat_age_seconds", (("kind", "scheduler"),)) not in s
    # ... and a scheduler's heartbeat 30 s old reads as 30 s.
    beat = timezone.now() - timedelta(seconds=30)
    LoopRun.objects.create(kind="scheduler", host="h", pid=1, started_at=beat, heartbeat_at=beat)
    assert 30 <= value(scrape(), "webhooks_loop_heartbeat_age_seconds", kind="scheduler") < 60
    assert value(s, "webhooks_metrics_provider_up", provider="deliveries") == 1
    assert value(s, "webhooks_metrics_provider_up", provider="inbound") == 1


def test_paused_endpoints_are_counted(tenant, make_endpoint):
    endpoint = make_endpoint("http://127.0.0.1:9/x")
    make_endpoint("http://127.0.0.1:9/y")
    assert value(scrape(), "webhooks_endpoints_paused") == 0
    services.endpoint_pause(endpoint=endpoint)
    assert value(scrape(), "webhooks_endpoints_paused") == 1


def test_oldest_due_delivery_age_reads_every_priority(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/x")
    now = timezone.now()
    for priority, due_ago in [(5, 100), (0, 250), (-3, -500)]:
        event = services.publish_event(tenant=tenant, event_type="t", payload={}, priority=priority)
        Delivery.objects.filter(event=event).update(
            next_attempt_at=now - timedelta(seconds=due_ago)
        )

    age = value(scrape(), "webhooks_oldest_due_delivery_age_seconds")
    assert 250 <= age < 260

    Delivery.objects.update(next_attempt_at=now + timedelta(hours=1))
    assert value(scrape(), "webhooks_oldest_due_delivery_age_seconds") == 0


def test_database_gauges_are_cached_briefly(tenant, make_endpoint, settings):
    settings.METRICS_CACHE_SECONDS = 60
    make_endpoint("http://127.0.0.1:9/x")
    services.publish_event(tenant=tenant, event_type="t", payload={})
    assert value(scrape(), "webhooks_deliveries", state="pending") == 1

    services.publish_event(tenant=tenant, event_type="t", payload={})
    assert value(scrape(fresh=False), "webhooks_deliveries", state="pending") == 1
    assert value(scrape(), "webhooks_deliveries", state="pending") == 2


def test_attempts_by_outcome_and_dispatches_per_endpoint_with_bounded_labels(
    tenant, receiver, settings, monkeypatch
):
    receiver.behaviours["/fail"] = always(500)
    busy, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/busy"))
    listed, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/fail"))
    quiet, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/quiet"))
    settings.METRICS_ENDPOINT_TOP_K = 1
    settings.METRICS_ENDPOINTS = [str(listed.id)]
    monkeypatch.setattr("deliveries.worker.ENDPOINT_LABELS", EndpointLabels())
    for _ in range(3):
        services.publish_event(tenant=tenant, event_type="t", payload={}, endpoint_ids=[busy.id])
    services.publish_event(tenant=tenant, event_type="t", payload={}, endpoint_ids=[listed.id])
    services.publish_event(tenant=tenant, event_type="t", payload={}, endpoint_ids=[quiet.id])
    before = scrape()

    scheduler_tick()
    relay_tick()
    run_workers(lanes=1)
    after = scrape()

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("webhooks_attempts_total", outcome="success", status_class="2xx") == 4
    assert delta("webhooks_attempts_total", outcome="retry", status_class="5xx") == 1
    count = "webhooks_dispatch_duration_seconds_count"
    assert delta(count, endpoint=str(busy.id)) == 3  # the busiest: top-1
    assert delta(count, endpoint=str(listed.id)) == 1  # listed in METRICS_ENDPOINTS
    assert delta(count, endpoint="other") == 1  # everyone else
    assert delta(count, endpoint=str(quiet.id)) == 0
    assert delta("webhooks_dispatch_failures_total", endpoint=str(listed.id)) == 1
    assert delta("webhooks_deliveries_finished_total", state="succeeded") == 4
    assert value(after, "webhooks_dispatch_duration_seconds_sum", endpoint=str(busy.id)) > 0


def test_lease_expiries_and_lost_dispatches_are_counted(tenant, make_endpoint, settings):
    make_endpoint("http://127.0.0.1:9/x")
    for _ in range(2):
        services.publish_event(tenant=tenant, event_type="t", payload={})
    before = scrape()
    scheduler_tick()
    first, second = Delivery.objects.order_by("id")
    now = timezone.now()
    state.lease([(first.id, 1)], now=now, lease_seconds=60)
    Delivery.objects.filter(id=first.id).update(lease_until=now - timedelta(seconds=1))
    Delivery.objects.filter(id=second.id).update(enqueued_at=now - timedelta(hours=1))

    counts = scheduler_tick().counts
    assert counts["lease_expired"] == 1 and counts["transport_lost"] == 1
    after = scrape()
    for name in ("webhooks_lease_expiries_total", "webhooks_lost_dispatches_total"):
        assert value(after, name, job="delivery") - value(before, name, job="delivery") == 1


def _signed(body: bytes, secret: str) -> dict:
    signed = get_scheme("stripe").sign(body=body, secret=secret)
    signed.pop("content-type", None)
    return {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in signed.items()}


def test_inbound_received_duplicate_refused_signature_failures_and_handlers():
    source_create(slug="metrics-src", scheme="stripe", secrets=["whsec_metrics_source"])
    registration = handlers.Registration("metrics-src", "*", lambda e: time.sleep(0.01))
    handlers.REGISTRY.append(registration)
    try:
        before = scrape()
        body = json.dumps(
            {"id": "evt_m1", "object": "event", "type": "a.b", "created": int(time.time())}
        ).encode()
        client = Client()
        for _ in range(2):  # the second copy is a duplicate
            r = client.post(
                "/ingest/metrics-src/",
                body,
                content_type="application/json",
                **_signed(body, "whsec_metrics_source"),
            )
            assert r.status_code == 200
        bad = client.post(
            "/ingest/metrics-src/", body, content_type="application/json", **_signed(body, "x")
        )
        assert bad.status_code == 401
        wrong_type = client.post(
            "/ingest/metrics-src/",
            body,
            content_type="text/plain",
            **_signed(body, "whsec_metrics_source"),
        )
        assert wrong_type.status_code == 415
        pending = scrape()
        assert value(pending, "webhooks_inbound_events", state="enqueued") == 1
        drain()
        after = scrape()
    finally:
        handlers.REGISTRY.remove(registration)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    src = {"source": "metrics-src"}
    assert delta("webhooks_inbound_received_total", **src, duplicate="false") == 1
    assert delta("webhooks_inbound_received_total", **src, duplicate="true") == 1
    assert delta("webhooks_inbound_refused_total", **src, reason="bad_signature") == 1
    assert delta("webhooks_inbound_refused_total", **src, reason="content_type") == 1
    assert delta("webhooks_inbound_signature_failures_total", **src, reason="bad_signature") == 1
    assert delta("webhooks_inbound_signature_failures_total", **src, reason="content_type") == 0
    # The fleet-wide count kept in the database.
    assert (
        value(after, "webhooks_inbound_verification_failures_total", **src, reason="bad_signature")
        == 1
    )
    assert delta("webhooks_inbound_processed_total", **src, result="processed") == 1
    name = registration.name
    assert delta("webhooks_inbound_handler_duration_seconds_count", handler=name, outcome="ok") == 1
    assert (
        value(after, "webhooks_inbound_handler_duration_seconds_sum", handler=name, outcome="ok")
        >= 0.01
    )
    assert value(after, "webhooks_inbound_events", state="enqueued") == 0


def test_a_failing_or_slow_provider_is_reported_and_does_not_break_the_scrape(settings):
    if connection.vendor != "postgresql":
        pytest.skip("the providers' time budget is PostgreSQL's statement_timeout")
    settings.METRICS_DB_BUDGET_MS = 50

    def slow(now):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(2)")
        return []

    metrics.register_provider("slow", slow)
    try:
        started = time.monotonic()
        s = scrape()
        assert time.monotonic() - started < 1.5
    finally:
        del metrics.PROVIDERS["slow"]
    # Present and 0: the provider ran and was cut off, not left out.
    assert s[("webhooks_metrics_provider_up", (("provider", "slow"),))] == 0
    assert value(s, "webhooks_metrics_provider_up", provider="deliveries") == 1


def test_poll_cursors_and_backfill_progress():
    from ingest.models import BackfillRun, PollSource, Source

    now = timezone.now()
    source = Source.objects.create(slug="crm", scheme="poll")
    poll = PollSource.objects.create(
        source=source,
        cursor_at=now - timedelta(seconds=120),
        last_poll_at=now - timedelta(seconds=30),
        last_poll_counts={"stored": 7, "duplicates": 2},
    )
    run = BackfillRun.objects.create(
        source=poll,
        since=now - timedelta(days=10),
        until=now,
        rate=5,
        page_size=100,
        started_by="ops",
        created_at=now,
        checkpoint_at=now - timedelta(days=5),
        processed=400,
        stored=390,
        duplicates=10,
        active_seconds=80,
    )
    BackfillRun.objects.create(
        source=poll,
        state="completed",
        since=now - timedelta(days=1),
        until=now,
        rate=5,
        page_size=100,
        started_by="ops",
        created_at=now - timedelta(hours=1),
    )

    samples = scrape()
    crm = {"source": "crm"}
    assert 119 <= value(samples, "webhooks_poll_cursor_age_seconds", **crm) <= 180
    assert 29 <= value(samples, "webhooks_poll_last_run_age_seconds", **crm) <= 90
    assert value(samples, "webhooks_poll_last_run_records", **crm, outcome="stored") == 7
    assert value(samples, "webhooks_backfill_runs", state="running") == 1
    assert value(samples, "webhooks_backfill_runs", state="completed") == 1
    one = {"run": str(run.id), "source": "crm"}
    assert value(samples, "webhooks_backfill_records", **one, kind="stored") == 390
    assert value(samples, "webhooks_backfill_progress_ratio", **one) == pytest.approx(0.5, 0.01)
    assert value(samples, "webhooks_backfill_rate", **one) == 5.0  # 400 records in 80 s
    assert value(samples, "webhooks_backfill_eta_seconds", **one) == pytest.approx(80, 0.05)
    # Only unfinished runs get their own series.
    assert sum(1 for name, labels in samples if name == "webhooks_backfill_records") == 3
