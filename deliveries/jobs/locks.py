"""Entity locks: one row per locked business entity, with an expiry so a holder that
died cannot keep the entity locked. Inbound handlers take one per entity so that two
events about the same entity are applied one at a time."""

from collections.abc import Iterable
from datetime import datetime, timedelta

from django.utils import timezone

from .models import EntityLock
from .statements import ACQUIRE_LOCKS
from .statements import RELEASE_SQL as RELEASE_SQL  # run inside a caller's statement


def entity_lock_acquire(*, key: str, owner: str, ttl: float, now: datetime | None = None) -> bool:
    """Take the lock on ``key`` for ``ttl`` seconds, or take it over if it expired.
    Returns whether ``owner`` now holds it. Renewing a lock one holds also works."""
    return key in entity_locks_acquire(keys=[key], owner=owner, ttl=ttl, now=now)


def entity_locks_acquire(
    *, keys: Iterable[str], owner: str, ttl: float, now: datetime | None = None
) -> set[str]:
    """``entity_lock_acquire`` for several keys at once; returns the keys ``owner`` now
    holds (the others are held by someone else)."""
    now = now or timezone.now()
    expires = now + timedelta(seconds=ttl)
    keys = sorted(set(keys))
    return {
        row[0]
        for row in ACQUIRE_LOCKS({"keys": keys, "owner": owner, "expires": expires, "now": now})
    }


def entity_lock_release(*, key: str, owner: str) -> bool:
    """Release ``key`` if ``owner`` still holds it."""
    return bool(EntityLock.objects.filter(key=key, owner=owner).delete()[0])
