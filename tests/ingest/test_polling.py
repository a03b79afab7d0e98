"""Polling with a cursor over the data, against a fake provider API over real HTTP."""

import ast
import threading
import time
from collections import Counter
from datetime import UTC, datetime

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.models import Sum
from django.utils.module_loading import import_string
from django_q.models import Schedule

from deliveries.jobs.models import EntityLock
from ingest import handlers
from ingest.changes import Cursor, HttpJsonAdapter, Record, TokenBucket
from ingest.leases import Lease
from ingest.models import InboundEvent, PollSource
from ingest.poll_sources import poll_source_create, poll_source_run
from tests.conftest import drain
from tests.ingest.fake_provider import FakeProvider, LiveRecords, StaticRecords

pytestmark = pytest.mark.sqlite

TOKEN = "Bearer test-token"
PAGE = 50


@pytest.fixture
def live():
    provider = FakeProvider(LiveRecords(skew=1.0, tick_ms=50)).start()
    yield provider
    provider.stop()


def make_source(provider, slug="crm", **config) -> PollSource:
    return poll_source_create(
        slug=slug,
        config=provider.config(page_size=PAGE, **config),
        auth_secret=TOKEN,
        schedule=False,
    )


def run_scenario(provider, poll_once, seconds=3.0) -> int:
    """Writers insert and update records (every 20th write is a burst of 120 records at
    one updated_at, more than a page) while ``poll_once`` runs over and over; then the
    writers stop and two last polls run after the provider's clock moved on."""
    records: LiveRecords = provider.records
    stop = threading.Event()

    def write():
        n = 0
        while not stop.is_set():
            n += 1
            if n % 20 == 0:
                records.write(inserts=60, updates=60)
            else:
                records.write(inserts=2, updates=3)
            time.sleep(0.004)

    writer = threading.Thread(target=write)
    writer.start()
    polls = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            poll_once()
            polls += 1
    finally:
        stop.set()
        writer.join()
    time.sleep(records.tick_ms / 1000 + 0.05)
    poll_once()
    poll_once()
    return polls


def most_sharing_one_timestamp(written) -> int:
    return max(Counter(v.split("@")[1] for v in written).values())


@pytest.mark.django_db
def test_every_record_version_written_is_stored_exactly_once_while_records_keep_changing(live):
    source = make_source(live)
    results = []
    polls = run_scenario(live, lambda: results.append(poll_source_run(slug="crm")))
    written = live.records.written
    assert len(written) == len(set(written)) > 1000
    assert most_sharing_one_timestamp(written) > PAGE  # ties across page boundaries
    assert polls >= 5 and all(r.outcome == "polled" for r in results)
    events = InboundEvent.objects.filter(source=source.source)
    stored = Counter(events.values_list("event_id", flat=True))
    assert set(stored) == set(written)  # nothing lost
    assert sum(stored.values()) == len(written)  # nothing twice
    # And no re-read even reached the unique constraint: the cursor's ids skipped them.
    assert events.aggregate(d=Sum("duplicates"))["d"] == 0
    assert sum(r.counts["duplicates"] for r in results) == 0
    source.refresh_from_db()
    top = max(datetime.fromisoformat(v.split("@")[1]) for v in written)
    assert source.cursor_at == top


class NaivePoller:
    """What the design avoids: ``since = last_run_time`` on our clock."""

    def __init__(self, provider):
        self.adapter = HttpJsonAdapter(provider.config(page_size=PAGE), auth_secret=TOKEN)
        self.last_run = None
        self.seen: Counter = Counter()

    def poll(self):
        started = datetime.now(UTC)
        token = None
        while True:
            page = self.adapter.list_changed(since=self.last_run, page_token=token, page_size=PAGE)
            self.seen.update(r.event_id for r in page.records)
            if page.next_token is None:
                break
            token = page.next_token
        self.last_run = started


def test_a_naive_since_last_run_time_poller_loses_records_in_the_same_scenario(live):
    # The provider's clock runs a second behind ours (any skew will do): a record written
    # just after a run started is stamped before that run's start, and the next run,
    # asking for changes since then, never sees it.
    naive = NaivePoller(live)
    try:
        run_scenario(live, naive.poll)
    finally:
        naive.adapter.close()
    written = set(live.records.written)
    lost = written - set(naive.seen)
    assert len(lost) > 0.05 * len(written), (len(lost), len(written))


@pytest.mark.django_db
def test_a_second_poll_reads_the_cursor_time_again_and_stores_nothing():
    provider = FakeProvider(StaticRecords(300, per_ts=150)).start()
    try:
        source = make_source(provider)
        first = poll_source_run(slug="crm")
        second = poll_source_run(slug="crm")
    finally:
        provider.stop()
    assert first.counts["stored"] == 300 and first.counts["pages"] == 6
    # The 150 records at the cursor's updated_at come back (>=) and are skipped by id.
    assert second.counts["skipped"] == 150 and second.counts["stored"] == 0
    assert second.counts["duplicates"] == 0
    assert InboundEvent.objects.filter(source=source.source).count() == 300
    source.refresh_from_db()
    assert len(source.cursor_ids) == 150


@pytest.mark.django_db
def test_records_at_or_after_the_signpost_wait_for_the_next_run(live):
    records: LiveRecords = live.records
    source = make_source(live)
    records.now_ms = lambda: 1_700_000_000_000  # the provider's clock stands still
    records.write(inserts=3, updates=0)
    run = poll_source_run(slug="crm")
    # The provider may still write records stamped with its current time, even with
    # smaller ids than ours: the cursor must not pass them.
    assert run.counts["records"] == 3 and run.counts["stored"] == 0
    source.refresh_from_db()
    assert source.cursor_at is None
    records.now_ms = lambda: 1_700_000_000_050
    records.write(inserts=1, updates=0)
    run = poll_source_run(slug="crm")
    assert run.counts["stored"] == 3  # the fourth is at the new signpost
    source.refresh_from_db()
    assert source.cursor_at == datetime.fromtimestamp(1_700_000_000, UTC)


@pytest.mark.django_db
def test_a_run_finds_the_lease_held_and_does_nothing():
    provider = FakeProvider(StaticRecords(10)).start()
    try:
        source = make_source(provider)
        holder = Lease(f"poll:{source.id}", ttl=60)
        assert holder.acquire()
        assert poll_source_run(slug="crm").outcome == "leased"
        assert provider.requests == []
        holder.release()
        assert poll_source_run(slug="crm").counts["stored"] == 10
    finally:
        provider.stop()


@pytest.mark.django_db
def test_a_lease_left_by_a_killed_process_on_this_host_is_taken_over():
    import socket

    EntityLock.objects.create(
        key="poll:x",
        owner=f"{socket.gethostname()}:999999999:dead",
        expires_at=datetime(2999, 1, 1, tzinfo=UTC),
    )
    assert Lease("poll:x", ttl=60).acquire()
    EntityLock.objects.filter(key="poll:y").delete()
    EntityLock.objects.create(
        key="poll:y", owner="another-host:1:alive", expires_at=datetime(2999, 1, 1, tzinfo=UTC)
    )
    assert not Lease("poll:y", ttl=60).acquire()


@pytest.mark.django_db(transaction=True)
def test_overlapping_runs_of_one_source_read_each_record_once():
    provider = FakeProvider(StaticRecords(2000, per_ts=7)).start()
    try:
        source = make_source(provider)
        outcomes = []
        barrier = threading.Barrier(4)

        def run():
            barrier.wait()
            try:
                outcomes.append(poll_source_run(slug="crm"))
            finally:
                connection.close()

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        provider.stop()
    assert sum(r.counts["stored"] for r in outcomes) == 2000
    assert {r.outcome for r in outcomes} <= {"polled", "leased"}
    assert "leased" in {r.outcome for r in outcomes}
    events = InboundEvent.objects.filter(source=source.source)
    assert events.count() == 2000
    assert events.aggregate(d=Sum("duplicates"))["d"] == 0


@pytest.mark.django_db(transaction=True)
def test_polled_records_go_through_the_handlers_under_the_entity_lock():
    seen, held = [], []

    def handler(event):
        seen.append(event)
        # The handler runs inside the processing transaction, which holds the lock.
        held.append(EntityLock.objects.filter(key=f"crm:{event.entity_id}").exists())

    registration = handlers.Registration("crm", "record.updated", handler)
    handlers.REGISTRY.append(registration)
    provider = FakeProvider(StaticRecords(5)).start()
    try:
        make_source(provider)
        poll_source_run(slug="crm")
        drain()
    finally:
        provider.stop()
        handlers.REGISTRY.remove(registration)
    assert sorted(e.entity_id for e in seen) == [f"r{i:07d}" for i in range(5)]
    first = next(e for e in seen if e.entity_id == "r0000000")
    assert first.event_id == "r0000000@2024-01-01T00:00:00.000Z"
    assert first.payload["name"] == "record 0"
    assert first.occurred_at == datetime(2024, 1, 1, tzinfo=UTC)
    assert set(InboundEvent.objects.values_list("state", flat=True)) == {"processed"}
    assert held == [True] * 5
    assert not EntityLock.objects.filter(key__startswith="crm:").exists()  # given back


@pytest.mark.django_db
def test_the_poller_goes_through_the_egress_guard(settings):
    provider = FakeProvider(StaticRecords(5)).start()
    try:
        make_source(provider)
        settings.EGRESS_ALLOW_NETWORKS = []  # loopback is refused by default
        result = poll_source_run(slug="crm")
    finally:
        provider.stop()
    assert result.outcome == "failed" and "blocked" in result.error
    assert provider.requests == []  # refused before connecting
    poll_source_create(
        slug="metadata", config={"url": "http://169.254.169.254/latest/"}, schedule=False
    )
    settings.EGRESS_ALLOW_NETWORKS = ["0.0.0.0/0"]
    result = poll_source_run(slug="metadata")
    assert result.outcome == "failed" and "cloud metadata" in result.error
    assert PollSource.objects.get(source__slug="metadata").last_error == result.error


@pytest.mark.django_db
def test_a_bad_page_stores_nothing_and_keeps_the_cursor():
    provider = FakeProvider(StaticRecords(10)).start()
    try:
        source = make_source(provider, auth_header="Authorization")
        source.auth_secret = "Bearer wrong"
        source.save()
        result = poll_source_run(slug="crm")
    finally:
        provider.stop()
    assert result.outcome == "failed" and "HTTP 401" in result.error
    assert InboundEvent.objects.count() == 0
    source.refresh_from_db()
    assert source.cursor_at is None and "wrong" not in source.last_error


@pytest.mark.django_db
def test_each_source_gets_a_schedule_that_calls_the_poll_unit():
    provider = FakeProvider(StaticRecords(3)).start()
    try:
        poll = poll_source_create(
            slug="crm", config=provider.config(), auth_secret=TOKEN, every_minutes=10
        )
        schedule = Schedule.objects.get(name="poll:crm")
        assert schedule.minutes == 10 and schedule.schedule_type == Schedule.MINUTES
        counts = import_string(schedule.func)(**ast.literal_eval(schedule.kwargs))
    finally:
        provider.stop()
    assert counts["outcome"] == "polled" and counts["stored"] == 3
    assert InboundEvent.objects.filter(source=poll.source).count() == 3


@pytest.mark.django_db
def test_poll_once_command(capsys):
    provider = FakeProvider(StaticRecords(4)).start()
    try:
        make_source(provider)
        call_command("poll", "crm", "--once")
    finally:
        provider.stop()
    out = capsys.readouterr().out
    assert "crm: polled" in out and "stored=4" in out
    with pytest.raises(Exception, match="no poll source"):
        call_command("poll", "nope", "--once")


@pytest.mark.django_db
def test_a_polled_source_refuses_webhook_posts():
    from django.test import Client

    poll_source_create(slug="crm", config={"url": "https://example.com/r"}, schedule=False)
    response = Client().post("/ingest/crm/", b"{}", content_type="application/json")
    assert response.status_code == 401
    assert InboundEvent.objects.count() == 0


def test_the_cursor_keeps_the_ids_at_its_time_and_never_goes_back():
    t1, t2 = datetime(2024, 1, 1, tzinfo=UTC), datetime(2024, 1, 2, tzinfo=UTC)

    def rec(rid, at):
        return Record(id=rid, updated_at=at, updated_at_raw=at.isoformat(), event_type="", body=b"")

    c = Cursor().advanced([rec("a", t1), rec("b", t2), rec("c", t2)])
    assert c == Cursor(t2, frozenset({"b", "c"}))
    c = c.advanced([rec("d", t2)])
    assert c.ids == {"b", "c", "d"} and c.seen(rec("b", t2)) and not c.seen(rec("b", t1))
    assert c.advanced([rec("z", t1)]) == c


def test_the_token_bucket_paces_takes_at_the_rate():
    now = [0.0]

    def sleep(s):
        now[0] += s

    bucket = TokenBucket(4.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(41):
        bucket.take()
    assert now[0] == pytest.approx(10.0)


def test_the_token_bucket_makes_up_for_a_slow_step_without_opening_with_a_burst():
    now = [0.0]

    def sleep(s):
        now[0] += s

    bucket = TokenBucket(4.0, clock=lambda: now[0], sleep=sleep)
    bucket.take()
    bucket.take()
    assert now[0] == pytest.approx(0.25)  # no burst at the start
    now[0] += 1.0  # a slow step: a second's worth of tokens accrues, no more
    for _ in range(4):
        bucket.take()
    assert now[0] == pytest.approx(1.25)
    bucket.take()
    assert now[0] == pytest.approx(1.5)
