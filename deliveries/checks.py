"""System checks: a misconfigured setting fails loudly with a stable id."""

import ipaddress

from django.core.checks import Error, Info, Tags, Warning, register
from django.db import DatabaseError, connections

from deliveries.core.conf import POOLERS, on_readable_settings, setting_problems, settings

from .core.encryption import FROM_SECRET_KEY, encrypts_under_derived_key, key_problem
from .core.retry import RetryPolicy
from .jobs import connections as pooling
from .jobs.brokers import QUEUES_SHARED, broker_class, shares_tasks_queue
from .portal.theme import color_problems


@register()
def check_setting_types(app_configs, **kwargs):
    """Every setting of the installed apps reads as its type (deliveries/core/conf.py), and
    ``TRUSTY_WEBHOOKS`` names only theirs: one error per setting."""
    return [
        Error(
            message,
            hint='The forms each setting takes: docs/install.md, "Settings as Python values".',
            id=check_id,
        )
        for check_id, message in setting_problems()
    ]


@register()
@on_readable_settings
def check_delivery_settings(app_configs, **kwargs):

    errors = []
    try:
        RetryPolicy.from_settings()  # the policy's own rules: one place for them
    except (TypeError, ValueError) as exc:
        errors.append(
            Error(
                f"DELIVERY_RETRY_SCHEDULE, DELIVERY_RETRY_JITTER or "
                f"DELIVERY_RETRY_AFTER_MAX: {exc}.",
                id="deliveries.E001",
            )
        )
    for cidr in settings.EGRESS_ALLOW_NETWORKS:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            errors.append(
                Error(f"EGRESS_ALLOW_NETWORKS: {cidr!r} is not a network.", id="deliveries.E002")
            )
    if settings.DELIVERY_LEASE_SECONDS <= settings.DELIVERY_MAX_TIMEOUT:
        errors.append(
            Error(
                "DELIVERY_LEASE_SECONDS must exceed DELIVERY_MAX_TIMEOUT, or a slow request "
                "would lose its lease mid-flight.",
                id="deliveries.E003",
            )
        )
    if settings.QUEUE_VISIBILITY_TIMEOUT <= settings.DELIVERY_MAX_TIMEOUT:
        errors.append(
            Error(
                "QUEUE_VISIBILITY_TIMEOUT must exceed DELIVERY_MAX_TIMEOUT, or the broker "
                "would hand a message out again while it is being sent.",
                id="deliveries.E004",
            )
        )
    if settings.SCHEDULER_STALE_ENQUEUED_SECONDS <= settings.QUEUE_VISIBILITY_TIMEOUT:
        errors.append(
            Error(
                "SCHEDULER_STALE_ENQUEUED_SECONDS must exceed QUEUE_VISIBILITY_TIMEOUT: the "
                "broker owns redelivery, the scheduler only recovers lost messages.",
                id="deliveries.E005",
            )
        )
    if settings.WORKER_SHUTDOWN_GRACE < 0:
        errors.append(Error("WORKER_SHUTDOWN_GRACE must not be negative.", id="deliveries.E020"))
    for name in ("WORKER_LANES", "WORKER_BATCH_SIZE", "WORKER_CONCURRENCY"):
        if getattr(settings, name) < 1:
            errors.append(Error(f"{name} must be at least 1.", id="deliveries.E021"))

    if shares_tasks_queue():
        errors.append(Error(QUEUES_SHARED, id="deliveries.E007"))
    if settings.LOOP_HEARTBEAT_SECONDS <= 0:
        errors.append(Error("LOOP_HEARTBEAT_SECONDS must be positive.", id="deliveries.E008"))
    try:
        broker_class()
    except ImportError:
        errors.append(
            Error(
                f"QUEUE_BROKER_CLASS {settings.QUEUE_BROKER_CLASS!r} cannot be imported.",
                hint="The database broker is 'deliveries.jobs.brokers.database.DatabaseBroker'.",
                id="deliveries.E006",
            )
        )
    return errors


@register()
@on_readable_settings
def check_portal_settings(app_configs, **kwargs):
    """The portal's look and links: colours that are CSS colours (a setting must not
    inject CSS), a link life the maximum allows, and the session middleware it needs."""

    errors = [Error(p, id="deliveries.E060") for p in color_problems(settings.PORTAL_COLORS)]
    if not 1 <= settings.PORTAL_LINK_TTL <= settings.PORTAL_LINK_MAX_TTL:
        errors.append(
            Error(
                "PORTAL_LINK_TTL must be at least 1 and at most PORTAL_LINK_MAX_TTL.",
                id="deliveries.E061",
            )
        )
    if "django.contrib.sessions.middleware.SessionMiddleware" not in settings.MIDDLEWARE:
        errors.append(
            Warning(
                "The portal keeps its session in Django's sessions: without "
                "django.contrib.sessions.middleware.SessionMiddleware in MIDDLEWARE its "
                "links cannot open it.",
                id="deliveries.W060",
            )
        )
    return errors


@register(Tags.security)
@on_readable_settings
def check_encryption_keys(app_configs, **kwargs):
    """Every SECRETS_ENCRYPTION_KEYS entry must be a Fernet key: a bad one would fail
    the first secret read or written, not the start."""

    errors = []
    for position, key in enumerate(settings.SECRETS_ENCRYPTION_KEYS, start=1):
        problem = None if key == FROM_SECRET_KEY else key_problem(key)
        if problem:
            errors.append(
                Error(
                    f"SECRETS_ENCRYPTION_KEYS: key {position} is not a Fernet key ({problem}).",
                    hint="Make one with: python -c 'from cryptography.fernet import Fernet; "
                    "print(Fernet.generate_key().decode())'",
                    id="deliveries.E030",
                )
            )
    return errors


@register(Tags.security, deploy=True)
@on_readable_settings
def check_encryption_keys_set(app_configs, **kwargs):
    """Without SECRETS_ENCRYPTION_KEYS the stored secrets are encrypted under a key
    derived from SECRET_KEY: they are then only as safe as SECRET_KEY, and rotating
    SECRET_KEY would make every one of them unreadable."""

    if not encrypts_under_derived_key():
        return []
    return [
        Warning(
            "SECRETS_ENCRYPTION_KEYS has no key of its own first: stored secrets are "
            "encrypted under a key derived from SECRET_KEY, and changing SECRET_KEY would "
            "make them unreadable.",
            hint='Set SECRETS_ENCRYPTION_KEYS (docs/operations.md, "Encryption keys").',
            id="deliveries.W030",
        )
    ]


# Caches that each process (or each host) keeps to itself: a rate counted there is per
# process. Django's Redis, memcached and database caches are shared.
UNSHARED_CACHES = frozenset(
    {
        "django.core.cache.backends.locmem.LocMemCache",
        "django.core.cache.backends.dummy.DummyCache",
        "django.core.cache.backends.filebased.FileBasedCache",
    }
)


@register(Tags.caches)
def check_shared_cache(app_configs, **kwargs):
    """The throttles count in the default cache (deliveries/core/ratelimit.py)."""
    backend = settings.CACHES.get("default", {}).get("BACKEND", "")
    if backend not in UNSHARED_CACHES:
        return []
    return [
        Warning(
            f"The default cache ({backend.rsplit('.', 1)[-1]}) is not shared between "
            "processes and hosts: each gunicorn process would allow the whole API and "
            "inbound rate limits.",
            hint="Set CACHES['default'] to a cache every process shares: the database cache "
            "on the table the apps' migrations create (LOCATION 'webhooks_cache') or Redis "
            "(docs/install.md; the standalone service reads CACHE_URL).",
            id="deliveries.W002",
        )
    ]


@register()
def check_q_cluster(app_configs, **kwargs):
    """The apps install django-q2 (its Schedule rows run the maintenance): without a
    ``Q_CLUSTER``, django-q2 warns at every start of every command."""
    if getattr(settings, "Q_CLUSTER", None):
        return []
    return [
        Warning(
            "Q_CLUSTER is not set: django-q2 prints 'Retry and timeout are misconfigured' "
            "at every start, and a qcluster would run on django-q2's defaults (its Redis "
            "broker on localhost).",
            hint="Q_CLUSTER = q_cluster(), with: from deliveries.core.conf import q_cluster "
            "(docs/install.md).",
            id="deliveries.W004",
        )
    ]


@register(Tags.security, deploy=True)
@on_readable_settings
def check_metrics_access(app_configs, **kwargs):
    """``check --deploy``: /metrics with neither a token nor an address refuses everyone,
    Prometheus included (safe, but surely not meant)."""
    if settings.METRICS_TOKEN or settings.METRICS_ALLOW_IPS:
        return []
    return [
        Warning(
            "Neither METRICS_TOKEN nor METRICS_ALLOW_IPS is set: /metrics refuses every scrape.",
            hint="Set METRICS_TOKEN and give it to Prometheus (docs/observability.md).",
            id="deliveries.W003",
        )
    ]


@register(Tags.database)
def check_database_server(app_configs, databases=None, **kwargs):
    """``manage.py check --database default`` (and ``migrate``): the server settings the
    queue tables depend on."""
    warnings = []
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('autovacuum')::bool")
            (autovacuum,) = cursor.fetchone()
        warnings += autovacuum_warnings(alias, autovacuum=autovacuum)
    return warnings


def autovacuum_warnings(alias: str, *, autovacuum: bool) -> list[Warning]:
    """With autovacuum off, the tables that churn a row per message, per dispatch and per
    state change bloat without bound (docs/deployment.md, "Autovacuum for the queue
    tables")."""
    if autovacuum:
        return []
    return [
        Warning(
            f"autovacuum is off on the PostgreSQL server of database {alias!r}: the queue, "
            "outbox and delivery tables churn and will bloat without it.",
            hint='Set autovacuum = on (docs/deployment.md, "Autovacuum for the queue tables").',
            id="deliveries.W001",
        )
    ]


@register(Tags.database)
@on_readable_settings
def check_pooler(app_configs, databases=None, **kwargs):
    """What transaction pooling would break (deliveries/jobs/connections.py): statically
    from the settings; with ``check --database``, also whether the server is reached
    through a pooler in transaction mode that ``DATABASE_POOLER`` does not name."""

    hint = 'docs/deployment.md, "More than one machine".'
    if settings.DATABASE_POOLER not in POOLERS:
        return [
            Error(
                f"DATABASE_POOLER {settings.DATABASE_POOLER!r} is none of "
                f"{', '.join(map(repr, POOLERS))}.",
                hint=hint,
                id="deliveries.E010",
            )
        ]
    errors = [
        Error(message, hint=hint, id=check_id)
        for alias, settings_dict in settings.DATABASES.items()
        for check_id, message in pooling.pooling_problems(alias, settings_dict)
    ]
    if problem := pooling.listen_url_problem():
        errors.append(Error(problem, hint=hint, id="deliveries.E013"))
    if pooling.listen_conninfo() is None:
        errors.append(
            Info(
                "Behind a pooler in transaction mode without DATABASE_LISTEN_URL the loops "
                "do not LISTEN: they poll, and new work waits up to their intervals.",
                hint=hint,
                id="deliveries.I010",
            )
        )
    if databases and settings.DATABASE_LISTEN_URL and not problem:
        errors += listen_url_messages(pooling, hint)
    if pooling.transaction_pooled():
        return errors
    for alias in databases or ():
        try:
            pooled = pooling.pooled_per_transaction(alias)
        except DatabaseError:
            continue  # an unreachable server is the connection's own error, not this check's
        if pooled:
            errors.append(
                Error(
                    f"Database {alias!r} is reached through a pooler in transaction mode (two "
                    "connections were answered by one server process), and DATABASE_POOLER "
                    "does not say so: prepared statements, server-side cursors and LISTEN "
                    "break there.",
                    hint="Set DATABASE_POOLER to 'transaction' (PgBouncer before 1.21) and "
                    "the DATABASES options it asks for; " + hint,
                    id="deliveries.E014",
                )
            )
    return errors


def listen_url_messages(pooling, hint: str) -> list:
    """``check --database``: whether ``DATABASE_LISTEN_URL`` answers, and as a session."""
    from psycopg import Error as PsycopgError

    try:
        pooled = pooling.listen_url_pooled()
    except PsycopgError as exc:
        return [
            Warning(
                f"DATABASE_LISTEN_URL cannot be reached ({exc}): the loops poll until it can.",
                hint=hint,
                id="deliveries.W011",
            )
        ]
    if not pooled:
        return []
    return [
        Error(
            "DATABASE_LISTEN_URL reaches a pooler in transaction mode (two connections were "
            "answered by one server process): a LISTEN there is lost. It must reach "
            "PostgreSQL directly.",
            hint=hint,
            id="deliveries.E016",
        )
    ]


@register(Tags.database)
@on_readable_settings
def check_connection_budget(app_configs, databases=None, **kwargs):
    """``check --database default``: the connections the deployment described by
    ``DEPLOY_HOSTS`` and ``DEPLOY_PROCESSES`` opens, against what the server allows."""

    counts, problems = pooling.deploy_processes()
    if problems:
        return [Error(p, hint=BUDGET_HINT, id="deliveries.E015") for p in problems]
    if not counts or "default" not in (databases or ()):
        return []
    available = pooling.server_connections_available("default")
    if available is None:
        return []  # no server to ask: check_database_server says why
    hosts = settings.DEPLOY_HOSTS
    pooled = pooling.pooled_per_host(counts) * hosts
    listening = pooling.listeners_per_host(counts) * hosts
    if pooling.transaction_pooled():
        # The pooler opens the server connections; the processes' count is its clients.
        need = settings.DEPLOY_POOLER_CONNECTIONS + listening
        spent = (
            f"the pooler's {settings.DEPLOY_POOLER_CONNECTIONS} server connections "
            f"(DEPLOY_POOLER_CONNECTIONS) and {listening} direct LISTEN connections"
        )
    else:
        need = pooled + listening
        spent = f"{pooled} connections and {listening} LISTEN connections"
    if need <= available:
        return []
    return [
        Warning(
            f"{hosts} host(s) running DEPLOY_PROCESSES open up to {need} connections to the "
            f"server of database 'default' ({spent}); it allows {available} "
            "(max_connections less the reserved ones).",
            hint=BUDGET_HINT,
            id="deliveries.W010",
        )
    ]


BUDGET_HINT = (
    "Raise max_connections, run fewer processes or threads, or put PgBouncer in front "
    '(docs/deployment.md, "More than one machine").'
)
