"""Backfill: rate limited, checkpointed, resumable, deduplicated with polling."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db.models import Sum

from ingest.backfill import backfill_run_create, backfill_run_execute
from ingest.models import BackfillRun, InboundEvent
from ingest.poll_sources import poll_source_create, poll_source_run
from tests.conftest import subprocess_env
from tests.ingest.fake_provider import BASE, FakeProvider, StaticRecords

TOKEN = "Bearer test-token"
UNTIL = "2024-02-01T00:00:00Z"


@pytest.fixture
def provider():
    p = FakeProvider(StaticRecords(2000, per_ts=10)).start()
    yield p
    p.stop()


@pytest.fixture
def crm(provider):
    return poll_source_create(
        slug="crm", config=provider.config(page_size=100), auth_secret=TOKEN, schedule=False
    )


def request_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


@pytest.mark.django_db
def test_backfill_command_reads_the_window_with_progress_and_a_summary(crm, provider, capsys):
    # 5/s: a 100-record page must be stored within the interval for the limit to bind
    # (about 130 ms on a machine whose Python ran ten times slower, where 10/s paced 7.8/s).
    call_command("backfill", "crm", "--since", "2024-01-01", "--until", UNTIL, "--rate", "5/s")
    out, err = capsys.readouterr()
    run = BackfillRun.objects.get()
    assert run.state == "completed" and run.finished_at is not None
    assert (run.processed, run.stored, run.duplicates, run.pages) == (2000, 2000, 0, 20)
    assert run.requests == len(provider.requests) == 20
    assert run.total == 2000 and run.rate == 5 and "@" in run.started_by
    assert InboundEvent.objects.filter(source=crm.source).count() == 2000
    assert f"Backfill {run.id} completed: 2,000 records read, 2,000 stored" in out
    assert "100.0%" in err and "req/s" in err and "ETA" in err
    rate = request_rate([t for t, _ in provider.requests])
    assert rate == pytest.approx(5, rel=0.05)


@pytest.mark.django_db
def test_the_progress_line_reads_the_providers_total_and_the_last_line_counts_once(crm):
    """A window much wider than the data: by the window, the first page would read 0.0%
    with an ETA of days; the provider's total (2,000) is what the line goes by. The last
    line, drawn after the run row was reloaded with this run's counts, counts them once."""
    from ingest.management.commands.backfill import Command

    command = Command()
    run = backfill_run_create(slug="crm", since=BASE, until=BASE.replace(year=2026), rate=1000)
    lines = []
    segment = backfill_run_execute(
        run_id=run.id, on_page=lambda seg: lines.append(command._line(seg))
    )
    assert len(lines) == 20
    assert " 5.0%  100 of 2,000 records" in lines[0]
    assert "ETA" in lines[0] and "h" not in lines[0].split("ETA")[1].split()[0]
    assert " 50.0%  1,000 of 2,000 records" in lines[9]
    final = command._line(segment)
    assert segment.run.processed == 2000
    assert "100.0%  2,000 of 2,000 records" in final

    resumed = backfill_run_create(slug="crm", since=BASE, until=BASE.replace(year=2026), rate=1000)
    pages = []
    backfill_run_execute(
        run_id=resumed.id, should_stop=lambda: len(pages) >= 3, on_page=pages.append
    )
    lines = []
    backfill_run_execute(run_id=resumed.id, on_page=lambda seg: lines.append(command._line(seg)))
    # 300 before the resume, then a page from the checkpoint's time that skips the 10
    # records already read at it.
    assert " 19.5%  390 of 2,000 records" in lines[0]


@pytest.mark.django_db
def test_an_interrupted_backfill_resumes_from_its_checkpoint_and_stores_each_record_once(
    crm, provider
):
    run = backfill_run_create(slug="crm", since=BASE, until=BASE.replace(month=2), rate=1000)
    pages = []
    segment = backfill_run_execute(
        run_id=run.id, should_stop=lambda: len(pages) >= 7, on_page=pages.append
    )
    run.refresh_from_db()
    assert run.state == "interrupted" and run.processed == 700 == segment.counts["processed"]
    assert run.checkpoint_at is not None and len(run.checkpoint_ids) == 10
    backfill_run_execute(run_id=run.id)
    run.refresh_from_db()
    assert run.state == "completed" and run.resumes == 1
    assert (run.processed, run.stored, run.duplicates) == (2000, 2000, 0)
    events = InboundEvent.objects.filter(source=crm.source)
    assert events.count() == 2000 and events.aggregate(d=Sum("duplicates"))["d"] == 0
    with pytest.raises(Exception, match="already completed"):
        backfill_run_execute(run_id=run.id)


@pytest.mark.django_db
def test_a_backfill_overlapping_polling_creates_no_duplicates(crm, provider):
    poll_source_run(slug="crm")
    assert InboundEvent.objects.count() == 2000
    run = backfill_run_create(slug="crm", since=BASE, until=BASE.replace(month=2), rate=1000)
    backfill_run_execute(run_id=run.id)
    run.refresh_from_db()
    assert (run.stored, run.duplicates) == (0, 2000)
    assert InboundEvent.objects.count() == 2000


@pytest.mark.django_db
def test_a_dry_run_counts_and_stores_nothing(crm, provider, capsys):
    call_command(
        "backfill", "crm", "--since", "2024-01-01", "--until", UNTIL, "--rate", "100", "--dry-run"
    )
    out = capsys.readouterr().out
    assert "2,000 records in 20 pages" in out and "2,000 would be stored" in out
    assert InboundEvent.objects.count() == 0 and BackfillRun.objects.count() == 0


@pytest.mark.django_db
def test_a_failing_provider_is_retried_then_the_run_fails_resumably(crm, provider, settings):
    settings.BACKFILL_RETRIES = 1
    provider.fail_next = [503]
    run = backfill_run_create(slug="crm", since=BASE, until=BASE.replace(month=2), rate=1000)
    backfill_run_execute(run_id=run.id)
    run.refresh_from_db()
    assert run.state == "completed" and run.requests == 21  # one retried
    provider.fail_next = [503, 503]
    again = backfill_run_create(slug="crm", since=BASE, until=BASE.replace(month=2), rate=1000)
    backfill_run_execute(run_id=again.id)
    again.refresh_from_db()
    assert again.state == "failed" and "HTTP 503" in again.error


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args, message",
    [
        (["--since", "yesterday"], "not a date"),
        (["--since", "2024-02-01", "--until", "2024-01-01"], "must be before"),
        (["--since", "2024-01-01", "--rate", "fast"], "--rate"),
        (["--resume", "not-a-run"], "no backfill run"),
        (["--resume", "not-a-run", "--rate", "10/s"], "run's own window, rate"),
        (["--resume", "not-a-run", "--page-size", "10"], "run's own window, rate"),
        ([], "--since is required"),
    ],
)
def test_bad_arguments_are_clear_errors(crm, args, message):
    with pytest.raises(Exception, match=message):
        call_command("backfill", "crm", *args)


N = 100_000
PAGE_SIZE = 1000
# The rate is measured as the limit that binds, so a page's work (storing 1,000 events)
# must fit in 1/RATE: 200-350 ms on the usual 2-core test machine, about 550 ms on one
# whose Python ran ten times slower, where 2/s paced 1.81/s.
RATE = 1.0


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_backfill_of_100k_records_killed_with_kill_9_and_resumed_stores_each_once():
    provider = FakeProvider(StaticRecords(N, per_ts=10)).start()
    try:
        crm = poll_source_create(
            slug="crm", config=provider.config(page_size=PAGE_SIZE), auth_secret=TOKEN
        )
        env = subprocess_env()
        root = Path(__file__).resolve().parents[2]
        command = [sys.executable, str(root / "manage.py"), "backfill", "crm"]
        window = ["--since", "2024-01-01", "--until", UNTIL, "--rate", f"{RATE}/s"]
        first = subprocess.Popen(
            [*command, *window, "--page-size", str(PAGE_SIZE)],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        deadline = time.monotonic() + 240  # against a hang: 40 pages take 40 s
        run = None
        while time.monotonic() < deadline:
            run = BackfillRun.objects.filter(source=crm).first()
            if run is not None and run.processed >= 40_000:
                break
            time.sleep(0.05)
        assert run is not None and run.processed >= 40_000
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        killed_at = len(provider.requests)
        run.refresh_from_db()
        assert run.state == "running" and run.processed < N  # killed, not finished
        resumed = subprocess.run(
            [*command, "--resume", str(run.id)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert resumed.returncode == 0, resumed.stderr[-2000:]
    finally:
        provider.stop()
    run.refresh_from_db()
    assert run.state == "completed" and run.resumes == 1
    events = InboundEvent.objects.filter(source=crm.source)
    assert events.count() == N
    assert events.values("event_id").distinct().count() == N
    assert events.aggregate(d=Sum("duplicates"))["d"] == 0
    assert run.stored == N and run.duplicates == 0
    times = [t for t, _ in provider.requests]
    before, after = times[:killed_at], times[killed_at:]
    assert len(before) >= 30 and len(after) >= 30
    assert request_rate(before) == pytest.approx(RATE, rel=0.05)
    assert request_rate(after) == pytest.approx(RATE, rel=0.05)
    print(
        f"kill -9 at {killed_at} requests; rate before {request_rate(before):.3f}/s, "
        f"after {request_rate(after):.3f}/s (limit {RATE}/s)"
    )


@pytest.mark.django_db
def test_the_rest_api_reports_a_tenants_run_progress_and_hides_other_tenants_runs():
    from rest_framework.test import APIClient

    from deliveries import services

    alice, alice_key = services.tenant_create(name="alice")
    _bob, bob_key = services.tenant_create(name="bob")
    poll_source_create(
        slug="crm", config={"url": "https://example.com/r"}, tenant=alice, schedule=False
    )
    run = backfill_run_create(slug="crm", since=BASE, until=BASE.replace(month=2), rate=4)
    BackfillRun.objects.filter(id=run.id).update(
        processed=5000,
        requests=50,
        active_seconds=25.0,
        checkpoint_at=BASE.replace(day=11),
        heartbeat_at=BASE,
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {alice_key}")
    body = client.get(f"/api/v1/backfill-runs/{run.id}/").json()
    assert body["state"] == "running" and body["processed"] == 5000
    assert body["checkpoint"].startswith("2024-01-11T00:00:00")
    assert body["progress"] == pytest.approx(10 / 31, abs=1e-3)
    assert body["records_per_second"] == 200.0 and body["requests_per_second"] == 2.0
    assert body["eta_seconds"] == pytest.approx(25 * 21 / 10, rel=1e-3)
    assert "started_by" not in body
    assert [r["id"] for r in client.get("/api/v1/backfill-runs/").json()["results"]] == [
        str(run.id)
    ]
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {bob_key}")
    assert client.get(f"/api/v1/backfill-runs/{run.id}/").status_code == 404
    assert client.get("/api/v1/backfill-runs/").json()["results"] == []


@pytest.mark.django_db
def test_staff_see_runs_and_their_progress_in_the_admin(crm, admin_client):
    run = backfill_run_create(slug="crm", since=BASE, until=BASE.replace(month=2), rate=4)
    BackfillRun.objects.filter(id=run.id).update(
        processed=1234, checkpoint_at=BASE.replace(day=11), active_seconds=10, heartbeat_at=BASE
    )
    page = admin_client.get("/admin/ingest/backfillrun/")
    assert page.status_code == 200 and b"1,234" in page.content and b"32%" in page.content
    detail = admin_client.get(f"/admin/ingest/backfillrun/{run.id}/change/")
    assert detail.status_code == 200 and b"ETA" in detail.content
    source_page = admin_client.get(f"/admin/ingest/pollsource/{crm.id}/change/")
    assert source_page.status_code == 200 and TOKEN.encode() not in source_page.content
