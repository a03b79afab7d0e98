"""Admission: the scheduler's step that moves due pending deliveries on to ``enqueued``,
a page at a time, within the in-flight ceilings (global, per tenant, per endpoint) and
the endpoints' start-rate buckets.

Admission chooses which rows go; it changes no delivery's state itself. The rows it
chooses move ``pending → enqueued`` through ``deliveries.state.enqueue``, the state
machine's guarded transition (one statement, ``admit.ENQUEUE``, that re-checks the
state and writes each delivery's outbox row), so ``deliveries.state`` stays the one
module that changes a delivery's state. What admission writes of its own is the rate
buckets (``EndpointThrottle``).
"""

import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction

from deliveries.core.conf import settings

from . import state
from .jobs import wakeup
from .models import EndpointThrottle
from .statements import admit


@dataclass(frozen=True)
class Limits:
    max_in_flight: int
    tenant_max_in_flight: int
    endpoint_max_concurrency: int

    @classmethod
    def from_settings(cls) -> "Limits":
        return cls(
            max_in_flight=settings.DELIVERY_MAX_IN_FLIGHT,
            tenant_max_in_flight=settings.DELIVERY_TENANT_MAX_IN_FLIGHT,
            endpoint_max_concurrency=settings.DELIVERY_ENDPOINT_MAX_CONCURRENCY,
        )


@dataclass
class AdmissionResult:
    admitted: int = 0
    # Due rows left pending this page because a ceiling was reached.
    held_back: int = 0
    # The global in-flight ceiling is reached: nothing was scanned.
    saturated: bool = False
    # Rows in flight (enqueued or leased) in all when the pass began.
    in_flight: int = 0
    # The pass took the last slot under the global ceiling (saturated included): the
    # next pass can admit only what the workers free meanwhile.
    filled: bool = False


def admit_due(*, now: datetime, page_size: int, limits: Limits) -> AdmissionResult:
    """Move one page of due pending deliveries to ``enqueued`` and write their outbox
    rows, in one transaction.

    Ceilings, all counted over rows in flight (enqueued or leased): the global
    ``max_in_flight``; per tenant, so one noisy tenant cannot fill the queue and starve
    the others; per endpoint (its ``max_concurrency``), which bounds concurrent requests
    to it; and the endpoint's start-rate bucket. Saturated tenants and endpoints are left
    out of the scan itself, so their backlog cannot hide other tenants' due rows: the
    per-tenant ceiling is what guarantees a share to every tenant. Among the rows one
    scan reads (twice the free slots, up to ADMISSION_CHUNK), tenants are served
    round-robin. Paused endpoints are left out of every scan the same way: their rows
    stay pending, held until the endpoint is resumed.
    """
    result = AdmissionResult()
    with transaction.atomic():
        admit.TAKE_ADMISSION_LOCK([admit.ADMISSION_LOCK_ID])
        # Keys are text throughout (ids as PostgreSQL prints them): thousands of rows
        # pass through here per second, and building UUID objects for them would cost
        # more than the choosing.
        by_tenant: Counter = Counter()
        by_endpoint: Counter = Counter()
        for tenant_id, endpoint_id, n in admit.IN_FLIGHT():
            by_tenant[tenant_id] += n
            by_endpoint[endpoint_id] += n
        result.in_flight = sum(by_tenant.values())
        room = limits.max_in_flight - result.in_flight
        free = min(page_size, room)
        if free <= 0:
            result.saturated = result.filled = True
            return result
        full_tenants = {t for t, n in by_tenant.items() if n >= limits.tenant_max_in_flight}
        slots = _Slots(limits, by_tenant, by_endpoint, _endpoint_limits(by_endpoint))
        full_endpoints = {
            e for e, n in by_endpoint.items() if n >= slots.ceiling(slots.endpoints.get(e))
        }
        # Paused endpoints are left out as full ones are: their rows are never read.
        full_endpoints |= {e for (e,) in admit.PAUSED_ENDPOINTS()}
        # Chunks of due rows, each scanned past the free slots so that tenants share
        # it round-robin. A row held back fills its tenant or endpoint (ceiling reached,
        # or no start token left): those leave the next chunk's scan, so rows they
        # cannot take are read once per pass, not once per chunk. Rows admitted leave it
        # too (they are no longer pending).
        while free > 0:
            chunk = min(2 * free, ADMISSION_CHUNK)
            rows = _scan_due(now, list(full_tenants), list(full_endpoints), chunk)
            slots.load_endpoints({r[2] for r in rows}, now)
            chosen = slots.choose(rows, free)
            result.held_back += len(rows) - len(chosen)
            if chosen:
                result.admitted += state.enqueue(chosen, now=now)
                free -= len(chosen)
            if len(rows) < chunk:
                break
            full_tenants |= {r[1] for r in rows if slots.tenant_full(r[1])}
            full_endpoints |= {r[2] for r in rows if slots.endpoint_full(r[2])}
        result.filled = free <= 0 and room <= page_size
        _save_buckets(slots.buckets)
        if result.admitted:
            # Once a pass, not once a chunk: PostgreSQL folds them anyway, and each was a
            # round trip (8 a pass of 2,000 rows, 3 ms of it).
            wakeup.notify(wakeup.OUTBOX)
    return result


def anything_due(now: datetime) -> bool:
    """Whether a due pending delivery waits that admission could take, ceilings aside:
    the held deliveries of paused endpoints do not count (an idle scheduler is one with
    nothing else to do, however long a pause lasts). By the scan admission uses, so a
    paused endpoint's backlog is not read past."""
    paused = [e for (e,) in admit.PAUSED_ENDPOINTS()]
    return bool(_scan_due(now, [], paused, 1))


# Rows one admission scan reads at most (it reads twice the free slots, up to this).
ADMISSION_CHUNK = 256


class _Slots:
    """The ceilings of one admission pass, counting what it admits."""

    def __init__(
        self, limits: Limits, by_tenant: Counter, by_endpoint: Counter, endpoints: dict
    ) -> None:
        self.limits = limits
        self.by_tenant = by_tenant
        self.by_endpoint = by_endpoint
        # _endpoint_limits rows, starting with the endpoints in flight (read once a pass,
        # for the full endpoints and for admission alike).
        self.endpoints: dict[str, dict] = dict(endpoints)
        self.buckets: dict[str, _Bucket] = {}
        self._bucketed: set[str] = set()

    def load_endpoints(self, ids: set[str], now: datetime) -> None:
        """The limits and start-rate buckets of the endpoints of scanned rows, each read
        once a pass."""
        missing = ids - self.endpoints.keys()
        if missing:
            self.endpoints.update(_endpoint_limits(missing))
        unbucketed = ids - self._bucketed
        if not unbucketed:
            return
        self._bucketed |= unbucketed
        rows = [self.endpoints[e] for e in unbucketed if e in self.endpoints]
        self.buckets.update({str(k): b for k, b in _rate_buckets(rows, now).items()})

    def tenant_full(self, tenant_id: str) -> bool:
        return self.by_tenant[tenant_id] >= self.limits.tenant_max_in_flight

    def ceiling(self, endpoint: dict | None) -> int:
        """An endpoint's concurrency ceiling (its _endpoint_limits row): its own, else the
        default (also for an endpoint deleted since its rows were read)."""
        return (endpoint or {}).get("max_concurrency") or self.limits.endpoint_max_concurrency

    def endpoint_full(self, endpoint_id: str) -> bool:
        ceiling = self.ceiling(self.endpoints[endpoint_id])
        bucket = self.buckets.get(endpoint_id)
        return self.by_endpoint[endpoint_id] >= ceiling or (
            bucket is not None and bucket.tokens < 1
        )

    def choose(self, rows: list[tuple], free: int) -> list[str]:
        """Up to ``free`` of ``rows``: tenants served round-robin, each tenant's rows in
        priority and age order; the chosen ones count against the ceilings."""
        chosen: list[str] = []
        queues: dict = defaultdict(deque)
        for row in rows:
            queues[row[1]].append(row)
        while queues and len(chosen) < free:
            for tenant_id in list(queues):
                delivery_id, _, endpoint_id, _ = queues[tenant_id].popleft()
                if not queues[tenant_id]:
                    del queues[tenant_id]
                if self.tenant_full(tenant_id) or self.endpoint_full(endpoint_id):
                    continue
                self.by_tenant[tenant_id] += 1
                self.by_endpoint[endpoint_id] += 1
                bucket = self.buckets.get(endpoint_id)
                if bucket is not None:
                    bucket.tokens -= 1
                    bucket.spent = True
                chosen.append(delivery_id)
                if len(chosen) >= free:
                    break
        return chosen


def _endpoint_limits(ids: Iterable[str]) -> dict[str, dict]:
    """{id as text: {"id", "max_concurrency", "rate_limit"}} of these endpoints."""
    return {
        str(i): {"id": i, "max_concurrency": c, "rate_limit": r}
        for i, c, r in admit.ENDPOINT_LIMITS([list(ids)])
    }


# With more endpoints than SCAN_BY_ENDPOINT_MAX waiting, SCAN_DUE reads past the rows left
# out: its cost follows those rows, where the scan by endpoint (DUE_ENDPOINTS, then
# SCAN_DUE_OF_ENDPOINTS) follows the endpoints with pending rows (about 4 µs each). Each
# way is the cheaper one in its case; none is in both.

# The window (SCAN_DUE_WINDOW) is this many times the rows asked for.
SCAN_WINDOW = 4
# The scan by endpoint is used while at most this many endpoints have pending rows.
SCAN_BY_ENDPOINT_MAX = 500


def _scan_due(now, tenants: list[str], endpoints: list[str], limit: int) -> list[tuple]:
    """Up to ``limit`` due rows (id, tenant, endpoint, priority), highest priority and
    oldest first, of tenants and endpoints not in ``tenants`` and ``endpoints``."""
    params = {"now": now, "tenants": tenants, "endpoints": endpoints, "limit": limit}
    if not tenants and not endpoints:
        return admit.SCAN_DUE(params)
    window = SCAN_WINDOW * limit
    found = admit.SCAN_DUE_WINDOW({**params, "window": window})
    rows = [r[:4] for r in found if r[0] is not None]
    if len(rows) == limit or found[0][4] < window:
        return rows  # enough, or the window held every due row
    waiting = [r[0] for r in admit.DUE_ENDPOINTS({"most": SCAN_BY_ENDPOINT_MAX})]
    if len(waiting) > SCAN_BY_ENDPOINT_MAX:
        return admit.SCAN_DUE(params)
    left_out = set(endpoints)
    candidates = [e for e in waiting if e not in left_out]
    if not candidates:
        return []
    return admit.SCAN_DUE_OF_ENDPOINTS({**params, "candidates": candidates})


@dataclass
class _Bucket:
    endpoint_id: uuid.UUID
    tokens: float
    refilled_at: datetime
    # Whether this pass took a token: an untouched bucket needs no write, because its
    # stored row refills to the same tokens at any later time (both cap at the rate).
    spent: bool = False


def _rate_buckets(endpoints: Iterable[dict], now: datetime) -> dict[uuid.UUID, _Bucket]:
    """Refilled token buckets for the endpoints that have a start-rate ceiling. The
    bucket holds at most one second of tokens, so a burst is at most ``rate`` starts."""
    limited = {e["id"]: e["rate_limit"] for e in endpoints if e["rate_limit"]}
    if not limited:
        return {}
    stored = {
        endpoint_id: (tokens, refilled_at)
        for endpoint_id, tokens, refilled_at in EndpointThrottle.objects.select_for_update()
        .filter(endpoint_id__in=limited)
        .values_list("endpoint_id", "tokens", "refilled_at")
    }
    buckets = {}
    for endpoint_id, rate in limited.items():
        if endpoint_id not in stored:
            tokens = rate
        else:
            left, refilled_at = stored[endpoint_id]
            elapsed = max(0.0, (now - refilled_at).total_seconds())
            tokens = min(rate, left + elapsed * rate)
        buckets[endpoint_id] = _Bucket(endpoint_id, max(tokens, 0.0), now)
    return buckets


def _save_buckets(buckets: dict[uuid.UUID, _Bucket]) -> None:
    """The buckets this pass spent from, in one upsert (one statement per endpoint cost
    the scheduler more than the admission itself with hundreds of limited endpoints)."""
    spent = [b for b in buckets.values() if b.spent]
    if spent:
        EndpointThrottle.objects.bulk_create(
            [
                EndpointThrottle(
                    endpoint_id=b.endpoint_id, tokens=b.tokens, refilled_at=b.refilled_at
                )
                for b in spent
            ],
            update_conflicts=True,
            unique_fields=["endpoint"],
            update_fields=["tokens", "refilled_at"],
        )
