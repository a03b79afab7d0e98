"""The retry policy every kind of work retries by: pure, no database, no clock.

``RetryPolicy`` says how long to wait after a failed attempt and when the attempts are
spent; ``parse_retry_after`` reads a receiver's ``Retry-After``. What counts as a failure
worth retrying is each kind's own rule (outbound deliveries: ``deliveries.policy``).
"""

import math
import random
import re
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime

from .conf import settings

# RFC 9110 delay-seconds is 1*DIGIT, ASCII only: str.isdigit() also accepts "²" (which
# float() then refuses) and other scripts' digits, none of which a receiver means.
_DELAY_SECONDS = re.compile(r"[0-9]+")


def parse_retry_after(value: str | None, *, now: datetime) -> float | None:
    """Seconds from ``now`` that a ``Retry-After`` header asks for, or None if absent or
    unreadable. Negative and past dates read as 0. Whatever a receiver sends, this never
    raises; the caller clamps what it returns."""
    if not value:
        return None
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):
        return float(value)  # inf for a thousand digits, which the policy clamps
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, (when - now).total_seconds())


# The shortest positive retry step, in seconds.
MIN_STEP = 0.001


@dataclass(frozen=True)
class RetryPolicy:
    """When to try again after a retryable failure.

    ``schedule[i]`` is the base wait after the (i+1)-th failed attempt; its length is the
    number of retries, so a delivery gets ``len(schedule) + 1`` attempts before it is
    dead. Each wait is spread by ``±jitter`` (a fraction) so that endpoints that failed
    together do not retry together. A ``Retry-After`` longer than the step wins, clamped
    to ``retry_after_max``; it never shortens the schedule.
    """

    schedule: tuple[float, ...]
    jitter: float = 0.2
    retry_after_max: float = 6 * 3600

    def __post_init__(self) -> None:
        # Written so that NaN fails too (every comparison with NaN is False); an infinite
        # step or clamp would overflow the datetime arithmetic that schedules the retry.
        # A positive step under MIN_STEP cannot put a retry later than the attempt before
        # it: retries are scheduled to the microsecond, and a subnormal step jittered
        # rounds to nothing.
        if not all(step == 0 or MIN_STEP <= step < math.inf for step in self.schedule):
            raise ValueError(f"retry schedule steps must be 0 or at least {MIN_STEP} s, and finite")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        if not 0 <= self.retry_after_max < math.inf:
            raise ValueError("retry_after_max must be finite and not negative")

    @classmethod
    def from_settings(cls) -> "RetryPolicy":
        return cls(
            schedule=tuple(float(s) for s in settings.DELIVERY_RETRY_SCHEDULE),
            jitter=settings.DELIVERY_RETRY_JITTER,
            retry_after_max=settings.DELIVERY_RETRY_AFTER_MAX,
        )

    @property
    def max_attempts(self) -> int:
        return len(self.schedule) + 1

    def next_delay(
        self,
        failed_attempts: int,
        *,
        retry_after: float | None = None,
        rng: random.Random | None = None,
    ) -> float | None:
        """Seconds to wait after ``failed_attempts`` failures (counting the one just
        made), or None when the schedule is spent and the delivery is dead."""
        if failed_attempts < 1:
            raise ValueError("failed_attempts counts the attempt just made, so it is >= 1")
        if failed_attempts > len(self.schedule):
            return None
        base = self.schedule[failed_attempts - 1]
        spread = base * self.jitter
        delay = base + (rng or random).uniform(-spread, spread)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.retry_after_max))
        return delay
