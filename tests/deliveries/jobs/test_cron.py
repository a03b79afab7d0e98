"""Cron expressions in a time zone (deliveries.jobs.cron): the wall clock there, not a
fixed UTC offset, across both daylight-saving changes."""

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ValidationError

from deliveries.jobs.cron import latest_tick, next_tick, validate_cron

pytestmark = pytest.mark.sqlite
BERLIN = ZoneInfo("Europe/Berlin")


def daily_ticks(start: datetime, days: int) -> list[datetime]:
    ticks, at = [], start
    for _ in range(days):
        at = next_tick("0 9 * * *", "Europe/Berlin", after=at)
        ticks.append(at)
    return ticks


@pytest.mark.parametrize(
    ("start", "utc_hours"),
    [
        # Clocks go forward on Sunday 29 March 2026: 08:00 UTC before, 07:00 UTC after.
        (datetime(2026, 3, 26, 12, tzinfo=UTC), [8, 8, 7, 7, 7]),
        # Clocks go back on Sunday 25 October 2026: 07:00 UTC before, 08:00 UTC after.
        (datetime(2026, 10, 22, 12, tzinfo=UTC), [7, 7, 8, 8, 8]),
    ],
)
def test_every_day_at_nine_in_berlin_stays_at_nine_there_across_dst(start, utc_hours):
    ticks = daily_ticks(start, 5)
    assert [t.astimezone(BERLIN).hour for t in ticks] == [9] * 5
    assert [t.astimezone(BERLIN).minute for t in ticks] == [0] * 5
    assert [t.hour for t in ticks] == utc_hours
    assert all(t.tzinfo is UTC for t in ticks)
    days = [t.astimezone(BERLIN).date() for t in ticks]
    assert days == [days[0] + timedelta(days=i) for i in range(5)]


def test_the_latest_tick_is_the_one_at_or_before_the_instant():
    nine = datetime(2026, 3, 30, 7, tzinfo=UTC)  # 09:00 in Berlin, summer time
    assert latest_tick("0 9 * * *", "Europe/Berlin", at=nine) == nine
    assert latest_tick("0 9 * * *", "Europe/Berlin", at=nine + timedelta(microseconds=1)) == nine
    earlier = latest_tick("0 9 * * *", "Europe/Berlin", at=nine - timedelta(microseconds=1))
    assert earlier == datetime(2026, 3, 29, 7, tzinfo=UTC)
    assert next_tick("0 9 * * *", "Europe/Berlin", after=nine) == nine + timedelta(days=1)


@pytest.mark.parametrize(
    "bad", ["", "bad", "61 * * * *", "* * * *", "0 9 * * * *", "0 9 * * \x00", "0 25 * * *"]
)
def test_a_bad_cron_expression_is_refused(bad):
    with pytest.raises(ValidationError) as refused:
        validate_cron(bad)
    assert refused.value.code == "invalid_cron"


def test_a_good_cron_expression_passes():
    for good in ("0 9 * * *", "*/5 * * * *", "30 2 * * 1-5", "0 0 1 * *"):
        validate_cron(good)
