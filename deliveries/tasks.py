"""One pass of each loop as a plain function, for django-q2 ``Schedule`` rows (editable
in the admin: func ``deliveries.tasks.scheduler_pass``, every N minutes; cron strings
need the optional croniter package) or any other task runner. ``run_scheduler --once``
and ``run_relay --once`` call the same units."""

from .loops import relay_tick, scheduler_tick


def scheduler_pass() -> dict:
    return dict(scheduler_tick().counts)


def relay_pass() -> dict:
    return dict(relay_tick().counts)
