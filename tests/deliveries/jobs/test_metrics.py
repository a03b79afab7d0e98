"""The background jobs' metrics (deliveries.jobs.metrics), scraped through the real
/metrics view: runs by type and outcome, their durations, the queues' depth and oldest
due age, and dead jobs by type."""

from datetime import timedelta

import pytest
from django.utils import timezone

from deliveries.jobs.background import enqueue
from deliveries.jobs.background.worker import JobWorker
from deliveries.jobs.models import Job, JobState
from tests.conftest import scrape, value
from tests.deliveries.jobs import sample_jobs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


@pytest.fixture(autouse=True)
def _setup(settings, db):
    settings.METRICS_ALLOW_IPS = ["127.0.0.1"]
    sample_jobs.ensure_marks()


def test_runs_are_counted_by_type_and_outcome_with_their_durations():
    before = scrape()
    for _ in range(2):
        enqueue("test.noop")
    enqueue("test.fail", {"label": "f"})
    JobWorker(queues=["default"], concurrency=4, grace=5).run(until_idle=True)
    after = scrape()

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("webhooks_job_runs_total", type="test.noop", outcome="done") == 2
    assert delta("webhooks_job_runs_total", type="test.fail", outcome="failed") == 1
    assert delta("webhooks_job_run_duration_seconds_count", type="test.noop") == 2
    assert value(after, "webhooks_job_run_duration_seconds_sum", type="test.fail") > 0
    assert value(after, "webhooks_jobs_dead", type="test.fail") == 1


def test_depth_and_oldest_due_age_per_queue_and_dead_by_type():
    now = timezone.now()
    for minutes in (10, 2):
        enqueue("test.noop", run_at=now - timedelta(minutes=minutes))
    enqueue("test.noop", run_at=now + timedelta(hours=1))
    enqueue("test.noop", queue="bulk", run_at=now + timedelta(hours=1))
    gone = enqueue("test.mark", {"label": "x"})
    Job.objects.filter(id=gone.id).update(state=JobState.DEAD, type="removed.type")
    samples = scrape()
    assert value(samples, "webhooks_job_queue_depth", queue="default", due="yes") == 2
    assert value(samples, "webhooks_job_queue_depth", queue="default", due="no") == 1
    assert value(samples, "webhooks_job_queue_depth", queue="bulk", due="no") == 1
    age = value(samples, "webhooks_job_oldest_due_age_seconds", queue="default")
    assert 600 <= age < 660
    assert value(samples, "webhooks_job_oldest_due_age_seconds", queue="bulk") == 0
    # A type no @job registers here is "unknown": the label set stays bounded.
    assert value(samples, "webhooks_jobs_dead", type="unknown") == 1
    assert value(samples, "webhooks_metrics_provider_up", provider="jobs") == 1
