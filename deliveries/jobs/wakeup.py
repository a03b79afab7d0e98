"""Wake-ups between the stages on PostgreSQL (LISTEN/NOTIFY).

Each stage tells the next one that work is waiting, in the same transaction that wrote
the work, so the notification arrives when the work is visible:

* ``webhooks_outbox``: the scheduler wrote outbox rows; wakes the relay.
* ``webhooks_queue``: the database broker enqueued messages; wakes the workers.
* ``webhooks_freed``: the workers recorded attempts, freeing slots under the ceilings;
  wakes the scheduler.
* ``webhooks_due``: ``publish_event``, a replay or a released lease made deliveries due
  now; wakes the scheduler, so that new work does not wait for its next look (up to
  ``SCHEDULER_INTERVAL``). Work that falls due later (a backoff, ``deliver_at``) is
  found by that look.
* ``webhooks_jobs``: a host's background job was enqueued (``background.enqueue``) or
  given back; wakes ``run_jobs``.

A notification only shortens a wait: every loop still looks for work at its own interval,
so a lost or coalesced notification (PostgreSQL folds identical ones within a transaction,
and a listener that is reconnecting misses some) costs latency, never work. Only the idle
and the blocked waits end early; a loop that is busy, or paces itself while work flows,
reads what came after each pass instead (``Listener.drain``), so notifications never
pile up unread. On SQLite
and on other brokers there are no notifications and the loops poll.

A listener is a session: behind a pooler in transaction mode it listens on the direct
connection ``DATABASE_LISTEN_URL`` names, and without one there is nothing to listen on
and the loops poll (``deliveries.jobs.connections``). NOTIFY, sent inside a transaction,
goes through the pooler like any statement.
"""

import contextlib
import logging
import threading

import psycopg
from django.db import connection

from .connections import listen_conninfo

logger = logging.getLogger("deliveries")

OUTBOX = "webhooks_outbox"
QUEUE = "webhooks_queue"
FREED = "webhooks_freed"
DUE = "webhooks_due"
JOBS = "webhooks_jobs"


def available() -> bool:
    """Whether a loop can be woken: on PostgreSQL, with a session to LISTEN on."""
    return connection.vendor == "postgresql" and listen_conninfo() is not None


def notify(channel: str) -> None:
    """Signal ``channel`` when the current transaction commits (at once in autocommit)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"NOTIFY {channel}")


class Listener:
    """Waits for notifications on its own autocommit connection (a listening connection
    must not sit inside a transaction): to ``DATABASE_LISTEN_URL`` when it is set, else
    with Django's parameters. Without a session to listen on (``available``) it only
    sleeps."""

    def __init__(self, *channels: str) -> None:
        self.channels = channels
        self._conn = None

    def _connection(self):
        if self._conn is None or self._conn.closed:
            conninfo = listen_conninfo()
            if conninfo:
                conn = psycopg.connect(conninfo, autocommit=True)
            else:
                conn = connection.get_new_connection(connection.get_connection_params())
                conn.autocommit = True
            for channel in self.channels:
                conn.execute(f"LISTEN {channel}")
            self._conn = conn
        return self._conn

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """Return True when notified within ``timeout`` seconds, False when the time ran
        out (or ``stop`` was set: without notifications the wait is on ``stop``)."""
        if not available() or timeout <= 0:
            stop.wait(max(timeout, 0))
            return False
        try:
            conn = self._connection()
            got = any(True for _ in conn.notifies(timeout=timeout, stop_after=1))
        except Exception as exc:
            self._lost(exc)
            stop.wait(timeout)
            return False
        if got:  # take whatever else is already here: one wake-up for a burst
            self.drain()
        return got

    def drain(self) -> int:
        """Take the notifications already here without waiting for more; how many. A
        loop that stays busy, or paces itself without listening, calls this after each
        pass: unread notifications (one per publish, on ``webhooks_due``) would fill the
        connection's socket, stall the server process that sends them, and keep
        PostgreSQL from truncating its notification queue."""
        if self._conn is None or self._conn.closed:
            return 0  # not listening yet: nothing was sent to us
        try:
            return sum(1 for _ in self._conn.notifies(timeout=0))
        except Exception as exc:
            self._lost(exc)
            return 0

    def _lost(self, exc: Exception) -> None:
        """A listener problem must never stop the loop: log it, drop the connection (the
        next wait opens another) and let the loop poll meanwhile."""
        logger.warning(
            "listen connection failed; polling",
            extra={"action": "wakeup.listen_failed", "error": str(exc)},
        )
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
