"""Fixed-window rate counters in the shared cache: the API's per-key throttle and the
receive view's per-source limit count here, so a limit holds across every web process
and host (docs/security.md, "Throttles across processes").

A window is ``window`` seconds of the clock (``int(now // window)``); each hit adds one
to its key's counter and a hit past the limit is refused. Across a window's edge a
client can get up to twice the limit in ``window`` seconds, never more.

Each increment is atomic, whichever cache holds it: Redis (``CACHE_URL=rediscache://…``)
and memcached increment in the server. Django's database cache reads and writes back
(two processes reading 5 would both write 6), so there the read and the write run under a
lock on the key: a transaction-scoped advisory lock on PostgreSQL, and on SQLite the
write lock its IMMEDIATE transactions take at BEGIN.
"""

import time

from django.core.cache import caches
from django.core.cache.backends.db import DatabaseCache
from django.db import router, transaction

from .sql import Statement

# The lock on one counter of Django's database cache, run with
# ``using`` the cache's database: in the two-key space, under a name of its own (the
# admission lock takes a one-key lock); two counters whose hashes collide only wait for
# each other a moment. And no waiting for the commit's flush to disk (most of the cost
# otherwise): a counter may lose its last increments in a server crash. Params: [counter].
TAKE_RATE_COUNTER_LOCK = Statement(
    "SELECT pg_advisory_xact_lock(hashtext('rate-counter'), hashtext(%s)),"
    " set_config('synchronous_commit', 'off', true)",
    returns="nothing",
    bound=False,
)


@TAKE_RATE_COUNTER_LOCK.elsewhere
def _(params, using=None):
    pass  # SQLite: the IMMEDIATE transaction already holds the write lock


def hit(key: str, *, window: float, alias: str = "default") -> tuple[int, float]:
    """Count one hit of ``key`` in the current window of ``window`` seconds; returns
    (hits in this window including this one, seconds until the window ends)."""
    now = time.time()
    index = int(now // window)
    counter = f"rate:{key}:{int(window * 1000)}:{index}"
    # Kept past its window's end for a little: the clocks of two hosts differ a little.
    timeout = window + 5
    cache = caches[alias]
    if isinstance(cache, DatabaseCache):
        count = _database_incr(cache, counter, timeout)
    else:
        count = _incr(cache, counter, timeout)
    return count, (index + 1) * window - now


def _incr(cache, counter: str, timeout: float) -> int:
    cache.add(counter, 0, timeout)
    try:
        return cache.incr(counter)
    except ValueError:  # expired between add and incr
        cache.add(counter, 0, timeout)
        return cache.incr(counter)


def _database_incr(cache: DatabaseCache, counter: str, timeout: float) -> int:
    alias = router.db_for_write(cache.cache_model_class)
    with transaction.atomic(using=alias):
        TAKE_RATE_COUNTER_LOCK([counter], using=alias)
        count = cache.get(counter, 0) + 1
        cache.set(counter, count, timeout)
    return count
