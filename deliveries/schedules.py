"""Units of work as plain functions, for django-q2 ``Schedule`` rows (editable in the
admin: func ``deliveries.schedules.scheduler_pass``, every N minutes; cron strings need the
optional croniter package) or any other task runner. ``run_scheduler --once``,
``run_relay --once``, ``prune`` and ``check_alerts`` call the same units.

``install_schedules`` (``manage.py install_schedules``) creates the maintenance rows:
``prune_pass`` hourly and ``alerts_pass`` every minute."""

from .alerts import alerts_check
from .core.retention import prune
from .jobs.relay import relay_tick
from .scheduler import scheduler_tick


def scheduler_pass() -> dict:
    return dict(scheduler_tick().counts)


def relay_pass() -> dict:
    return dict(relay_tick().counts)


def prune_pass() -> dict:

    return dict(prune())


def alerts_pass() -> dict:

    return dict(alerts_check())


MAINTENANCE_SCHEDULES = {
    # name: (func, minutes between runs)
    "webhooks: prune": ("deliveries.schedules.prune_pass", 60),
    "webhooks: alerts": ("deliveries.schedules.alerts_pass", 1),
}


def install_schedules() -> list[str]:
    """Create (or correct) the django-q2 Schedule rows of the maintenance tasks; returns
    the names created or changed. Idempotent: run it on every deploy."""
    from django_q.models import Schedule

    changed = []
    for name, (func, minutes) in MAINTENANCE_SCHEDULES.items():
        _, created = Schedule.objects.get_or_create(
            name=name,
            defaults={"func": func, "schedule_type": Schedule.MINUTES, "minutes": minutes},
        )
        updated = (
            Schedule.objects.filter(name=name)
            .exclude(func=func, minutes=minutes)
            .update(func=func, schedule_type=Schedule.MINUTES, minutes=minutes)
        )
        if created or updated:
            changed.append(name)
    return changed


def schedule_funcs_move(apps, *, old: str, new: str) -> int:
    """A migration step: the ``Schedule`` rows whose func lies in module ``old`` (a
    dotted path) name the same function in ``new``, admin-made rows included; returns how
    many. A row stores its function's dotted path, so a module that moves takes its rows
    along this way, and back on a rollback."""
    Schedule = apps.get_model("django_q", "Schedule")
    moved = 0
    for pk, func in Schedule.objects.filter(func__startswith=f"{old}.").values_list("id", "func"):
        moved += Schedule.objects.filter(id=pk).update(func=f"{new}{func[len(old) :]}")
    return moved
