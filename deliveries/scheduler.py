"""The scheduler: admits due deliveries under the ceilings and runs the recovery sweeps
(expired leases, lost dispatches, and every registered job kind's own scheduling). One
``scheduler_tick`` is its unit of work; ``SchedulerPasses`` paces the sweeps for the
loop (deliveries.jobs.loop.run_loop).
"""

import time
from collections import Counter
from dataclasses import dataclass

from django.utils import timezone

from deliveries.core.conf import settings
from deliveries.core.prometheus import LEASE_EXPIRIES, LOST_DISPATCHES

from . import state
from .admission import AdmissionResult, Limits, admit_due, anything_due
from .core.retry import RetryPolicy
from .jobs import kinds
from .jobs.loop import SOON_WAIT, Tick
from .models import Delivery

# While the global in-flight ceiling is full, the scheduler comes back when about this
# share of it can have been freed (at the rate the workers freed slots since its last
# pass), waiting at least SOON_WAIT and at most REFILL_MAX_WAIT (refill_pause).
REFILL_SHARE = 0.1
REFILL_MAX_WAIT = 0.2


@dataclass
class SchedulerTick(Tick):
    # The sweeps left work: sweep again on the next pass.
    sweep_busy: bool = False
    # The admission pass, if it ran.
    admission: AdmissionResult | None = None


def scheduler_tick(*, page_size: int | None = None, sweep: bool = True) -> SchedulerTick:
    """One pass of the recovery clock: admit one page of due deliveries and, when
    ``sweep``, expire leases, recover lost dispatches and run the other job kinds'
    scheduling (their admission, expiries and recoveries)."""
    now = timezone.now()
    page_size = page_size or settings.SCHEDULER_PAGE_SIZE
    tick = SchedulerTick()
    others_busy = False
    if sweep:
        policy = RetryPolicy.from_settings()
        tick.counts["lease_expired"] = state.expire_leases(now=now, limit=page_size, policy=policy)
        tick.counts["transport_lost"] = state.recover_lost_dispatches(
            now=now, older_than=settings.SCHEDULER_STALE_ENQUEUED_SECONDS, limit=page_size
        )
    admitted = admit_due(now=now, page_size=page_size, limits=Limits.from_settings())
    tick.admission = admitted
    tick.counts["enqueued"] = admitted.admitted
    tick.counts["held_back"] = admitted.held_back
    expiries_left = tick.counts["lease_expired"] >= page_size  # a full page: more may wait
    tick.busy = admitted.admitted >= page_size or expiries_left
    if sweep:
        for kind in kinds.scheduled():
            counts, more = kind.schedule(now, page_size)
            tick.counts.update({f"{kind.name}.{k}": v for k, v in counts.items()})
            others_busy |= more
        tick.sweep_busy = others_busy or expiries_left
    if sweep and not tick.busy and admitted.admitted == 0 and not others_busy:
        tick.idle = not Delivery.objects.filter(state__in=state.IN_FLIGHT).exists() and (
            not anything_due(now)
        )
    tick.busy |= others_busy
    _count_recoveries(tick.counts)
    tick.soon = admitted.admitted > 0
    # Work waits for a slot: look again at a steady pace, not in a tight loop (each pass
    # counts the rows in flight).
    tick.blocked = bool(admitted.held_back or admitted.saturated)
    return tick


class SchedulerPasses:
    """The scheduler loop's unit: admission on every pass, the sweeps (lease expiry,
    lost dispatches, the other job kinds) at most every ``sweep_every`` seconds, or on
    the next pass while the last sweep left work.

    Admission runs whenever workers free slots (a FREED notification ends the wait), so
    under load a pass comes every few tens of milliseconds; the sweeps look for work
    that only a lease or a backoff running out creates, so repeating them that often
    only cost their queries (about half of the scheduler's CPU under load).

    While the global in-flight ceiling is full, a pass can admit only the slots freed
    since the last one, and every recording frees some: a pass after each would admit a
    few hundred rows at a time, each pass counting the thousands in flight and each
    admission making a relay page. So a pass that fills the ceiling asks the loop to
    pause (``refill_pause``) until about a tenth of it can be free again.
    """

    def __init__(self, *, page_size: int | None = None, sweep_every: float | None = None):
        self.page_size = page_size
        self.sweep_every = settings.SCHEDULER_INTERVAL if sweep_every is None else sweep_every
        self.next_sweep = 0.0
        # When the last pass began, and the rows in flight when it ended.
        self.last: tuple[float, int] | None = None

    def __call__(self) -> SchedulerTick:
        started = time.monotonic()
        sweep = started >= self.next_sweep
        tick = scheduler_tick(page_size=self.page_size, sweep=sweep)
        if sweep and not tick.sweep_busy:
            self.next_sweep = started + self.sweep_every
        admission = tick.admission
        if admission is not None:
            last, self.last = self.last, (started, admission.in_flight + admission.admitted)
            if admission.filled and last is not None:
                freed = last[1] - admission.in_flight
                tick.pause = refill_pause(freed, started - last[0], settings.DELIVERY_MAX_IN_FLIGHT)
        return tick


def refill_pause(freed: int, seconds: float, max_in_flight: int) -> float:
    """How long the scheduler waits after a pass that filled the global ceiling: the
    time the workers take to free REFILL_SHARE of it, at the rate they freed ``freed``
    slots in the ``seconds`` since the pass before, between SOON_WAIT and REFILL_MAX_WAIT.
    Nothing freed (or a clock that did not move): the longest wait. A small ceiling on
    fast workers waits SOON_WAIT, as every other pass that admitted work does."""
    if freed <= 0 or seconds <= 0:
        return REFILL_MAX_WAIT
    wait = REFILL_SHARE * max_in_flight * seconds / freed
    return min(max(wait, SOON_WAIT), REFILL_MAX_WAIT)


def _count_recoveries(counts: Counter) -> None:
    for key, n in counts.items():
        if not n:
            continue
        job, _, what = key.rpartition(".")
        if what == "lease_expired":
            LEASE_EXPIRIES.labels(job or "delivery").inc(n)
        elif what == "transport_lost":
            LOST_DISPATCHES.labels(job or "delivery").inc(n)
