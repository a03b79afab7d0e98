"""GET /api/v1/jobs/<id>/ (deliveries.api.views.JobViewSet): a job's state and progress
for the tenant that enqueued it; any other caller gets the 404 a random id gets."""

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from deliveries import services
from deliveries.jobs.background import enqueue
from deliveries.jobs.models import Job, JobState
from tests.deliveries.jobs import sample_jobs  # noqa: F401  (registers the test types)

pytestmark = pytest.mark.django_db


def client_for(name: str):
    tenant, key = services.tenant_create(name=name)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client, tenant


def test_a_running_jobs_progress_rate_and_eta():
    client, tenant = client_for("alice")
    job = enqueue("test.slow", {"label": "export"}, tenant=tenant)
    started = timezone.now() - timedelta(seconds=30)
    Job.objects.filter(id=job.id).update(
        state=JobState.RUNNING,
        attempts=1,
        lease_token=uuid.uuid4(),
        lease_until=timezone.now() + timedelta(minutes=1),
        started_at=started,
        progress_done=200,
        progress_total=1000,
        progress_updated_at=started + timedelta(seconds=20),
    )
    r = client.get(f"/api/v1/jobs/{job.id}/")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["id"] == str(job.id) and body["type"] == "test.slow"
    assert (body["state"], body["attempts"], body["dead_reason"]) == ("running", 1, "")
    assert body["progress"] == {"done": 200, "total": 1000, "rate": 10.0, "eta_seconds": 80.0}
    assert {"created_at", "run_at", "started_at", "finished_at"} <= set(body)
    assert "payload" not in body


def test_a_dead_job_shows_its_reason_and_no_eta():
    client, tenant = client_for("alice")
    job = enqueue("test.fail", tenant=tenant)
    Job.objects.filter(id=job.id).update(state=JobState.DEAD, dead_reason="invoice gone")
    body = client.get(f"/api/v1/jobs/{job.id}/").json()
    assert (body["state"], body["dead_reason"]) == ("dead", "invoice gone")
    assert body["progress"]["eta_seconds"] is None


def test_another_tenants_job_and_a_job_without_a_tenant_are_404_like_a_random_id():
    alice, tenant = client_for("alice")
    bob, _ = client_for("bob")
    theirs = enqueue("test.noop", tenant=tenant)
    nobodys = enqueue("test.noop")
    answers = [
        bob.get(f"/api/v1/jobs/{theirs.id}/"),
        alice.get(f"/api/v1/jobs/{nobodys.id}/"),
        alice.get(f"/api/v1/jobs/{uuid.uuid4()}/"),
        alice.get("/api/v1/jobs/not-a-uuid/"),
    ]
    assert [r.status_code for r in answers] == [404] * 4
    assert all(r.json()["error"]["code"] == "not_found" for r in answers)
    assert APIClient().get(f"/api/v1/jobs/{theirs.id}/").status_code == 401
    assert alice.get("/api/v1/jobs/").status_code == 404  # no list: one job by id
