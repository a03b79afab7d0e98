"""Emails about one entity run in Date order across takes (ingest.worker, "Sequenced
events"): a take leases its entity's other due emails with it, the ones behind an
unfinished earlier one wait for it (another worker's, a retry, the order window), and
webhooks pay nothing for it. On both databases: the SQLite run covers the statements'
ORM spellings and the one-by-one path."""

import contextlib
import random
import time
import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from deliveries.core.sql import Statement
from deliveries.jobs.brokers import Message
from deliveries.jobs.relay import relay_tick
from deliveries.scheduler import scheduler_tick
from ingest import handlers, schemes
from ingest import worker as processing
from ingest.models import InboundEvent
from ingest.receiving import email_receive
from ingest.sources import source_create
from ingest.state import inbound_schedule
from ingest.statements import LEASE, LEASE_INLINE_BODY_BYTES, TAKE_SEQUENCED
from ingest.worker import WAITING, inbound_process
from tests.conftest import drain, run_workers
from tests.ingest.conftest import ADDRESSES, message, settle

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


@pytest.fixture
def mx():
    return source_create(slug="mx", scheme="smtp", secrets=[], options={"addresses": ADDRESSES})


@pytest.fixture
def ran():
    """The subjects of the emails the handler ran, in the order it ran them; a subject
    starting with "boom" fails."""
    seen: list[str] = []

    @handlers.handler("email", "support@example.com")
    def support(m):
        if m.subject.startswith("boom"):
            raise RuntimeError(m.subject)
        seen.append(m.subject)

    yield seen
    handlers.REGISTRY[:] = [r for r in handlers.REGISTRY if r.func is not support]


def store(source, subject: str, hour: int, entity: str = "t-1"):
    """An email about ``entity`` dated ``hour``:00 on 1 July 2025, stored as the listener
    stores it; returns its event."""
    to = f"support+{entity}@example.com"
    raw = message(to=to, subject=subject, date=f"Tue, 01 Jul 2025 {hour:02}:00:00 +0000")
    received = email_receive(
        source=source, post=schemes.MailPost(raw, (to,), "ann@example.org"), transport="smtp"
    )
    return InboundEvent.objects.get(id=received.event_ids[0])


def due_now(**filters) -> None:
    """Move the clock past what the pending events wait for (a retry, the window)."""
    InboundEvent.objects.filter(state="pending", **filters).update(next_attempt_at=timezone.now())


def messages(*events) -> list[Message]:
    """The messages of ``events``, admitted first if they are due."""
    inbound_schedule(timezone.now(), 1000)
    for event in events:
        event.refresh_from_db()
    return [Message(e.id, e.dispatch_count, kind="inbound") for e in events]


def take(*events):
    """One worker's take of the messages of ``events``."""
    return inbound_process(messages(*events))


def run_until(done, seconds: float = 30) -> None:
    """The pipeline on the real clock until ``done()``."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        drain()
        time.sleep(0.05)


def states() -> dict:
    rows = InboundEvent.objects.values_list("email__subject", "state", "attempt_count")
    return {subject: (state, attempts) for subject, state, attempts in rows}


def test_an_entitys_emails_stored_out_of_order_run_in_date_order_across_takes(mx, ran, settings):
    # A take leases at most one more email along: four of them need several takes.
    settings.WORKER_BATCH_SIZE = 1
    four, _, three, _ = (store(mx, f"{h}:00", h) for h in (4, 2, 3, 1))
    assert settle() == 4
    counts = take(four)
    # 1:00 came along and ran; 4:00 waits behind 2:00, without using up an attempt.
    assert ran == ["1:00"] and counts["held"] == 1
    four.refresh_from_db()
    assert (four.state, four.attempt_count, four.last_error) == ("pending", 0, WAITING)
    assert four.next_attempt_at > timezone.now()
    take(three)  # 2:00 comes along; 4:00, behind 3:00, holds nothing back
    assert ran == ["1:00", "2:00", "3:00"]
    due_now()
    take(four)
    assert ran == ["1:00", "2:00", "3:00", "4:00"]
    assert set(states().values()) == {("processed", 1)}


def test_one_take_runs_every_due_email_of_its_entity_in_date_order(mx, ran):
    events = [store(mx, f"{h}:00", h) for h in (5, 3, 4, 1, 2)]
    settle()
    assert take(events[0])["processed"] == 5  # the message of the latest one
    assert ran == ["1:00", "2:00", "3:00", "4:00", "5:00"]


def test_an_earlier_email_arriving_within_the_window_runs_first(mx, ran, settings):
    settings.INBOUND_EMAIL_ORDER_WINDOW = 1
    store(mx, "later", 10)
    drain()  # a worker comes by before the earlier one arrives: nothing is due yet
    assert ran == []
    store(mx, "earlier", 9)  # within a second of the first: two posts racing
    run_until(lambda: len(ran) == 2)
    assert ran == ["earlier", "later"]


def test_an_earlier_email_arriving_after_the_window_runs_after(mx, ran, settings):
    settings.INBOUND_EMAIL_ORDER_WINDOW = 0.2
    store(mx, "later", 10)
    run_until(lambda: ran)
    store(mx, "earlier", 9)  # too late: the later one has run
    run_until(lambda: len(ran) == 2)
    assert ran == ["later", "earlier"]


def test_an_email_that_is_not_yet_settled_holds_back_the_later_ones(mx, ran):
    later = store(mx, "later", 10)
    store(mx, "earlier", 9)
    InboundEvent.objects.filter(id=later.id).update(next_attempt_at=timezone.now())
    drain()  # the later one is due, the earlier one still in its window
    later.refresh_from_db()
    earlier = InboundEvent.objects.get(email__subject="earlier")
    assert ran == [] and later.state == "pending"
    assert later.next_attempt_at == earlier.next_attempt_at  # it waits for that one
    due_now()
    drain()
    assert ran == ["earlier", "later"]


def test_emails_behind_a_failing_one_wait_for_its_retries_then_its_dead_letter(mx, ran, settings):
    settings.DELIVERY_RETRY_SCHEDULE = [30, 30]
    settings.DELIVERY_RETRY_JITTER = 0
    store(mx, "boom", 9)
    store(mx, "after", 10)
    store(mx, "after too", 11)
    store(mx, "other ticket", 12, entity="t-2")
    settle()
    for attempt in (1, 2, 3):
        drain()
        boom = InboundEvent.objects.get(email__subject="boom")
        assert boom.attempt_count == attempt
        if attempt < 3:
            # Like a queue per entity: the later ones wait for the failing one's retry,
            # without using up attempts of their own; another entity goes on.
            assert ran == ["other ticket"]
            assert boom.state == "pending"
            for behind in InboundEvent.objects.filter(email__subject__startswith="after"):
                assert (behind.state, behind.attempt_count) == ("pending", 0)
                assert behind.next_attempt_at == boom.next_attempt_at
            due_now()
    # Dead after its last attempt: the ones behind it go on, in their order, once each.
    assert boom.state == "dead"
    assert ran == ["other ticket", "after", "after too"]
    assert states()["after"] == ("processed", 1) and states()["after too"] == ("processed", 1)


def test_an_email_waits_while_an_earlier_one_is_leased_by_another_worker(mx, ran):
    first = store(mx, "first", 9)
    second = store(mx, "second", 10)
    other = store(mx, "other ticket", 11, entity="t-2")
    settle()
    inbound_schedule(timezone.now(), 1000)
    first.refresh_from_db()
    with transaction.atomic():  # another worker's lease of the earlier one
        LEASE({"ids": [first.id], "dispatches": [first.dispatch_count],
               "token": uuid.uuid4(),
               "until": timezone.now() + timedelta(minutes=1),
               "inline_body_bytes": LEASE_INLINE_BODY_BYTES})  # fmt: skip
    counts = take(second, other)
    assert ran == ["other ticket"] and counts["held"] == 1  # entities interleave freely
    second.refresh_from_db()
    assert (second.state, second.attempt_count) == ("pending", 0)
    assert second.next_attempt_at <= timezone.now() + timedelta(seconds=1)


def test_two_entities_interleave_in_date_order_each(mx, ran):
    for subject, hour, entity in [("a2", 12, "a"), ("b1", 9, "b"), ("a1", 10, "a"),
                                  ("b2", 11, "b"), ("b3", 13, "b")]:  # fmt: skip
        store(mx, subject, hour, entity=entity)
    settle()
    drain()
    assert [s for s in ran if s[0] == "a"] == ["a1", "a2"]
    assert [s for s in ran if s[0] == "b"] == ["b1", "b2", "b3"]
    assert set(states().values()) == {("processed", 1)}


def test_concurrent_takes_keep_each_entitys_date_order(mx, settings):
    """Three entities' emails stored in a shuffled order, run by four lanes taking two
    messages at a time (and leasing at most two more along): each entity's in Date
    order, each once."""
    settings.WORKER_BATCH_SIZE = 2
    seen: list[tuple[str, int]] = []

    @handlers.handler("email", "support@example.com")
    def record(m):
        seen.append((m.entity_id, m.occurred_at.hour))

    stored = [(entity, hour) for entity in ("a", "b", "c") for hour in range(1, 9)]
    random.Random(42).shuffle(stored)
    try:
        for entity, hour in stored:
            store(mx, f"{entity}{hour}", hour, entity=entity)
        settle()
        # Rounds, not seconds, bound the drain (a loaded machine makes each round slow):
        # it stops when ten rounds in a row run nothing new.
        idle_rounds = 0
        while len(seen) < len(stored) and idle_rounds < 10:
            before = len(seen)
            due_now()  # the clock past every wait: held emails are taken again at once
            scheduler_tick()
            relay_tick()
            run_workers(lanes=4, batch_size=2)
            idle_rounds = idle_rounds + 1 if len(seen) == before else 0
    finally:
        handlers.REGISTRY[:] = [r for r in handlers.REGISTRY if r.func is not record]
    for entity in ("a", "b", "c"):
        assert [h for e, h in seen if e == entity] == list(range(1, 9))
    assert set(states().values()) == {("processed", 1)}


# --- What webhooks pay ------------------------------------------------------------------


@contextlib.contextmanager
def statements(monkeypatch):
    """Every statement run meanwhile: the ORM's and the ``Statement``s bound on the
    server (which bypass Django's cursor)."""
    ran: list[str] = []
    original = Statement._execute

    def bound(self, db, params):
        ran.append(self.sql)
        return original(self, db, params)

    def wrapper(execute, sql, params, many, context):
        ran.append(sql)
        return execute(sql, params, many, context)

    monkeypatch.setattr(Statement, "_execute", bound)
    with connection.execute_wrapper(wrapper):
        yield ran


def webhooks_taken(monkeypatch, *, sequencing: bool) -> list[str]:
    from ingest.receiving import NewEvent, inbound_store_many

    source = source_create(slug=f"stripe-{sequencing}", scheme="stripe", secrets=["whsec_x"])
    at = timezone.now() - timedelta(minutes=1)
    page = [NewEvent(f"evt_{i}", "invoice.paid", f"in_{i % 2}", at, b"{}") for i in range(3)]
    inbound_store_many(source=source, events=page)
    taken = messages(*InboundEvent.objects.filter(source=source))
    if not sequencing:
        monkeypatch.setattr(processing, "_in_sequence", lambda rows, *args: rows)
    with statements(monkeypatch) as ran:
        assert inbound_process(taken)["skipped"] == 3
    monkeypatch.undo()
    return ran


def test_webhooks_run_the_same_statements_as_without_sequencing(monkeypatch):
    """Webhooks with entities, taken with the sequencing step and with it cut out: the
    same statements, so they wait for nothing and pay nothing for it."""
    with_sequencing = webhooks_taken(monkeypatch, sequencing=True)
    without = webhooks_taken(monkeypatch, sequencing=False)
    assert len(with_sequencing) == len(without) > 0
    assert TAKE_SEQUENCED.sql not in with_sequencing


@pytest.mark.skipif(connection.vendor != "postgresql", reason="one statement on PostgreSQL")
def test_emails_with_an_entity_cost_one_statement_more(monkeypatch, mx, ran):
    store(mx, "2:00", 2)
    store(mx, "1:00", 1)
    settle()
    taken = messages(*InboundEvent.objects.all())
    with statements(monkeypatch) as run:
        inbound_process(taken)
    assert run.count(TAKE_SEQUENCED.sql) == 1 and ran == ["1:00", "2:00"]
