"""The background jobs in the admin (deliveries.jobs.admin): the list and its filters,
a job's runs and progress, the dead jobs page, replay and cancel behind their own
permissions with the replay-safe confirmation, and the recurring jobs' form."""

from datetime import timedelta
from zoneinfo import ZoneInfo

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from deliveries.jobs.background import enqueue, job
from deliveries.jobs.models import Job, JobRun, JobState, RecurringJob
from deliveries.models import AuditEntry
from tests.deliveries.jobs import sample_jobs  # noqa: F401  (registers the test types)

pytestmark = pytest.mark.django_db
CHANGELIST = "/admin/trusty_jobs/job/"


@job("test.charge_card", owner="payments team", replay_safe=False)
def charge_card(**_):
    return None


def dead(type_="test.noop", reason="attempts exhausted (5): boom") -> Job:
    row = enqueue(type_, {"card": "card-marker-93b1"})
    Job.objects.filter(id=row.id).update(
        state=JobState.DEAD, dead_reason=reason, finished_at=timezone.now(), attempts=5
    )
    return row


def staff(*codenames: str) -> Client:
    user = User.objects.create_user("op-" + "-".join(codenames), is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def post_action(client, action, ids, **extra):
    return client.post(
        CHANGELIST, {"action": action, ACTION_CHECKBOX_NAME: [str(i) for i in ids], **extra}
    )


def test_the_list_filters_by_state_type_queue_and_tenant(admin_client):
    a, b = enqueue("test.noop", tenant=None), dead("test.mark")
    r = admin_client.get(CHANGELIST, {"state__exact": "dead", "type": "test.mark"})
    assert r.status_code == 200
    assert [j.id for j in r.context["cl"].result_list] == [b.id]
    assert admin_client.get(CHANGELIST, {"queue": "default"}).context["cl"].result_count == 2
    assert admin_client.get(CHANGELIST, {"q": str(a.id)}).context["cl"].result_count == 1


def test_a_jobs_page_shows_its_runs_progress_and_its_types_owner(admin_client):
    row = dead("test.charge_card")
    now = timezone.now()
    Job.objects.filter(id=row.id).update(
        started_at=now - timedelta(seconds=10),
        progress_done=40,
        progress_total=100,
        progress_updated_at=now,
    )
    JobRun.objects.create(
        job_id=row.id, attempt=1, started_at=now, duration_ms=5, outcome="error", error="Tb: x"
    )
    page = admin_client.get(f"{CHANGELIST}{row.id}/change/").content.decode()
    assert "Tb: x" in page and "payments team" in page
    assert "40 of 100, 4.0/s" in page
    assert "card-marker-93b1" not in page  # the payload is not shown


def test_replay_needs_its_permission_and_writes_an_audit_row():
    row = dead()
    viewer = staff("view_job")
    post_action(viewer, "replay_selected", [row.id], confirm="yes")
    assert Job.objects.get(id=row.id).state == JobState.DEAD
    operator = staff("view_job", "replay_job")
    r = post_action(operator, "replay_selected", [row.id])
    assert r.status_code == 200 and b"Confirm replay" in r.content  # the confirmation first
    post_action(operator, "replay_selected", [row.id], confirm="yes")
    assert Job.objects.get(id=row.id).state == JobState.PENDING
    assert AuditEntry.objects.get(action="job.replay").count == 1
    # Replay does not give cancel.
    post_action(operator, "cancel_selected", [row.id], confirm="yes")
    assert Job.objects.get(id=row.id).state == JobState.PENDING


def test_replaying_a_type_not_replay_safe_needs_the_extra_confirmation():
    row = dead("test.charge_card")
    operator = staff("view_job", "replay_job")
    page = post_action(operator, "replay_selected", [row.id])
    assert b"unsafe_confirmed" in page.content and b"payments team" in page.content
    post_action(operator, "replay_selected", [row.id], confirm="yes")
    assert Job.objects.get(id=row.id).state == JobState.DEAD
    post_action(operator, "replay_selected", [row.id], confirm="yes", unsafe_confirmed="yes")
    assert Job.objects.get(id=row.id).state == JobState.PENDING


def test_cancel_needs_its_permission_and_ends_pending_jobs():
    row = enqueue("test.noop")
    post_action(staff("view_job", "replay_job"), "cancel_selected", [row.id], confirm="yes")
    assert Job.objects.get(id=row.id).state == JobState.PENDING
    post_action(staff("view_job", "cancel_job"), "cancel_selected", [row.id], confirm="yes")
    assert Job.objects.get(id=row.id).state == JobState.DEAD
    assert AuditEntry.objects.get(action="job.cancel").count == 1


def test_the_dead_jobs_page_groups_by_type_and_reason(admin_client):
    for _ in range(3):
        dead("test.noop", "deadline passed")
    dead("test.charge_card", "invoice 42 does not exist")
    page = admin_client.get(f"{CHANGELIST}dead/")
    rows = page.context["rows"]
    assert [(r["type"], r["dead_reason"], r["count"]) for r in rows] == [
        ("test.noop", "deadline passed", 3),
        ("test.charge_card", "invoice 42 does not exist", 1),
    ]
    assert rows[1]["owner"] == "payments team" and rows[1]["replay_safe"] is False
    assert f"{CHANGELIST}?state=dead&amp;type=test.noop".encode() in page.content


@pytest.mark.parametrize(
    ("field", "value"),
    [("cron", "every morning"), ("cron", "0 9 * * * *"), ("time_zone", "Europe/Nowhere"),
     ("payload", "[1, 2]"), ("payload", "{not json")],
)  # fmt: skip
def test_a_bad_recurring_job_is_a_form_error_never_a_500(admin_client, field, value):
    form = {
        "name": "nightly",
        "job_type": "test.noop",
        "cron": "0 3 * * *",
        "time_zone": "UTC",
        "payload": "{}",
        "tenant_id": "",
        "enabled": "on",
        field: value,
    }
    r = admin_client.post("/admin/trusty_jobs/recurringjob/add/", form)
    assert r.status_code == 200
    assert field in r.context["adminform"].form.errors
    assert not RecurringJob.objects.exists()


def test_a_recurring_job_saved_in_the_admin_is_scheduled_and_audited(admin_client):
    form = {
        "name": "nightly",
        "job_type": "test.noop",
        "cron": "0 3 * * *",
        "time_zone": "Europe/Berlin",
        "payload": '{"label": "x"}',
        "tenant_id": "",
        "enabled": "on",
    }
    r = admin_client.post("/admin/trusty_jobs/recurringjob/add/", form)
    assert r.status_code == 302, r.content
    row = RecurringJob.objects.get()
    assert row.next_tick_at > timezone.now()
    assert row.next_tick_at.astimezone(ZoneInfo("Europe/Berlin")).hour == 3
    assert AuditEntry.objects.get(action="recurring_job.save").details["name"] == "nightly"
