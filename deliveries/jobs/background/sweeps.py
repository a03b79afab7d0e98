"""The ``job`` kind's schedule, run by ``run_scheduler``: expired leases, deadlines and
the recurring jobs' ticks."""

from collections import Counter
from datetime import datetime

from .. import wakeup
from .recurring import recurring_schedule
from .state import expire_deadlines, expire_leases


def jobs_schedule(now: datetime, page_size: int) -> tuple[Counter, bool]:
    """Return expired leases to pending (dead when their attempts are spent), end
    pending jobs past their deadline dead with the reason "deadline passed", and enqueue
    the recurring jobs' due ticks (``recurring``). Returns the counts and whether a full
    page suggests more."""
    counts = Counter()
    counts["lease_expired"], counts["lease_expired_dead"] = expire_leases(now, page_size)
    counts["deadline_passed"] = expire_deadlines(now, page_size)
    counts["recurring_enqueued"], recurring_more = recurring_schedule(now, page_size)
    more = counts["lease_expired"] + counts["lease_expired_dead"] >= page_size
    more = more or counts["deadline_passed"] >= page_size or recurring_more
    if counts["lease_expired"]:
        wakeup.notify(wakeup.JOBS)
    return counts, more
