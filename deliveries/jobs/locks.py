"""Entity locks: one row per locked business entity, with an expiry so a holder that
died cannot keep the entity locked. Inbound handlers take one per entity so that two
events about the same entity are applied one at a time."""

from collections.abc import Iterable
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from .models import EntityLock
from .sql import bound_cursor

# Take free keys, take over expired locks, or renew our own: one statement (and, in
# autocommit, one commit) for any number of keys. A row held by another owner and not
# expired is left alone, and its key does not come back. Keys are taken in sorted order,
# so two takers of overlapping sets cannot deadlock.
_ACQUIRE_SQL = """
INSERT INTO deliveries_entitylock (key, owner, expires_at)
SELECT key, %(owner)s, %(expires)s FROM unnest(%(keys)b::text[]) AS key ORDER BY key
ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
WHERE deliveries_entitylock.expires_at < %(now)s
    OR deliveries_entitylock.owner = EXCLUDED.owner
RETURNING key
"""


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
    if connection.vendor == "postgresql":
        with bound_cursor() as cursor:
            cursor.execute(
                _ACQUIRE_SQL, {"keys": keys, "owner": owner, "expires": expires, "now": now}
            )
            return {row[0] for row in cursor.fetchall()}
    return {key for key in keys if _acquire_portable(key, owner, expires, now)}


def _acquire_portable(key: str, owner: str, expires: datetime, now: datetime) -> bool:
    # Take over an expired lock, or renew our own: one guarded UPDATE.
    taken = EntityLock.objects.filter(key=key, expires_at__lt=now).update(
        owner=owner, expires_at=expires
    ) or EntityLock.objects.filter(key=key, owner=owner).update(expires_at=expires)
    if taken:
        return True
    try:
        with transaction.atomic():
            EntityLock.objects.create(key=key, owner=owner, expires_at=expires)
    except IntegrityError:
        return False  # somebody else holds it (the primary key is the uniqueness)
    return True


# Release the keys ``%(lock_keys)s`` that ``%(owner)s`` holds, as one part of a statement
# of the caller's (a CTE of the statement that records the work done under the locks).
RELEASE_SQL = """
DELETE FROM deliveries_entitylock WHERE key = ANY(%(lock_keys)b::text[]) AND owner = %(owner)s
"""


def entity_lock_release(*, key: str, owner: str) -> bool:
    """Release ``key`` if ``owner`` still holds it."""
    return bool(EntityLock.objects.filter(key=key, owner=owner).delete()[0])
