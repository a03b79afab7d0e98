"""Crash-boundary fault injection.

``FAULT_INJECT_AT=<point>`` makes the process die at that point with ``os._exit`` (no
cleanup, no rollback handlers, no acknowledgements: what ``kill -9`` does), the first
time it gets there or, with ``FAULT_INJECT_AFTER=n``, the n-th time (the soak uses that
to let a process work a while before it dies at a named point). The crash tests and the
soak run the real commands with it set. The named points:

- ``relay.before_publish``: outbox rows committed and taken, nothing on the broker yet.
- ``relay.after_publish``: the broker accepted the messages, publication not recorded.
  (With the database broker both points are inside the relay's one transaction, which
  the death rolls back; with Redis the page is claimed and, at the second, published.)
- ``worker.before_take_commit``: with the database broker, a worker's take has claimed
  outbox rows and leased their deliveries, not committed (the death rolls both back).
- ``worker.after_lease``: the lease is committed, no request sent (death during a lease).
- ``worker.after_send``: the receiver answered, the outcome is not recorded.
- ``smtp.after_commit``: the SMTP listener stored a message, its 250 not yet answered.
"""

import os

from deliveries.core.conf import settings

POINTS = frozenset(
    {
        "relay.before_publish",
        "relay.after_publish",
        "worker.before_take_commit",
        "worker.after_lease",
        "worker.after_send",
        "smtp.after_commit",
    }
)
CRASH_EXIT_CODE = 137

_reached = 0


def crash_point(name: str) -> None:
    global _reached
    assert name in POINTS, name
    if name == settings.FAULT_INJECT_AT:
        _reached += 1
        if _reached >= settings.FAULT_INJECT_AFTER:
            os._exit(CRASH_EXIT_CODE)
