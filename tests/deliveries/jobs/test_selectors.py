"""A job's progress (deliveries.jobs.selectors.job_progress): the rate and ETA as a
backfill run's."""

from datetime import timedelta

import pytest
from django.utils import timezone

from deliveries.jobs.models import Job, JobState
from deliveries.jobs.selectors import job_progress

pytestmark = pytest.mark.sqlite


def job(state=JobState.RUNNING, done=None, total=None, seconds=10.0) -> Job:
    started = timezone.now() - timedelta(seconds=60)
    return Job(
        state=state,
        started_at=started,
        progress_done=done,
        progress_total=total,
        progress_updated_at=started + timedelta(seconds=seconds) if done is not None else None,
    )


def test_a_running_job_a_quarter_done_has_three_times_its_time_left():
    p = job_progress(job(done=25, total=100, seconds=10))
    assert (p.done, p.total) == (25, 100)
    assert p.rate == pytest.approx(2.5)
    assert p.eta_seconds == pytest.approx(30.0)


def test_no_eta_without_a_total_or_once_finished():
    assert job_progress(job(done=25, seconds=10)).eta_seconds is None
    finished = job_progress(job(state=JobState.DONE, done=100, total=100, seconds=20))
    assert finished.eta_seconds is None and finished.rate == pytest.approx(5.0)


def test_a_job_that_reported_nothing_has_no_figures():
    p = job_progress(job())
    assert (p.done, p.total, p.rate, p.eta_seconds) == (None, None, None, None)
