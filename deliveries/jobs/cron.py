"""Cron expressions in a time zone, by croniter (which django-q2 uses for its own cron
schedules): the rule a ``RecurringJob``'s schedule is validated and evaluated by. Ticks
are computed on the zone's wall clock and returned in UTC, so a daily 09:00 stays 09:00
there across daylight-saving changes."""

import zoneinfo
from datetime import UTC, datetime, timedelta

from croniter import croniter
from django.core.exceptions import ValidationError


def validate_cron(value: str) -> None:
    """Five cron fields (minute hour day-of-month month day-of-week), as croniter reads
    them; a sixth (seconds) field is refused: the sweep's clock is not that fine."""
    try:
        valid = len(str(value).split()) == 5 and croniter.is_valid(value)
    except Exception:  # croniter raises on some input instead of answering False
        valid = False
    if not valid:
        raise ValidationError(
            "%(value)s is not a cron expression of five fields (e.g. 0 9 * * *).",
            code="invalid_cron",
            params={"value": value},
        )


def _zone(time_zone: str) -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(time_zone)


def next_tick(cron: str, time_zone: str, *, after: datetime) -> datetime:
    """The first tick strictly after ``after``, in UTC."""
    local = after.astimezone(_zone(time_zone))
    return croniter(cron, local).get_next(datetime).astimezone(UTC)


def latest_tick(cron: str, time_zone: str, *, at: datetime) -> datetime:
    """The latest tick at or before ``at``, in UTC. (croniter's get_prev is strict, and
    ticks fall on whole minutes: the latest before the next whole second is it.)"""
    start = at.replace(microsecond=0) + timedelta(seconds=1)
    local = start.astimezone(_zone(time_zone))
    return croniter(cron, local).get_prev(datetime).astimezone(UTC)
