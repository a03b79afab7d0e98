"""What an operator does to background jobs: replay dead ones, cancel pending ones, and
save a recurring job. Each change is a guarded UPDATE (``background.state``) and writes
an audit row in the same transaction (``deliveries.core.audit``: without a registered
writer these services refuse rather than change anything unaudited)."""

from collections.abc import Callable, Iterable

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from deliveries.core.audit import audit

from . import wakeup
from .background.registry import JOB_TYPES
from .background.state import cancel_jobs, replay_jobs
from .cron import next_tick
from .models import RecurringJob

# (tenant id, name) pairs for the admin's tenant filter, from the app that owns tenants.
_tenant_choices: list[Callable[[], list[tuple[str, str]]]] = []


def register_tenant_choices(choices: Callable[[], list[tuple[str, str]]]) -> None:
    _tenant_choices[:] = [choices]


def tenant_choices() -> list[tuple[str, str]]:
    return _tenant_choices[0]() if _tenant_choices else []


def _audited(transition, action: str, job_ids: Iterable, actor, via: str) -> int:
    ids = list(job_ids)
    with transaction.atomic():
        count = transition(ids, timezone.now())
        audit(
            actor=actor,
            action=action,
            target="job",
            count=count,
            via=via,
            ids=[str(i) for i in ids[:100]],
        )
    return count


def job_replay(*, job_ids: Iterable, actor=None, via: str = "admin") -> int:
    """Run dead (or cancelled) jobs again, same id, attempts from 0; audited. Returns how
    many went back to pending (jobs no longer dead are left alone)."""
    count = _audited(replay_jobs, "job.replay", job_ids, actor, via)
    if count:
        wakeup.notify(wakeup.JOBS)
    return count


def job_cancel(*, job_ids: Iterable, actor=None, via: str = "admin") -> int:
    """Cancel pending jobs (dead, reason ``cancelled by an operator``); audited."""
    return _audited(cancel_jobs, "job.cancel", job_ids, actor, via)


SCHEDULE_FIELDS = ("cron", "time_zone", "enabled")


def job_type_problem(job_type: str) -> str | None:
    """Why ``job_type`` cannot be scheduled by this process, or None."""
    if job_type not in JOB_TYPES:
        return f"No job type {job_type!r} is registered (JOBS_MODULES)."
    return None


def recurring_job_save(*, recurring_job: RecurringJob, actor=None, changed=None) -> RecurringJob:
    """Validate and save a recurring job; audited. A new schedule (a new row, or its cron,
    zone or enabled changed: ``changed`` names the fields) starts at its next tick after
    now: ticks missed while it was off are not run."""
    problem = job_type_problem(recurring_job.job_type)
    if problem:
        raise ValidationError({"job_type": problem})
    recurring_job.full_clean()
    new_schedule = recurring_job._state.adding or set(changed or ()) & set(SCHEDULE_FIELDS)
    if new_schedule or recurring_job.next_tick_at is None:
        recurring_job.next_tick_at = (
            next_tick(recurring_job.cron, recurring_job.time_zone, after=timezone.now())
            if recurring_job.enabled
            else None
        )
    with transaction.atomic():
        recurring_job.save()
        audit(
            actor=actor,
            action="recurring_job.save",
            target="recurring_job",
            count=1,
            name=recurring_job.name,
            cron=recurring_job.cron,
            time_zone=recurring_job.time_zone,
            enabled=recurring_job.enabled,
        )
    return recurring_job


def recurring_jobs_delete(*, recurring_job_ids: Iterable[int], actor=None) -> int:
    """Delete recurring jobs (the jobs they enqueued stay); audited."""
    ids = list(recurring_job_ids)
    with transaction.atomic():
        names = list(RecurringJob.objects.filter(id__in=ids).values_list("name", flat=True))
        RecurringJob.objects.filter(id__in=ids).delete()
        audit(
            actor=actor,
            action="recurring_job.delete",
            target="recurring_job",
            count=len(names),
            names=names[:100],
        )
    return len(names)
