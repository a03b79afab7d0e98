"""Retention: terminal history pruned after its window, in bounded batches, identities
kept for their duplicate windows, and nothing non-terminal touched while the pipeline
runs."""

import json
import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.utils import timezone
from django_q.models import Schedule

from deliveries import services
from deliveries.core.retention import prune
from deliveries.jobs.models import LoopRun, Outbox
from deliveries.models import Attempt, Delivery, DeliveryListing, Endpoint, Event
from deliveries.schedules import install_schedules
from ingest import handlers
from ingest.models import HandlerRun, InboundEvent
from ingest.schemes import get_scheme
from ingest.sources import source_create
from tests.conftest import drain

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]

OLD = timedelta(days=40)


def age(model, delta=OLD, **filters) -> None:
    """Move rows back in time (the test's clock)."""
    fields = {
        Delivery: ["created_at", "finished_at"],
        Event: ["created_at"],
        Outbox: ["created_at"],
        InboundEvent: ["received_at"],
    }[model]
    now = timezone.now()
    qs = model.objects.filter(**filters)
    for field in fields:
        qs.filter(**{f"{field}__isnull": False}).update(**{field: now - delta})
    if model is Delivery:  # and the listing's copy of the creation time
        DeliveryListing.objects.filter(delivery__in=qs).update(created_at=now - delta)


def test_prune_removes_terminal_history_past_the_window_and_nothing_else(
    tenant, receiver, settings
):
    settings.RETENTION_DELIVERIES_DAYS = 30
    settings.IDEMPOTENCY_KEY_RETENTION = 60 * 86400
    endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    done = [services.publish_event(tenant=tenant, event_type="t", payload={}) for _ in range(3)]
    drain()
    waiting = services.publish_event(
        tenant=tenant,
        event_type="t",
        payload={},
        deliver_at=timezone.now() + timedelta(days=1),
    )
    keyed = services.publish_event(
        tenant=tenant, event_type="t", payload={}, idempotency_key="key-1"
    )
    drain()
    age(Delivery)
    age(Event)
    age(Outbox)
    unpublished = Outbox.objects.create(
        message_key="x:1", ref_id=uuid.uuid4(), dispatch=1, created_at=timezone.now() - OLD
    )
    assert Attempt.objects.count() == 4

    totals = prune()

    assert totals["deliveries"] == 4 and totals["deliveries.attempt"] == 4
    assert list(Delivery.objects.values_list("event_id", "state")) == [(waiting.id, "pending")]
    assert not Attempt.objects.exists()
    assert list(Outbox.objects.values_list("id", flat=True)) == [unpublished.id]
    # Events go once their deliveries are gone; the one with a live delivery stays, and
    # the one with an Idempotency-Key stays for IDEMPOTENCY_KEY_RETENTION.
    assert totals["events"] == 3
    assert set(Event.objects.values_list("id", flat=True)) == {waiting.id, keyed.id}
    assert not Event.objects.filter(id__in=[e.id for e in done]).exists()
    # The endpoint itself is configuration, never pruned.
    assert Endpoint.objects.filter(id=endpoint.id).exists()

    settings.IDEMPOTENCY_KEY_RETENTION = 10 * 86400
    assert prune()["events"] == 1
    assert not Event.objects.filter(id=keyed.id).exists()


def test_a_retried_create_request_still_finds_its_event_after_its_deliveries_went(
    tenant, receiver, settings
):
    settings.RETENTION_DELIVERIES_DAYS = 1
    settings.IDEMPOTENCY_KEY_RETENTION = 7 * 86400
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    _, key = services.api_key_create(tenant=tenant)
    api = Client(HTTP_AUTHORIZATION=f"Bearer {key}")

    def create():
        return api.post(
            "/api/v1/events/",
            {"event_type": "t", "payload": {"n": 1}},
            content_type="application/json",
            HTTP_IDEMPOTENCY_KEY="retry-me",
        )

    first = create()
    drain()
    age(Delivery, timedelta(days=2))
    age(Event, timedelta(days=2))
    prune()
    assert not Delivery.objects.exists()

    again = create()
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert Event.objects.count() == 1


def test_dry_run_counts_and_deletes_nothing_and_batches_are_bounded(tenant, receiver):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    for _ in range(5):
        services.publish_event(tenant=tenant, event_type="t", payload={})
    drain()
    age(Delivery)
    age(Event)

    assert prune(dry_run=True)["deliveries"] == 5
    assert Delivery.objects.count() == 5

    assert prune(batch_size=2, max_batches=1, only=["deliveries"])["deliveries"] == 2
    assert Delivery.objects.count() == 3

    out = []
    call_command("prune", "--dry-run", "--batch-size", "2", stdout=_Lines(out))
    assert "deliveries: would delete 3" in out
    call_command("prune", "--batch-size", "2", stdout=_Lines(out))
    assert "deliveries: deleted 3" in out
    assert not Delivery.objects.exists() and not Event.objects.exists()


class _Lines:
    def __init__(self, lines):
        self.lines = lines

    def write(self, text):
        self.lines.extend(line for line in text.splitlines() if line)

    def flush(self):
        pass


def test_inbound_identities_survive_the_dedupe_window(settings):
    settings.RETENTION_INBOUND_DAYS = 1
    settings.INBOUND_DEDUPE_WINDOW = 10 * 86400
    source_create(slug="keep", scheme="stripe", secrets=["whsec_keep_secret"])
    registration = handlers.Registration("keep", "*", lambda e: None)
    handlers.REGISTRY.append(registration)
    body = json.dumps(
        {"id": "evt_k", "object": "event", "type": "x", "created": int(time.time())}
    ).encode()

    def post():
        signed = get_scheme("stripe").sign(body=body, secret="whsec_keep_secret")
        signed.pop("content-type", None)
        headers = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in signed.items()}
        return Client().post("/ingest/keep/", body, content_type="application/json", **headers)

    try:
        assert post().json()["status"] == "accepted"
        drain()
        waiting = InboundEvent.objects.create(
            source_id=InboundEvent.objects.get().source_id,
            event_id="evt_waiting",
            body=b"{}",
            state="pending",
            received_at=timezone.now(),
            next_attempt_at=timezone.now() + timedelta(days=30),
        )
        age(InboundEvent, timedelta(days=5))

        # Past its retention, inside the dedupe window: the identity stays.
        assert prune(only=["inbound_events"])["inbound_events"] == 0
        assert post().json()["status"] == "duplicate"

        # Past both: the row and its handler runs go; a pending one never does.
        age(InboundEvent, timedelta(days=11))
        assert prune(only=["inbound_events"])["inbound_events"] == 1
        assert list(InboundEvent.objects.values_list("id", flat=True)) == [waiting.id]
        assert not HandlerRun.objects.exists()
    finally:
        handlers.REGISTRY.remove(registration)


def test_the_overviews_tallies_go_after_the_operations_window(tenant, make_endpoint):
    from deliveries.models import AttemptMinute, EndpointHour

    endpoint = make_endpoint("http://127.0.0.1:9/x")
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    for at in (now - OLD, now):
        AttemptMinute.objects.create(minute=at, outcome="success", writer=1, attempts=3)
        EndpointHour.objects.create(
            hour=at, endpoint=endpoint, outcome="success", writer=1, attempts=3, total_ms=9.0
        )
    assert prune(only=["tallies"])["tallies"] == 2
    assert list(AttemptMinute.objects.values_list("minute", flat=True)) == [now]
    assert list(EndpointHour.objects.values_list("hour", flat=True)) == [now]


def test_loop_runs_and_schedules(settings):
    now = timezone.now()
    LoopRun.objects.create(
        kind="scheduler",
        host="h",
        pid=1,
        started_at=now - OLD,
        heartbeat_at=now - OLD,
        finished_at=now - OLD,
    )
    running = LoopRun.objects.create(
        kind="relay", host="h", pid=2, started_at=now - OLD, heartbeat_at=now
    )
    assert prune(only=["loop_runs"])["loop_runs"] == 1
    assert list(LoopRun.objects.values_list("id", flat=True)) == [running.id]

    assert install_schedules() == ["webhooks: prune", "webhooks: alerts"]
    assert install_schedules() == []
    row = Schedule.objects.get(name="webhooks: prune")
    assert row.func == "deliveries.schedules.prune_pass" and row.minutes == 60
    from django.utils.module_loading import import_string

    assert "deliveries" in import_string(row.func)()


# A trigger on each pruned table records the state of every row deleted, in each
# database's spelling; each statement is run on its own (SQLite's cursor runs one).
_AUDIT = {
    "postgresql": [
        """
CREATE TABLE prune_audit (tbl text, state text, id uuid);
CREATE FUNCTION prune_audit() RETURNS trigger AS $$
BEGIN
    INSERT INTO prune_audit VALUES (TG_TABLE_NAME, OLD.state, OLD.id);
    RETURN OLD;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER delivery_prune_audit BEFORE DELETE ON deliveries_delivery
    FOR EACH ROW EXECUTE FUNCTION prune_audit();
CREATE TRIGGER inbound_prune_audit BEFORE DELETE ON ingest_inboundevent
    FOR EACH ROW EXECUTE FUNCTION prune_audit();
"""
    ],
    "sqlite": [
        "CREATE TABLE prune_audit (tbl text, state text, id text)",
        *(
            f"CREATE TRIGGER {name}_prune_audit BEFORE DELETE ON {table} BEGIN"
            f" INSERT INTO prune_audit VALUES ('{table}', OLD.state, OLD.id); END"
            for name, table in [
                ("delivery", "deliveries_delivery"),
                ("inbound", "ingest_inboundevent"),
            ]
        ),
    ],
}
_AUDIT_DROP = {
    "postgresql": [
        """
DROP TRIGGER IF EXISTS delivery_prune_audit ON deliveries_delivery;
DROP TRIGGER IF EXISTS inbound_prune_audit ON ingest_inboundevent;
DROP FUNCTION IF EXISTS prune_audit() CASCADE;
DROP TABLE IF EXISTS prune_audit;
"""
    ],
    "sqlite": [
        "DROP TRIGGER IF EXISTS delivery_prune_audit",
        "DROP TRIGGER IF EXISTS inbound_prune_audit",
        "DROP TABLE IF EXISTS prune_audit",
    ],
}


def _execute_all(statements: list[str]) -> None:
    with connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)


@pytest.mark.slow
def test_prune_while_the_pipeline_runs_touches_nothing_non_terminal(tenant, receiver):
    """Old terminal history is pruned in small batches while fresh deliveries (their
    rows made to look old too, so only their state protects them) flow through the
    scheduler, relay and workers, and an operator replays old dead letters. A trigger
    records the state of every row deleted: all terminal."""
    receiver.delays["/slow"] = 0.01
    endpoint, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/slow"))
    now = timezone.now()
    # 400 old terminal deliveries, each with an attempt.
    events = Event.objects.bulk_create(
        [Event(tenant=tenant, event_type="old", body=b"{}") for _ in range(400)]
    )
    old = Delivery.objects.bulk_create(
        [
            Delivery(
                event=e,
                endpoint=endpoint,
                tenant=tenant,
                state="dead" if i % 4 == 0 else "succeeded",
                last_outcome="permanent" if i % 4 == 0 else "success",
                next_attempt_at=now,
                finished_at=now,
            )
            for i, e in enumerate(events)
        ]
    )
    Attempt.objects.bulk_create(
        [
            Attempt(delivery=d, number=1, started_at=now, duration_ms=1, outcome="success")
            for d in old
        ]
    )
    age(Delivery)
    age(Event)
    # Fresh work, its rows aged as well.
    live = [services.publish_event(tenant=tenant, event_type="new", payload={}) for _ in range(60)]
    age(Delivery, event__in=live)
    Event.objects.filter(id__in=[e.id for e in live]).update(created_at=now - OLD)
    dead_ids = [d.id for d in old if d.state == "dead"]

    _execute_all(_AUDIT[connection.vendor])
    try:
        stop = threading.Event()
        pruned = []

        def pruner():
            try:
                while not stop.is_set():
                    pruned.append(prune(batch_size=25, max_batches=2)["deliveries"])
            finally:
                connection.close()

        thread = threading.Thread(target=pruner)
        thread.start()
        try:
            replayed = services.delivery_replay(delivery_ids=dead_ids, via="test")
            drain(rounds=50)
        finally:
            stop.set()
            thread.join(60)
        prune()
        with connection.cursor() as cursor:
            cursor.execute("SELECT tbl, state, count(*) FROM prune_audit GROUP BY 1, 2")
            deleted = {(t, s): n for t, s, n in cursor.fetchall()}
    finally:
        _execute_all(_AUDIT_DROP[connection.vendor])

    assert sum(pruned) > 0, "the pruner never ran alongside the pipeline"
    assert {s for (_, s) in deleted} <= {"succeeded", "dead"}, deleted
    # The trigger saw every old delivery that went (so the check above is not empty).
    assert sum(n for (t, _), n in deleted.items() if t == "deliveries_delivery") == 400 - replayed
    # Every fresh delivery went through once, with its attempt kept.
    fresh = Delivery.objects.filter(event__in=live)
    assert fresh.count() == 60 and set(fresh.values_list("state", flat=True)) == {"succeeded"}
    assert Attempt.objects.filter(delivery__in=fresh).count() == 60
    # The replayed dead letters were either pruned before the replay reached them or
    # delivered after it, never lost half-way.
    survivors = Delivery.objects.filter(id__in=dead_ids)
    assert set(survivors.values_list("state", flat=True)) <= {"succeeded"}
    assert survivors.count() == replayed
    assert len(receiver.received) == 60 + replayed
    # The rest of the old history is gone.
    assert Delivery.objects.filter(event__event_type="old").count() == replayed
