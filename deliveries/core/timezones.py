"""Time zones: the service runs on UTC (the database, the scheduler's clock, every
stored time); a tenant's own time zone only turns "09:00 where the tenant is" into a UTC
instant, for scheduled publishing (``publish_event(..., deliver_at=...)``).

Across daylight-saving changes a wall-clock time maps to a different UTC instant (09:00
in Europe/Berlin is 08:00 UTC in winter, 07:00 UTC in summer), which is why the
conversion happens per occurrence, never as a fixed UTC offset.
"""

import functools
import zoneinfo
from datetime import UTC, datetime, time, timedelta

from django.core.exceptions import ValidationError
from django.utils import timezone


@functools.cache
def _known_zones() -> frozenset[str]:
    # Listing the zones walks the tz database once; the set does not change at run time.
    return frozenset(zoneinfo.available_timezones())


def validate_time_zone(value: str) -> None:
    """An IANA time zone name (``Europe/Berlin``, ``UTC``), as the tz database spells it."""
    if value not in _known_zones():
        raise ValidationError(
            "%(value)s is not an IANA time zone name (e.g. Europe/Berlin, UTC).",
            code="invalid_time_zone",
            params={"value": value},
        )


def next_local_time(time_zone: str, at: time, *, after: datetime | None = None) -> datetime:
    """The first instant strictly after ``after`` (default: now) at which the wall clock
    in ``time_zone`` shows ``at``, as an aware UTC datetime.

    On the day clocks go forward, a time inside the skipped hour (02:30 in Berlin on the
    last Sunday of March) maps to the instant an hour later on the wall clock (03:30):
    the occurrence is moved, never dropped. On the day clocks go back, a time that
    occurs twice maps to its first occurrence, so the occurrence happens once.
    """
    validate_time_zone(time_zone)
    zone = zoneinfo.ZoneInfo(time_zone)
    after = after or timezone.now()
    if timezone.is_naive(after):
        raise ValueError("after must be an aware datetime")
    day = after.astimezone(zone).date()
    # Today's occurrence may already have passed; tomorrow's cannot have.
    for offset in range(3):
        local = datetime.combine(day + timedelta(days=offset), at.replace(tzinfo=None))
        candidate = local.replace(tzinfo=zone, fold=0).astimezone(UTC)
        if candidate > after:
            return candidate
    raise AssertionError("unreachable: a wall-clock time occurs at least once in two days")
