"""The inbound event page: the body as received and the headers, with what the source's
redaction rules (and the console's own) say is masked, and nothing it cannot mask."""

import html
import json

import pytest
from django.urls import reverse
from django.utils import timezone

from ingest.models import InboundEvent, Source
from ingest.receiving import NewEvent, inbound_store_many
from ingest.selectors import BODY_SHOWN_CHARS, body_shown, headers_shown
from ingest.sources import source_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def shop():
    return source_create(slug="shop", scheme="standard", secrets=["whsec_" + "c2VjcmV0" * 4])


def store(source: Source, body: bytes, headers: dict | None = None) -> InboundEvent:
    inbound_store_many(
        source=source, events=[NewEvent("evt_1", "order.created", "order_1", timezone.now(), body)]
    )
    event = InboundEvent.objects.get()
    if headers is not None:
        InboundEvent.objects.filter(id=event.id).update(headers=headers)
        event.refresh_from_db()
    return event


def test_the_event_page_shows_the_body_and_headers_with_the_sources_keys_masked(shop, admin_client):
    Source.objects.filter(id=shop.id).update(redact_keys=["Email", "x-shop-token"])
    shop.refresh_from_db()
    body = {
        "order": {"id": 7, "email": "buyer@example.com", "total": "42.00"},
        "customer": [{"Password": "hunter2", "card_number": "4242424242424242", "name": "Ann"}],
    }
    event = store(
        shop,
        json.dumps(body).encode(),
        {"content-type": "application/json", "x-shop-token": "tok-123", "x-shop-domain": "acme"},
    )

    page = admin_client.get(reverse("admin:ingest_inboundevent_change", args=[event.id]))
    assert page.status_code == 200
    content = html.unescape(page.content.decode())
    for secret in ("buyer@example.com", "hunter2", "4242424242424242", "tok-123"):
        assert secret not in content
    assert "[redacted]" in content and '"total": "42.00"' in content and "Ann" in content
    assert "x-shop-domain: acme" in content and "x-shop-token: [redacted]" in content
    assert "bytes" in content


def test_form_data_is_masked_field_by_field_and_json_inside_a_field_too(shop):
    from urllib.parse import quote

    payload = json.dumps({"token": "xoxb-secret", "user": {"name": "ann"}})
    body = b"team_id=T1&token=verification-token&payload=" + quote(payload).encode()
    event = store(shop, body, {"content-type": "application/x-www-form-urlencoded"})
    shown = body_shown(event, shop)
    assert "verification-token" not in shown.text and "xoxb-secret" not in shown.text
    assert "team_id=T1" in shown.text and '"name": "ann"' in shown.text
    assert shown.text.count("[redacted]") == 2


def test_a_body_that_cannot_be_masked_field_by_field_is_not_shown(shop, admin_client):
    event = store(shop, b"card=4242424242424242; not json", {"content-type": "text/plain"})
    shown = body_shown(event, shop)
    assert shown.text == "" and "not JSON or form data" in shown.note
    page = admin_client.get(reverse("admin:ingest_inboundevent_change", args=[event.id]))
    assert b"4242424242424242" not in page.content and b"not JSON or form data" in page.content


def test_a_long_body_is_cut_and_says_so(shop):
    event = store(shop, json.dumps({"items": ["x" * 100] * 400}).encode())
    shown = body_shown(event, shop)
    assert len(shown.text) == BODY_SHOWN_CHARS
    assert f"the first {BODY_SHOWN_CHARS:,} characters shown" in shown.note


def test_headers_are_sorted_and_the_consoles_own_keys_masked(shop):
    event = store(shop, b"{}", {"X-B": "2", "Cookie": "sid=1", "a": "1"})
    assert headers_shown(event, shop) == {"Cookie": "[redacted]", "X-B": "2", "a": "1"}


# --- Poll sources and backfills, made and started from the console ---------------------


@pytest.fixture
def provider():
    from tests.ingest.fake_provider import FakeProvider, StaticRecords

    p = FakeProvider(StaticRecords(300, per_ts=10)).start()
    yield p
    p.stop()


def console_user(*codenames: str):
    from django.contrib.auth.models import Permission, User
    from django.test import Client

    user = User.objects.create_user(f"ops{User.objects.count()}", password="x", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def run_jobs():
    from deliveries.jobs.background.worker import JobWorker

    return JobWorker(queues=["default"], concurrency=2).run(until_idle=True)


@pytest.mark.django_db(transaction=True)
def test_a_poll_source_is_made_and_polled_from_the_console(provider):
    from django_q.models import Schedule

    from deliveries.jobs.models import Job
    from deliveries.models import AuditEntry
    from ingest.models import PollSource

    client = console_user("add_pollsource", "view_pollsource", "change_pollsource")
    r = client.post(
        reverse("admin:ingest_pollsource_add"),
        {
            "slug": "crm",
            "config": json.dumps(provider.config(page_size=100)),
            "auth_secret": "Bearer test-token",
            "every_minutes": "10",
            "schedule": "on",
            "_save": "Save",
        },
    )
    assert r.status_code == 302, r.content[:3000]
    poll = PollSource.objects.select_related("source").get()
    assert (poll.source.slug, poll.source.scheme, poll.every_minutes) == ("crm", "poll", 10)
    assert poll.auth_secret == "Bearer test-token"
    assert Schedule.objects.filter(name="poll:crm", minutes=10).exists()
    assert AuditEntry.objects.filter(action="ingest.pollsource.add").exists()
    page = client.get(reverse("admin:ingest_pollsource_change", args=[poll.id]))
    assert b"Bearer test-token" not in page.content

    # "Poll now" needs its own permission; then it is a job for run_jobs, not the request.
    form = {"action": "poll_now", "_selected_action": [str(poll.id)]}
    client.post(reverse("admin:ingest_pollsource_changelist"), form)
    assert not Job.objects.exists()
    operator = console_user("view_pollsource", "poll_pollsource")
    operator.post(reverse("admin:ingest_pollsource_changelist"), form)
    job = Job.objects.get()
    assert (job.type, job.payload) == ("ingest.poll", {"slug": "crm"})
    assert InboundEvent.objects.count() == 0
    assert AuditEntry.objects.filter(action="poll_source.poll_now").exists()
    run_jobs()
    job.refresh_from_db()
    assert job.state == "done"
    assert InboundEvent.objects.filter(source=poll.source).count() == 300


@pytest.mark.django_db(transaction=True)
def test_a_backfill_is_made_and_started_from_the_console_and_run_by_run_jobs(provider):
    from datetime import timedelta

    from deliveries.jobs.models import Job
    from deliveries.models import AuditEntry
    from ingest.models import BackfillRun
    from ingest.poll_sources import poll_source_create

    poll = poll_source_create(
        slug="crm", config=provider.config(page_size=50), auth_secret="Bearer test-token"
    )
    client = console_user("add_backfillrun", "view_backfillrun", "start_backfillrun")
    add = reverse("admin:ingest_backfillrun_add")
    ten_years_ago = timezone.now() - timedelta(days=3650)
    # The admin's date and time widget: two inputs.
    since = {"since_0": f"{ten_years_ago:%Y-%m-%d}", "since_1": f"{ten_years_ago:%H:%M:%S}"}

    bad = client.post(add, {"source": poll.id, **since, "rate": "0", "_save": "1"})
    assert bad.status_code == 200 and b"rate must be positive" in bad.content
    assert not BackfillRun.objects.exists()

    r = client.post(
        add, {"source": poll.id, **since, "rate": "500", "start_now": "on", "_save": "1"}
    )
    assert r.status_code == 302, r.content[:3000]
    run = BackfillRun.objects.get()
    assert run.started_by.endswith("(console)") and run.state == "running"
    assert run.heartbeat_at is None and InboundEvent.objects.count() == 0  # not run here
    job = Job.objects.get()
    assert (job.type, job.payload) == ("ingest.backfill", {"run_id": str(run.id)})
    assert AuditEntry.objects.filter(action="backfill.start", details__run=str(run.id)).exists()
    # Starting it again before it moved is the same job.
    changelist = reverse("admin:ingest_backfillrun_changelist")
    client.post(changelist, {"action": "start", "_selected_action": [str(run.id)]})
    assert Job.objects.count() == 1

    run_jobs()
    run.refresh_from_db()
    job.refresh_from_db()
    assert (run.state, run.processed, run.total) == ("completed", 300, 300)
    assert (job.state, job.progress_done, job.progress_total) == ("done", 300, 300)
    # Completed: a start is refused with a reason, and enqueues nothing.
    page = client.post(
        changelist, {"action": "start", "_selected_action": [str(run.id)]}, follow=True
    )
    assert b"already completed" in page.content and Job.objects.count() == 1
    # Without the start permission, a run is made but not started.
    maker = console_user("add_backfillrun", "view_backfillrun")
    maker.post(add, {"source": poll.id, **since, "rate": "5", "start_now": "on", "_save": "1"})
    assert BackfillRun.objects.count() == 2 and Job.objects.count() == 1
