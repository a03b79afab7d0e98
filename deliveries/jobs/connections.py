"""The processes' PostgreSQL connections: a pooler in front of the server, the direct
connection the loops LISTEN on, and how many connections each kind of process opens.

Behind a pooler in transaction mode (PgBouncer's ``pool_mode = transaction``) each
transaction may run on a different server connection, so nothing may outlive one:

* prepared statements: psycopg prepares a statement on its server connection after
  ``prepare_threshold`` runs. PgBouncer before 1.21 does not follow them (the next
  transaction's server says the statement does not exist), so ``prepare_threshold`` must
  be ``None``; 1.21 and later do with ``max_prepared_statements`` set.
* server-side cursors: ``QuerySet.iterator()`` declares a named cursor on PostgreSQL and
  fetches from it across statements: ``DISABLE_SERVER_SIDE_CURSORS`` must be ``True``.
* LISTEN: a listener is a session. Through the pooler it would register some server
  connection that then serves other clients, and the notifications go nowhere. The loops
  LISTEN on ``DATABASE_LISTEN_URL`` (a direct connection, past the pooler) or, without
  it, poll at their intervals (``available`` is then False).

What the product itself runs keeps to transactions: its advisory locks are the
transaction-scoped ``pg_advisory_xact_lock`` forms, its ``statement_timeout`` budgets are
``SET LOCAL`` inside a transaction, it makes no temporary tables, and NOTIFY inside a
transaction is delivered on commit through the pooler like any statement. Django's
``SET TIME ZONE`` on a new connection is a parameter PgBouncer tracks per client.
"""

from collections.abc import Mapping

from django.db import DatabaseError, connections

from deliveries.core.conf import TRANSACTION_POOLERS, app_setting, settings


def transaction_pooled() -> bool:
    """Whether the settings say a pooler in transaction mode stands before PostgreSQL."""
    return settings.DATABASE_POOLER in TRANSACTION_POOLERS


def listen_conninfo() -> str | None:
    """Where the loops LISTEN: a libpq URL of a direct connection (``DATABASE_LISTEN_URL``),
    ``""`` for a new connection with Django's own parameters, or ``None`` when there is
    no session to listen on (behind transaction pooling without a direct URL: poll)."""
    if settings.DATABASE_LISTEN_URL:
        return settings.DATABASE_LISTEN_URL
    return None if transaction_pooled() else ""


def pooling_problems(alias: str, settings_dict: Mapping) -> list[tuple[str, str]]:
    """(check id, message) for what the database ``alias``'s settings would break behind
    the pooler that ``DATABASE_POOLER`` names; none when it names none."""
    if not transaction_pooled() or settings_dict.get("ENGINE") != "django.db.backends.postgresql":
        return []
    problems = []
    # Absent, psycopg's own default applies: 5.
    threshold = settings_dict.get("OPTIONS", {}).get("prepare_threshold", 5)
    if settings.DATABASE_POOLER == "transaction" and threshold is not None:
        problems.append(
            (
                "deliveries.E011",
                f"DATABASES[{alias!r}] prepares statements (OPTIONS['prepare_threshold'] is "
                f"{threshold!r}) behind a pooler in transaction mode without prepared "
                "statements (DATABASE_POOLER='transaction'): a statement prepared in one "
                "transaction is missing in the next.",
            )
        )
    if not settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
        problems.append(
            (
                "deliveries.E012",
                f"DATABASES[{alias!r}] has DISABLE_SERVER_SIDE_CURSORS off behind a pooler "
                "in transaction mode: QuerySet.iterator() fetches from a named cursor that "
                "another server connection does not have.",
            )
        )
    return problems


def listen_url_problem() -> str | None:
    """What is wrong with ``DATABASE_LISTEN_URL`` as a libpq connection string, if anything."""
    if not settings.DATABASE_LISTEN_URL:
        return None
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    try:
        conninfo_to_dict(settings.DATABASE_LISTEN_URL)
    except ProgrammingError:
        # Not the URL itself: it may hold a password.
        return "DATABASE_LISTEN_URL is not a libpq connection URL (postgresql://user@host/db)."
    return None


SERVER_PROCESS = "SELECT pg_backend_pid()"


def pooled_per_transaction(alias: str) -> bool:
    """Whether the database ``alias`` is reached through a pooler in transaction (or
    statement) mode, as far as one probe can tell: a query on this connection, and then,
    while it stays open, one on a second, new connection are answered by the same server
    process. Without a pooler, or with one in session mode, two open connections are
    always two server processes; PgBouncer in transaction mode hands the second client
    the server connection the first one gave back after its query. A pooler that picks
    another idle server connection goes unnoticed (False)."""
    db = connections[alias]
    if db.vendor != "postgresql" or db.in_atomic_block:
        return False  # inside a transaction this connection keeps its server
    with db.cursor() as cursor:
        cursor.execute(SERVER_PROCESS)
        (first,) = cursor.fetchone()
    other = db.get_new_connection(db.get_connection_params())
    with other:
        other.autocommit = True
        return other.execute(SERVER_PROCESS).fetchone()[0] == first


def listen_url_pooled() -> bool:
    """The same probe on ``DATABASE_LISTEN_URL``: True when it reaches a pooler in
    transaction mode, where a LISTEN would be lost. ``psycopg.OperationalError`` when it
    cannot be reached."""
    import psycopg

    url = settings.DATABASE_LISTEN_URL
    with (
        psycopg.connect(url, autocommit=True) as first,
        psycopg.connect(url, autocommit=True) as other,
    ):
        return first.execute(SERVER_PROCESS).fetchone() == other.execute(SERVER_PROCESS).fetchone()


# --- The connection budget -------------------------------------------------------------

# DEPLOY_PROCESSES's keys: what a host runs. The counts of processes, and what sizes them.
PROCESS_KEYS = (
    "web",
    "web_threads",
    "scheduler",
    "relay",
    "workers",
    "worker_lanes",
    "jobs",
    "jobs_concurrency",
    "smtp",
    "other",
)


def deploy_processes() -> tuple[dict[str, int], list[str]]:
    """``DEPLOY_PROCESSES`` read as whole numbers (an environment dict holds strings):
    the counts, and what is wrong with it."""
    counts, problems = {}, []
    for key, value in settings.DEPLOY_PROCESSES.items():
        if key not in PROCESS_KEYS:
            problems.append(
                f"DEPLOY_PROCESSES: {key!r} is no process kind ({', '.join(PROCESS_KEYS)})."
            )
            continue
        try:
            number = int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError:
            number = -1
        if isinstance(value, bool) or number < 0:
            problems.append(f"DEPLOY_PROCESSES[{key!r}] takes a whole number of at least 0.")
            continue
        counts[key] = number
    if settings.DEPLOY_HOSTS < 1:
        problems.append("DEPLOY_HOSTS must be at least 1.")
    return counts, problems


def listeners_per_host(counts: Mapping[str, int]) -> int:
    """The LISTEN connections a host's loops hold (one per scheduler, relay, workers and
    jobs process), direct to PostgreSQL when ``DATABASE_LISTEN_URL`` is set."""
    if listen_conninfo() is None:
        return 0
    return sum(counts.get(kind, 0) for kind in ("scheduler", "relay", "workers", "jobs"))


def pooled_per_host(counts: Mapping[str, int]) -> int:
    """The connections a host's processes open through Django (to the pooler when there
    is one), at most, not counting the listeners. Each long-running command also keeps a
    heartbeat thread with a connection of its own (deliveries.jobs.loop.Heartbeat)."""
    lanes = counts.get("worker_lanes", settings.WORKER_LANES)  # run_workers' --lanes
    jobs_concurrency = counts.get("jobs_concurrency", settings.JOBS_CONCURRENCY)
    per_process = {
        # A thread opens one on its first request and keeps it CONN_MAX_AGE.
        "web": counts.get("web_threads", 1),
        # The loop and its heartbeat.
        "scheduler": 2,
        "relay": 2,
        # The main thread, its heartbeat, and the lanes' executor (lanes + 1 threads).
        "workers": lanes + 3,
        # The owner, its heartbeat, one per job thread, and the async jobs' thread.
        "jobs": jobs_concurrency + 3,
        # The listener's store threads (ingest's SMTP_STORE_THREADS), its main thread and
        # its heartbeat.
        "smtp": app_setting("SMTP_STORE_THREADS", 0) + 2 if counts.get("smtp") else 0,
        "other": 1,
    }
    return sum(counts.get(kind, 0) * n for kind, n in per_process.items())


def server_connections_available(alias: str) -> int | None:
    """The connections an ordinary role may open on the server of ``alias``
    (``max_connections`` less the reserved ones); None when the server cannot be asked."""
    if connections[alias].vendor != "postgresql":
        return None
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('max_connections')::int"
                " - current_setting('superuser_reserved_connections')::int"
                " - coalesce(current_setting('reserved_connections', true), '0')::int"
            )
            (available,) = cursor.fetchone()
    except DatabaseError:
        return None
    return available
