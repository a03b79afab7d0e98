"""Receiving and processing inbound webhooks with the real pipeline."""

import contextlib
import hmac
import json
import threading
import time
import uuid
from collections import Counter

import pytest
from django.db import DatabaseError, connection
from django.test import Client
from django.utils import timezone

from deliveries import services as delivery_services
from deliveries.jobs.models import EntityLock
from deliveries.jobs.relay import relay_tick
from deliveries.models import Delivery, Tenant
from ingest import handlers
from ingest.models import EntityVersion, HandlerRun, InboundEvent, VerificationFailure
from ingest.schemes import get_scheme
from ingest.sources import source_create
from tests.conftest import drain, run_workers
from tests.ingest.conftest import SECRET

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


@pytest.fixture
def applied():
    """A handler that records every application of an event (its 'effect')."""
    effects: list = []
    registration = handlers.Registration(
        "stripe", "*", lambda e: effects.append((e.event_id, e.event_type, e.payload))
    )
    handlers.REGISTRY.append(registration)
    yield effects
    handlers.REGISTRY.remove(registration)


def stripe_event(
    event_id="evt_1", event_type="invoice.paid", created=None, obj="in_1", **extra
) -> bytes:
    return json.dumps(
        {
            "id": event_id,
            "object": "event",
            "type": event_type,
            "created": created or int(time.time()),
            "data": {"object": {"id": obj, **extra}},
        }
    ).encode()


def post(
    body: bytes,
    *,
    secret=SECRET,
    timestamp=None,
    content_type="application/json",
    slug="stripe",
    headers=None,
    client=None,
):
    signed = get_scheme("stripe").sign(body=body, secret=secret, timestamp=timestamp)
    signed.pop("content-type", None)
    extra = {
        f"HTTP_{k.upper().replace('-', '_')}": v for k, v in {**signed, **(headers or {})}.items()
    }
    return (client or Client()).post(f"/ingest/{slug}/", body, content_type=content_type, **extra)


def test_a_signed_event_is_accepted_then_processed_once(stripe, applied):
    r = post(stripe_event())
    assert r.status_code == 200
    assert r.json()["status"] == "accepted"
    assert applied == []  # nothing runs inside the request
    event = InboundEvent.objects.get()
    assert event.state == "enqueued" and event.event_type == "invoice.paid"
    assert event.entity_id == "in_1"
    assert "stripe-signature" not in event.headers

    drain()

    event.refresh_from_db()
    assert event.state == "processed"
    assert [(e[0], e[1]) for e in applied] == [("evt_1", "invoice.paid")]
    assert HandlerRun.objects.get().outcome == "ok"


def test_the_event_keeps_the_headers_by_lower_case_name_but_not_the_signature(stripe):
    body = stripe_event()
    r = post(body, headers={"X-Request-Id": "r-1"})

    assert r.status_code == 200
    headers = InboundEvent.objects.get().headers
    assert headers["x-request-id"] == "r-1"
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(body))
    assert "stripe-signature" not in headers


def test_the_same_event_posted_20_times_concurrently_is_applied_once(stripe, applied):
    body = stripe_event()
    barrier = threading.Barrier(20)
    codes: list[int] = []

    def send():
        try:
            barrier.wait()
            codes.append(post(body).status_code)
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert codes == [200] * 20
    event = InboundEvent.objects.get()
    assert event.duplicates == 19
    drain()
    assert len(applied) == 1


@pytest.mark.parametrize(
    ("case", "status", "reason"),
    [
        ("forged", 401, "bad_signature"),
        ("stale", 401, "stale_timestamp"),
        ("future", 401, "future_timestamp"),
        ("truncated", 401, "bad_signature"),
        ("unsigned", 401, "missing_signature"),
        ("oversized", 413, "too_large"),
        ("content_type", 415, "content_type"),
    ],
)
def test_refused_requests_get_their_status_create_no_work_and_are_counted(
    stripe, case, status, reason
):
    stripe.max_body_bytes = 2000
    stripe.save()
    body = stripe_event()
    now = int(time.time())
    if case == "forged":
        r = post(body, secret="whsec_wrong")
    elif case == "stale":
        r = post(body, timestamp=now - 301)
    elif case == "future":
        # Well past the window: the receiver compares with the clock when it checks,
        # and "now + 301" came within it whenever a second ticked over in between.
        r = post(body, timestamp=now + 330)
    elif case == "truncated":
        signed = get_scheme("stripe").sign(body=body, secret=SECRET)
        r = Client().post(
            "/ingest/stripe/",
            body[:-5],
            content_type="application/json",
            HTTP_STRIPE_SIGNATURE=signed["stripe-signature"],
        )
    elif case == "unsigned":
        r = Client().post("/ingest/stripe/", body, content_type="application/json")
    elif case == "oversized":
        r = post(stripe_event(padding="x" * 3000))
    else:
        r = post(body, content_type="text/plain")
    assert r.status_code == status
    assert set(r.json()) == {"error"}
    assert InboundEvent.objects.count() == 0
    assert VerificationFailure.objects.get(reason=reason).count == 1
    if status == 401:
        assert r.json()["error"]["message"] == "Signature verification failed."


def test_the_replay_window_holds_in_both_directions(stripe):
    now = int(time.time())
    assert post(stripe_event("evt_a"), timestamp=now - 295).status_code == 200
    assert post(stripe_event("evt_b"), timestamp=now + 295).status_code == 200


def test_method_unknown_source_and_disabled_source(stripe):
    assert Client().get("/ingest/stripe/").status_code == 405
    assert post(stripe_event(), slug="nope").status_code == 404
    stripe.enabled = False
    stripe.save()
    assert post(stripe_event()).status_code == 404


def test_an_authentic_body_that_does_not_parse_is_stored_as_rejected(stripe, applied):
    r = post(b'{"object": "event"}')  # signed, but no id
    assert r.status_code == 400
    event = InboundEvent.objects.get()
    assert event.state == "rejected" and "missing_event_id" in event.last_error
    drain()
    assert applied == []


# Text PostgreSQL cannot store (NUL) or UTF-8 cannot encode (a lone surrogate), as JSON
# escapes in a validly signed body.
UNSTORABLE = {"nul": "\\u0000", "surrogate": "\\ud800"}
FIELDS = {
    "event_id": '{"id": "evt_%s", "type": "invoice.paid", "data": {"object": {"id": "in_1"}}}',
    "event_type": '{"id": "evt_1", "type": "invoice.%s", "data": {"object": {"id": "in_1"}}}',
    "entity_id": '{"id": "evt_1", "type": "invoice.paid", "data": {"object": {"id": "in_%s"}}}',
}


@pytest.mark.parametrize("text", UNSTORABLE)
@pytest.mark.parametrize("field", FIELDS)
def test_a_signed_body_whose_id_type_or_entity_the_database_refuses_is_stored_rejected(
    stripe, applied, field, text
):
    body = (FIELDS[field] % UNSTORABLE[text]).encode()

    first, retry = post(body), post(body)

    for answer in (first, retry):
        assert answer.status_code == 400
        assert answer.json() == {
            "error": {"code": "unparseable", "message": "The body could not be parsed."}
        }
    event = InboundEvent.objects.get()
    assert event.state == "rejected"
    assert event.last_error == f"unparseable: {text}_in_{field}"
    assert bytes(event.body) == body
    assert event.duplicates == 1  # the provider's retry is the same rejected evidence
    assert VerificationFailure.objects.get(reason=f"unparseable_{text}_in_{field}").count == 2
    drain()
    assert applied == []


def test_a_nul_in_a_body_field_the_scheme_does_not_read_is_accepted(stripe, applied):
    # The body is stored as bytes, exactly as signed: only the fields that become text
    # columns have to be storable text.
    body = stripe_event("evt_nul", note="a\u0000b")

    assert post(body).status_code == 200
    drain()
    assert [effect[0] for effect in applied] == ["evt_nul"]


@pytest.mark.parametrize(
    "headers",
    [
        {"x-github-delivery": "d\x00"},
        {"x-note": "a\x00b"},
        {"x-n\x00te": "v"},
        {"x-note": "a\ud800b"},
    ],
)
def test_a_header_the_event_cannot_keep_is_a_400_and_stores_nothing(headers):
    source_create(slug="gh", scheme="github", secrets=[SECRET])
    body = b'{"action": "opened"}'
    signed = get_scheme("github").sign(body=body, secret=SECRET, event_id="d1")
    signed.pop("content-type")
    signed.update(headers)

    r = Client().post(
        "/ingest/gh/",
        body,
        content_type="application/json",
        **{f"HTTP_{k.upper().replace('-', '_')}": v for k, v in signed.items()},
    )

    assert r.status_code == 400
    assert r.json()["error"]["code"] == "bad_header"
    assert InboundEvent.objects.count() == 0
    assert VerificationFailure.objects.get(reason="bad_header").count == 1


def test_per_source_rate_limit_answers_429_with_retry_after(stripe):
    from django.core.cache import cache

    cache.clear()
    stripe.rate_limit = 2
    stripe.save()
    responses = [post(stripe_event(f"evt_{i}")) for i in range(6)]
    # Six requests span at most two one-second windows of two requests each.
    refused = [r for r in responses if r.status_code == 429]
    assert len(refused) >= 2
    assert all(r["Retry-After"] == "1" for r in refused)
    assert InboundEvent.objects.count() == 6 - len(refused)


def test_out_of_order_updated_before_created_ends_in_the_right_state(stripe):
    state: dict = {}

    def apply(e):
        state[e.entity_id] = e.payload["data"]["object"]["status"]

    registration = handlers.Registration("stripe", "customer.*", apply)
    handlers.REGISTRY.append(registration)
    try:
        t0 = int(time.time()) - 60
        post(
            stripe_event(
                "evt_upd", "customer.updated", created=t0 + 10, obj="cus_1", status="active"
            )
        )
        drain()
        post(
            stripe_event(
                "evt_new", "customer.created", created=t0, obj="cus_1", status="incomplete"
            )
        )
        drain()
    finally:
        handlers.REGISTRY.remove(registration)

    assert state == {"cus_1": "active"}
    created = InboundEvent.objects.get(event_id="evt_new")
    assert created.state == "skipped"
    assert HandlerRun.objects.get(event=created).outcome == "stale"
    version = EntityVersion.objects.get(key="stripe:cus_1")
    assert version.event == InboundEvent.objects.get(event_id="evt_upd")
    assert not EntityLock.objects.exists()  # each lock went with its event's commit


def test_an_entity_locked_elsewhere_waits_without_a_failure_then_is_applied(stripe, applied):
    held = EntityLock.objects.create(
        key="stripe:cus_9",
        owner="another worker",
        expires_at=timezone.now() + timezone.timedelta(seconds=60),
    )
    post(stripe_event("evt_9", obj="cus_9"))
    drain()
    event = InboundEvent.objects.get()
    assert (event.state, event.last_error, event.attempt_count) == ("pending", "entity locked", 0)
    assert not HandlerRun.objects.exists() and applied == []
    held.refresh_from_db()
    assert held.owner == "another worker"  # not taken, not released by the waiter

    held.delete()
    InboundEvent.objects.update(next_attempt_at=timezone.now())
    drain()
    event.refresh_from_db()
    assert event.state == "processed" and [a[0] for a in applied] == ["evt_9"]
    assert not EntityLock.objects.exists()


def test_a_run_whose_lease_was_taken_over_keeps_none_of_its_writes(stripe):
    """The lease runs out while the handler works and another worker leases the event:
    the run's commit must be refused, its writes (the handler's, the runs, the entity's
    version) undone, and its entity lock given back."""
    if connection.vendor != "postgresql":
        pytest.skip("one writer on SQLite: no lease changes hands while the run writes")

    def take_over(event_id: str) -> None:
        def other_worker() -> None:
            try:
                InboundEvent.objects.filter(event_id=event_id).update(lease_token=uuid.uuid4())
            finally:
                connection.close()

        thread = threading.Thread(target=other_worker)
        thread.start()
        thread.join()

    def slow_handler(e):
        Tenant.objects.create(name="written by the handler")
        take_over(e.event_id)

    registration = handlers.Registration("stripe", "*", slow_handler)
    handlers.REGISTRY.append(registration)
    try:
        post(stripe_event("evt_lost", obj="cus_lost"))
        relay_tick()
        run_workers()
    finally:
        handlers.REGISTRY.remove(registration)

    event = InboundEvent.objects.get()
    assert event.state == "processing"  # the other worker's now
    assert not Tenant.objects.filter(name="written by the handler").exists()
    assert not HandlerRun.objects.exists()
    assert not EntityVersion.objects.exists()
    assert not EntityLock.objects.exists()


def test_a_handler_can_publish_outbound_events_in_its_transaction(stripe, receiver):
    tenant = Tenant.objects.create(name="t")
    delivery_services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))

    def forward(e):
        delivery_services.publish_event(
            tenant=tenant, event_type="payment.received", payload={"from": e.event_id}
        )

    registration = handlers.Registration("stripe", "invoice.paid", forward)
    handlers.REGISTRY.append(registration)
    try:
        post(stripe_event())
        drain()
        drain()
    finally:
        handlers.REGISTRY.remove(registration)
    assert Delivery.objects.get().state == "succeeded"
    assert json.loads(receiver.received[0].body) == {"from": "evt_1"}


def test_a_failing_handler_is_retried_then_succeeds(stripe, settings):
    settings.DELIVERY_RETRY_SCHEDULE = [0]
    calls = Counter()

    def flaky(e):
        calls[e.event_id] += 1
        if calls[e.event_id] == 1:
            raise RuntimeError("downstream is down")

    registration = handlers.Registration("stripe", "*", flaky)
    handlers.REGISTRY.append(registration)
    try:
        post(stripe_event())
        drain()
        drain()
    finally:
        handlers.REGISTRY.remove(registration)
    event = InboundEvent.objects.get()
    assert event.state == "processed" and calls["evt_1"] == 2
    outcomes = list(HandlerRun.objects.order_by("id").values_list("outcome", flat=True))
    assert outcomes == ["error", "ok"]


def test_a_handler_that_always_fails_ends_dead(stripe, settings):
    settings.DELIVERY_RETRY_SCHEDULE = [0, 0]

    def broken(e):
        raise ValueError("bug")

    registration = handlers.Registration("stripe", "*", broken)
    handlers.REGISTRY.append(registration)
    try:
        post(stripe_event())
        for _ in range(4):
            drain()
    finally:
        handlers.REGISTRY.remove(registration)
    event = InboundEvent.objects.get()
    assert event.state == "dead"
    assert "ValueError: bug" in event.last_error
    assert HandlerRun.objects.filter(outcome="error").count() == 3
    assert not EntityLock.objects.exists()  # released after each failed run


def test_receiving_keeps_answering_while_processing_is_stalled_then_drains(stripe, applied):
    for i in range(50):
        assert post(stripe_event(f"evt_{i}", obj=f"in_{i}")).status_code == 200
    assert InboundEvent.objects.filter(state="enqueued").count() == 50
    assert applied == []
    drain()
    assert len(applied) == 50
    assert InboundEvent.objects.filter(state="processed").count() == 50


def test_create_source_command(settings):
    from tests.conftest import manage, subprocess_env

    r = manage(
        "create_source",
        "gh",
        "--scheme",
        "github",
        "--secret",
        "s1",
        "--secret",
        "s2",
        env=subprocess_env(),
    )
    assert r.returncode == 0, r.stderr
    from ingest.models import Source

    source = Source.objects.get(slug="gh")
    assert source.scheme == "github" and source.secrets.count() == 2
    bad = manage(
        "create_source",
        "x",
        "--scheme",
        "hmac",
        "--secret",
        "s",
        "--options",
        '{"algorithm": "md5"}',
        env=subprocess_env(),
    )
    assert bad.returncode != 0


def test_run_workers_processes_inbound_and_reprocess_is_audited(stripe, applied):
    from deliveries.models import AuditEntry
    from ingest.state import inbound_reprocess

    post(stripe_event())
    drain()
    event = InboundEvent.objects.get()
    assert inbound_reprocess(event_ids=[event.id]) == 1
    drain()
    assert len(applied) == 2
    assert AuditEntry.objects.get(action="inbound.reprocess").count == 1


def test_workers_take_inbound_events_from_the_outbox_with_no_relay(stripe, applied):
    from deliveries.jobs.models import Outbox

    post(stripe_event("evt_direct"))
    assert Outbox.objects.get(kind="inbound").published_at is None

    counts = run_workers(lanes=1)

    assert counts["inbound.processed"] == 1, counts
    assert [e[0] for e in applied] == ["evt_direct"]
    assert InboundEvent.objects.get().state == "processed"
    assert Outbox.objects.get(kind="inbound").published_at is not None


def test_refusals_are_a_prometheus_metric(stripe, settings):
    from prometheus_client import REGISTRY

    def refused():
        return (
            REGISTRY.get_sample_value(
                "webhooks_inbound_refused_total", {"source": "stripe", "reason": "bad_signature"}
            )
            or 0
        )

    before = refused()
    post(stripe_event(), secret="whsec_wrong")
    post(stripe_event(), secret="whsec_wrong")
    assert refused() == before + 2
    settings.METRICS_ALLOW_IPS = ["127.0.0.1"]  # the test client's address
    metrics = Client().get("/metrics")
    assert metrics.status_code == 200
    assert b'webhooks_inbound_refused_total{reason="bad_signature",source="stripe"}' in (
        metrics.content
    )
    assert Client(REMOTE_ADDR="203.0.113.9").get("/metrics").status_code == 403


def test_the_source_cache_sees_changes_made_in_this_process_at_once(client, settings):
    from ingest.models import SourceSecret

    settings.INGEST_SOURCE_CACHE_SECONDS = 3600
    source = source_create(slug="cached", scheme="github", secrets=["old"])
    body = b'{"action": "opened"}'

    def post(secret: str):
        digest = hmac.new(secret.encode(), body, "sha256").hexdigest()
        return client.post(
            "/ingest/cached/",
            body,
            content_type="application/json",
            HTTP_X_HUB_SIGNATURE_256=f"sha256={digest}",
            HTTP_X_GITHUB_DELIVERY=str(uuid.uuid4()),
            HTTP_X_GITHUB_EVENT="issues",
        )

    assert post("old").status_code == 200  # the source is now cached
    # A secret saved here is used at once; one expiring is refused at its expiry, not
    # at the cache's.
    SourceSecret.objects.create(
        source=source, secret="brief", expires_at=timezone.now() + timezone.timedelta(seconds=1)
    )
    assert post("brief").status_code == 200
    time.sleep(1.1)
    assert post("brief").status_code == 401
    assert post("old").status_code == 200
    source.enabled = False
    source.save()
    assert post("old").status_code == 404


def test_a_connection_the_server_dropped_costs_no_failed_request(stripe):
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no server to end a connection")
    import psycopg
    from django.conf import settings as django_settings

    assert post(stripe_event("evt_before")).status_code == 200
    # The server ends this process's persistent connection (as a restart would).
    pid = connection.connection.info.backend_pid
    params = connection.get_connection_params()
    with psycopg.connect(
        dbname=django_settings.DATABASES["default"]["NAME"],
        **{k: params[k] for k in ("user", "host", "port") if k in params},
        autocommit=True,
    ) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    time.sleep(0.2)

    r = post(stripe_event("evt_after"))
    assert r.status_code == 200, r.content
    assert r.json()["status"] == "accepted"
    assert connection.connection.info.backend_pid != pid
    assert set(InboundEvent.objects.values_list("event_id", flat=True)) == {
        "evt_before",
        "evt_after",
    }


# --- Batches: on PostgreSQL a worker applies a leased batch in one transaction --------


def _batch_of(*events: tuple[str, int, str]) -> None:
    """Receive (event id, created, entity) each, then process them as one batch."""
    for event_id, created, obj in events:
        assert post(stripe_event(event_id, "customer.updated", created, obj)).status_code == 200
    relay_tick()
    counts = run_workers(lanes=1)
    assert counts.get("inbound.skipped_messages", 0) == 0


def _states() -> dict[str, str]:
    return dict(InboundEvent.objects.values_list("event_id", "state"))


def test_a_batch_applies_an_entitys_events_in_their_own_order(stripe, applied):
    t0 = int(time.time()) - 600
    EntityVersion.objects.create(key="stripe:cus_2", applied_at=timezone.now())
    _batch_of(
        ("evt_c", t0 + 20, "cus_1"),
        ("evt_a", t0, "cus_1"),
        ("evt_old", t0, "cus_2"),  # older than cus_2's applied version: stale
        ("evt_b", t0 + 10, "cus_1"),
    )
    assert [a[0] for a in applied] == ["evt_a", "evt_b", "evt_c"]
    assert _states() == {
        "evt_a": "processed",
        "evt_b": "processed",
        "evt_c": "processed",
        "evt_old": "skipped",
    }
    runs = list(HandlerRun.objects.values_list("event__event_id", "outcome", "attempt"))
    assert sorted(runs) == [
        ("evt_a", "ok", 1),
        ("evt_b", "ok", 1),
        ("evt_c", "ok", 1),
        ("evt_old", "stale", 1),
    ]
    assert EntityVersion.objects.get(key="stripe:cus_1").event.event_id == "evt_c"
    assert not EntityLock.objects.exists()


def test_one_failing_event_costs_the_others_a_second_run_never_their_result(stripe, settings):
    """The handler raises on evt_2: that run is evt_2's recorded attempt; the batch's
    transaction is undone and the other events run again one by one, so each ends
    processed with one run on record (the undone batch left none). SQLite runs them one
    by one from the start, to the same end."""
    settings.DELIVERY_RETRY_SCHEDULE = [60]
    calls: list[str] = []

    def picky(e):
        calls.append(e.event_id)
        Tenant.objects.create(name=f"effect of {e.event_id}")
        if e.event_id == "evt_2":
            raise RuntimeError("cannot apply evt_2")

    registration = handlers.Registration("stripe", "*", picky)
    handlers.REGISTRY.append(registration)
    try:
        t0 = int(time.time()) - 600
        _batch_of(*[(f"evt_{i}", t0 + i, f"cus_{i}") for i in range(1, 5)])
    finally:
        handlers.REGISTRY.remove(registration)

    if connection.vendor == "postgresql":
        # In the batch: evt_1, then evt_2 raised. One by one: evt_1, evt_3, evt_4.
        assert calls == ["evt_1", "evt_2", "evt_1", "evt_3", "evt_4"]
    else:
        assert calls == ["evt_1", "evt_2", "evt_3", "evt_4"]
    assert _states() == {
        "evt_1": "processed",
        "evt_2": "pending",
        "evt_3": "processed",
        "evt_4": "processed",
    }
    failed = InboundEvent.objects.get(event_id="evt_2")
    assert failed.attempt_count == 1 and "RuntimeError: cannot apply evt_2" in failed.last_error
    runs = sorted(HandlerRun.objects.values_list("event__event_id", "outcome"))
    assert runs == [("evt_1", "ok"), ("evt_2", "error"), ("evt_3", "ok"), ("evt_4", "ok")]
    effects = sorted(Tenant.objects.values_list("name", flat=True))
    assert effects == ["effect of evt_1", "effect of evt_3", "effect of evt_4"]
    assert not EntityLock.objects.exists()
    assert set(EntityVersion.objects.values_list("key", flat=True)) == {
        "stripe:cus_1",
        "stripe:cus_3",
        "stripe:cus_4",
    }


def test_an_error_a_handler_swallowed_is_blamed_on_its_own_event(stripe):
    """evt_1's handler swallows a database error and leaves the transaction aborted;
    evt_2's handler then fails on the aborted transaction. One by one, each event in a
    transaction of its own, the blame lands on evt_1 alone."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no aborted transaction: an error leaves it usable")

    def careless(e):
        if e.event_id == "evt_1":
            # Swallowed: the transaction is now aborted.
            with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
                cursor.execute("SELECT 1/0")
        else:
            Tenant.objects.create(name=f"effect of {e.event_id}")

    registration = handlers.Registration("stripe", "*", careless)
    handlers.REGISTRY.append(registration)
    try:
        t0 = int(time.time()) - 600
        _batch_of(("evt_1", t0, "cus_1"), ("evt_2", t0 + 1, "cus_2"))
    finally:
        handlers.REGISTRY.remove(registration)

    assert _states() == {"evt_1": "pending", "evt_2": "processed"}
    assert list(Tenant.objects.values_list("name", flat=True)) == ["effect of evt_2"]
    assert not EntityLock.objects.exists()


def test_in_a_batch_only_the_events_of_a_busy_entity_wait(stripe, applied):
    EntityLock.objects.create(
        key="stripe:cus_9",
        owner="another worker",
        expires_at=timezone.now() + timezone.timedelta(seconds=60),
    )
    t0 = int(time.time()) - 600
    _batch_of(("evt_9", t0, "cus_9"), ("evt_8", t0 + 1, "cus_8"), ("evt_7", t0 + 2, "cus_9"))
    states = {
        e: (s, err, n)
        for e, s, err, n in InboundEvent.objects.values_list(
            "event_id", "state", "last_error", "attempt_count"
        )
    }
    assert states == {
        "evt_9": ("pending", "entity locked", 0),
        "evt_8": ("processed", "", 1),
        "evt_7": ("pending", "entity locked", 0),
    }
    assert [a[0] for a in applied] == ["evt_8"]
    assert list(EntityLock.objects.values_list("key", "owner")) == [
        ("stripe:cus_9", "another worker")
    ]


def test_a_worker_that_dies_between_its_take_and_the_lease_leaves_the_event_late_not_lost(
    stripe, applied, settings
):
    """The database broker's take spends an inbound event's message before the job
    leases the event: a worker that dies in between leaves the event enqueued with no
    message, and the lost-dispatch sweep dispatches it again."""
    from deliveries.jobs import brokers as broker
    from deliveries.jobs.models import QueueMessage
    from deliveries.scheduler import scheduler_tick
    from deliveries.worker import _take

    assert post(stripe_event()).status_code == 200
    relay_tick()
    taken = _take(broker.get_broker(), 10, 60)  # the take commits; the worker dies here

    assert [m.kind for _, m in taken.others["inbound"]] == ["inbound"]
    assert QueueMessage.objects.count() == 0
    assert InboundEvent.objects.get().state == "enqueued"
    settings.SCHEDULER_STALE_ENQUEUED_SECONDS = 0
    assert scheduler_tick().counts["inbound.transport_lost"] == 1
    drain()

    assert InboundEvent.objects.get().state == "processed"
    assert [e[0] for e in applied] == ["evt_1"]


# --- Replays under a fresh id ------------------------------------------------------------

# Sources whose event id is not signed (GitHub's delivery header, Shopify's webhook id, an
# HMAC id header the template leaves out), and the secret each is created with.
UNSIGNED_ID_SOURCES = {
    "github": ({}, "gh-secret"),
    "shopify": ({}, "shopify-secret"),
    "hmac": ({"id_header": "x-event-id"}, "hmac-secret"),
}
SIGNED_ID_SOURCES = {
    "standard": ({}, "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
    "hmac": ({"id_header": "x-event-id", "signed_template": "{id}.{body}"}, "hmac-secret"),
}


def _post_as(scheme: str, options: dict, secret: str, body: bytes, event_id: str, **headers):
    """``body`` signed by ``scheme`` with ``event_id`` where the scheme carries one in a
    header; ``headers`` replace the signed ones (a replay under another id)."""
    signed = get_scheme(scheme, options or None).sign(body=body, secret=secret, event_id=event_id)
    signed.update(headers)
    extra = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in signed.items()}
    extra.pop("HTTP_CONTENT_TYPE", None)
    return Client().post(f"/ingest/{scheme}/", body, content_type="application/json", **extra)


def _id_header(scheme: str, options: dict) -> str:
    return {"github": "x-github-delivery", "shopify": "x-shopify-webhook-id"}.get(
        scheme, options.get("id_header", "")
    )


@pytest.mark.parametrize("scheme", list(UNSIGNED_ID_SOURCES))
def test_a_genuine_body_replayed_under_a_fresh_unsigned_id_is_a_duplicate(scheme):
    options, secret = UNSIGNED_ID_SOURCES[scheme]
    source_create(slug=scheme, scheme=scheme, secrets=[secret], options=options)
    body = json.dumps({"id": 1, "action": "opened", "note": "pay 100"}).encode()
    first = _post_as(scheme, options, secret, body, "delivery-1")
    assert first.json()["status"] == "accepted"

    # The captured request, signature and all, resent under new ids.
    replays = [
        _post_as(
            scheme,
            options,
            secret,
            body,
            "delivery-1",
            **{_id_header(scheme, options): f"forged-{i}"},
        )
        for i in range(3)
    ]

    assert [(r.status_code, r.json()["status"]) for r in replays] == [(200, "duplicate")] * 3
    assert {r.json()["id"] for r in replays} == {first.json()["id"]}
    event = InboundEvent.objects.get()
    assert (event.event_id, event.duplicates) == ("delivery-1", 3)
    # A different body under its own id is a new event.
    other = _post_as(scheme, options, secret, body.replace(b"100", b"101"), "delivery-2")
    assert other.json()["status"] == "accepted"
    assert InboundEvent.objects.count() == 2


@pytest.mark.parametrize("scheme", list(UNSIGNED_ID_SOURCES))
def test_concurrent_replays_under_fresh_ids_store_the_body_once(scheme):
    options, secret = UNSIGNED_ID_SOURCES[scheme]
    source_create(slug=scheme, scheme=scheme, secrets=[secret], options=options)
    body = json.dumps({"id": 7}).encode()
    barrier = threading.Barrier(10)
    statuses: list[str] = []

    def send(i: int):
        try:
            barrier.wait()
            statuses.append(
                _post_as(scheme, options, secret, body, f"delivery-{i}").json()["status"]
            )
        finally:
            connection.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(statuses) == ["accepted"] + ["duplicate"] * 9
    assert InboundEvent.objects.get().duplicates == 9


@pytest.mark.parametrize("scheme", list(SIGNED_ID_SOURCES))
def test_a_signed_id_keeps_two_messages_with_one_body_apart(scheme):
    # Where the id is signed, a second id on the same body is the provider's own doing
    # (a forger cannot sign it): two events, and no second key stored.
    options, secret = SIGNED_ID_SOURCES[scheme]
    source_create(slug=scheme, scheme=scheme, secrets=[secret], options=options)
    body = json.dumps({"id": "same", "type": "t", "data": {}}).encode()
    answers = [_post_as(scheme, options, secret, body, f"msg_{i}").json()["status"] for i in (1, 2)]
    assert answers == ["accepted", "accepted"]
    assert sorted(InboundEvent.objects.values_list("event_id", flat=True)) == ["msg_1", "msg_2"]
    assert not InboundEvent.objects.filter(body_sha256__isnull=False).exists()
    # A replay of one of them, id and all, stays a duplicate on the id.
    assert _post_as(scheme, options, secret, body, "msg_1").json()["status"] == "duplicate"
