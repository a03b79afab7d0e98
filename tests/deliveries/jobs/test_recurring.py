"""Recurring jobs (deliveries.jobs.background.recurring): the scheduler's sweep as their one clock,
each tick enqueued once whoever sweeps and however often, the cron read on the row's
wall clock, and only the latest of the ticks missed while nobody swept."""

import logging
import threading
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ValidationError

from deliveries.jobs import services
from deliveries.jobs.background.recurring import recurring_schedule, tick_key
from deliveries.jobs.background.sweeps import jobs_schedule
from deliveries.jobs.models import Job, RecurringJob
from deliveries.models import AuditEntry
from tests.conftest import in_thread
from tests.deliveries.jobs import sample_jobs  # noqa: F401  (registers the test types)

pytestmark = pytest.mark.django_db(transaction=True)
both = pytest.mark.sqlite
BERLIN = ZoneInfo("Europe/Berlin")


def recurring(name="daily", *, cron="0 9 * * *", zone="Europe/Berlin", start=None, **fields):
    row = services.recurring_job_save(
        recurring_job=RecurringJob(
            name=name, job_type="test.noop", cron=cron, time_zone=zone, **fields
        )
    )
    if start is not None:  # the test's clock: the first tick after ``start``
        from deliveries.jobs.cron import next_tick

        row.next_tick_at = next_tick(cron, zone, after=start)
        RecurringJob.objects.filter(id=row.id).update(next_tick_at=row.next_tick_at)
    return row


@both
@pytest.mark.parametrize(
    ("first_day", "utc_hours"),
    [(datetime(2026, 3, 26, tzinfo=UTC), [8, 8, 8, 7, 7, 7]),
     (datetime(2026, 10, 22, tzinfo=UTC), [7, 7, 7, 8, 8, 8])],
)  # fmt: skip
def test_every_day_at_nine_in_berlin_enqueues_nine_local_across_dst(first_day, utc_hours):
    row = recurring(start=first_day, payload={"label": "daily"})
    for day in range(6):
        # The scheduler sweeps every half second; here at 12:00 UTC and 23:00 UTC each day.
        for hour in (12, 23):
            recurring_schedule(first_day + timedelta(days=day, hours=hour), 100)
    jobs = list(Job.objects.order_by("run_at"))
    assert [j.run_at.astimezone(BERLIN).hour for j in jobs] == [9] * 6
    assert [j.run_at.astimezone(UTC).hour for j in jobs] == utc_hours
    assert [j.idempotency_key for j in jobs] == [tick_key(row.name, j.run_at) for j in jobs]
    assert jobs[0].idempotency_key.startswith("recurring:daily:2026-")
    assert jobs[0].idempotency_key.endswith("+00:00")
    assert all(j.payload == {"label": "daily"} and j.type == "test.noop" for j in jobs)
    row.refresh_from_db()
    assert row.last_scheduled_tick == jobs[-1].run_at
    assert row.next_tick_at == jobs[-1].run_at + timedelta(days=1)


@both
def test_after_downtime_only_the_latest_missed_tick_is_enqueued_and_a_rerun_adds_none():
    now = datetime(2026, 5, 4, 12, 7, 30, tzinfo=UTC)
    row = recurring("every-5", cron="*/5 * * * *", zone="UTC", start=now - timedelta(hours=3))
    assert recurring_schedule(now, 100) == (1, False)
    [job] = Job.objects.all()
    assert job.run_at == datetime(2026, 5, 4, 12, 5, tzinfo=UTC)  # 35 ticks missed, 1 run
    row.refresh_from_db()
    assert row.last_scheduled_tick == job.run_at
    assert row.next_tick_at == datetime(2026, 5, 4, 12, 10, tzinfo=UTC)
    # Rerun at the same instant, and again with the row as a stale sweep read it.
    assert recurring_schedule(now, 100) == (0, False)
    RecurringJob.objects.filter(id=row.id).update(
        next_tick_at=now - timedelta(hours=3), last_scheduled_tick=None
    )
    recurring_schedule(now, 100)
    assert Job.objects.count() == 1


@pytest.mark.slow
def test_concurrent_schedule_sweeps_enqueue_one_job_per_tick():
    start = datetime(2026, 6, 1, 0, 0, 30, tzinfo=UTC)
    rows = [recurring(f"r{i}", cron="* * * * *", zone="UTC", start=start) for i in range(30)]
    errors: list[BaseException] = []
    for minute in range(1, 4):
        now = start + timedelta(minutes=minute)
        barrier = threading.Barrier(6)

        def sweep(now=now, barrier=barrier):
            barrier.wait(timeout=10)
            jobs_schedule(now, 1000)

        threads = [in_thread(sweep, errors) for _ in range(6)]
        for thread in threads:
            thread.join(timeout=60)
        assert not errors
        ticks = Job.objects.filter(run_at=now.replace(second=0))
        assert ticks.count() == len(rows), f"minute {minute}"
    assert Job.objects.count() == 3 * len(rows)
    keys = set(Job.objects.values_list("idempotency_key", flat=True))
    assert len(keys) == 3 * len(rows)


@both
def test_the_job_kinds_schedule_runs_the_recurring_sweep():
    now = datetime(2026, 6, 1, 9, 0, 5, tzinfo=UTC)
    recurring("hourly", cron="0 * * * *", zone="UTC", start=now - timedelta(minutes=30))
    counts, more = jobs_schedule(now, 100)
    assert counts["recurring_enqueued"] == 1 and not more
    assert Job.objects.get().run_at == now.replace(second=0)


@both
def test_a_disabled_row_enqueues_nothing_and_re_enabling_skips_what_it_missed():
    row = recurring("paused", cron="* * * * *", zone="UTC", enabled=False)
    assert row.next_tick_at is None
    recurring_schedule(datetime.now(UTC) + timedelta(hours=1), 100)
    assert not Job.objects.exists()
    row.enabled = True
    services.recurring_job_save(recurring_job=row, changed=["enabled"])
    assert row.next_tick_at > datetime.now(UTC)


@both
def test_an_unknown_type_skips_the_tick_loudly(caplog):
    now = datetime(2026, 6, 1, 9, 0, 5, tzinfo=UTC)
    row = recurring("orphan", cron="0 * * * *", zone="UTC", start=now - timedelta(hours=1))
    RecurringJob.objects.filter(id=row.id).update(job_type="gone.away")
    with caplog.at_level(logging.WARNING, logger="deliveries.jobs"):
        assert recurring_schedule(now, 100) == (0, False)
    assert not Job.objects.exists()
    [record] = [r for r in caplog.records if getattr(r, "action", "") == "recurring.unknown_type"]
    assert record.job_type == "gone.away"
    row.refresh_from_db()
    assert row.next_tick_at == now.replace(minute=0, second=0) + timedelta(hours=1)


@both
def test_the_enqueue_log_names_the_ids_never_the_payload(caplog):
    now = datetime(2026, 6, 1, 9, 0, 5, tzinfo=UTC)
    recurring(
        "logged",
        cron="0 * * * *",
        zone="UTC",
        start=now - timedelta(hours=1),
        payload={"label": "payload-marker-7f3a"},
    )
    with caplog.at_level(logging.DEBUG):
        recurring_schedule(now, 100)
    [record] = [r for r in caplog.records if getattr(r, "action", "") == "recurring.enqueued"]
    assert record.job_id == str(Job.objects.get().id) and record.recurring == "logged"
    assert not any("payload-marker-7f3a" in str(vars(r)) for r in caplog.records)


@both
@pytest.mark.parametrize(
    ("field", "value"),
    [("cron", "every day"), ("cron", "0 9 * * * *"), ("time_zone", "Mars/Olympus"),
     ("job_type", "not.registered"), ("payload", [1, 2])],
)  # fmt: skip
def test_the_service_refuses_a_bad_row_and_saves_nothing(field, value):
    fields = {"name": "bad", "job_type": "test.noop", "cron": "0 9 * * *", field: value}
    with pytest.raises(ValidationError) as refused:
        services.recurring_job_save(recurring_job=RecurringJob(**fields))
    assert field in refused.value.message_dict
    assert not RecurringJob.objects.exists()
    assert not AuditEntry.objects.filter(action="recurring_job.save").exists()


@both
def test_saving_and_deleting_are_audited():
    row = recurring("audited", cron="0 9 * * *")
    services.recurring_jobs_delete(recurring_job_ids=[row.id])
    actions = list(AuditEntry.objects.order_by("id").values_list("action", "count"))
    assert actions == [("recurring_job.save", 1), ("recurring_job.delete", 1)]
    assert not RecurringJob.objects.exists()


def test_rows_scheduled_by_a_sweep_are_locked_from_the_others():
    """PostgreSQL: a second sweep while the first holds its page passes the rows by
    (SKIP LOCKED) instead of waiting for them."""
    now = datetime(2026, 6, 1, 9, 0, 5, tzinfo=UTC)
    recurring("held", cron="0 * * * *", zone="UTC", start=now - timedelta(hours=1))
    from django.db import transaction

    with transaction.atomic():
        list(RecurringJob.objects.select_for_update())
        errors: list[BaseException] = []
        results = []
        thread = in_thread(lambda: results.append(recurring_schedule(now, 100)), errors)
        thread.join(timeout=10)
        assert not thread.is_alive() and not errors
    assert results == [(0, False)]
