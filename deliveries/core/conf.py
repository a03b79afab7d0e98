"""The outbound app's settings, each with its default here: a host sets only what it changes.

Every name is a Django setting of the same name (docs/settings.md). A host whose own
settings already use one of the names for something else (``METRICS_TOKEN``,
``API_THROTTLE_RATE``) gives the apps' value in the ``TRUSTY_WEBHOOKS`` dict instead: a
key there wins over the flat setting, which the host's own code keeps for itself.

The apps read these through ``settings`` below (a drop-in for ``django.conf.settings``),
so the defaults need no installing and no import order, and ``override_settings`` works
as usual. The standalone service's ``project/settings.py`` reads each name from the
environment with the default written here.

A host writes them as Python values, and the default's type says which it may write
(``read_setting``): a list as a list or tuple, or one comma-separated string (the
environment's form); a number as a number or a numeric string, and a duration (``UNITS``)
as a ``datetime.timedelta`` too; a flag as a bool; a dict as a mapping; ``None`` for the
default. Anything
else is the system check ``deliveries.E040``, one per setting, naming the type it got.
"""

import functools
import math
import numbers
from collections.abc import Mapping
from datetime import timedelta
from decimal import Decimal

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

NAMESPACE = "TRUSTY_WEBHOOKS"
# django-q2's Redis connection in ``q_cluster`` (the pipeline's, with the Redis broker).
REDIS_URL = "redis://127.0.0.1:6379/0"

# Sequences are tuples so that no caller can change a default in place.
DEFAULTS: dict[str, object] = {
    # Egress guard: CIDRs admitted although private or loopback (cloud metadata stays
    # refused); bytes of a response read at most; seconds to connect.
    "EGRESS_ALLOW_NETWORKS": (),
    "EGRESS_MAX_RESPONSE_BYTES": 64 * 1024,
    "EGRESS_CONNECT_TIMEOUT": 5.0,
    # Seconds between attempts (its length is the number of retries): Standard Webhooks'
    # example schedule, about three days in all; the spread of each wait; the longest
    # Retry-After honoured.
    "DELIVERY_RETRY_SCHEDULE": (
        5.0,
        300.0,
        1800.0,
        7200.0,
        18000.0,
        36000.0,
        50400.0,
        72000.0,
        86400.0,
    ),
    "DELIVERY_RETRY_JITTER": 0.2,
    "DELIVERY_RETRY_AFTER_MAX": 6 * 3600.0,
    # Request timeout and the most an endpoint may ask for; a worker's lease; how long an
    # endpoint may fail before it is disabled.
    "DELIVERY_TIMEOUT": 15.0,
    "DELIVERY_MAX_TIMEOUT": 30.0,
    "DELIVERY_LEASE_SECONDS": 60.0,
    "DELIVERY_DISABLE_AFTER": 5 * 86400.0,
    # Characters of a response kept; the largest payload; ceilings on deliveries in flight.
    "DELIVERY_RESPONSE_BODY_LIMIT": 20_000,
    "DELIVERY_MAX_PAYLOAD_BYTES": 256 * 1024,
    "DELIVERY_MAX_IN_FLIGHT": 5000,
    "DELIVERY_TENANT_MAX_IN_FLIGHT": 2000,
    "DELIVERY_ENDPOINT_MAX_CONCURRENCY": 500,
    # The loops: rows per transaction, the longest idle wait, the lost-dispatch sweep, the
    # relay's claim on the rows it publishes to a broker outside the database.
    "SCHEDULER_PAGE_SIZE": 2000,
    "SCHEDULER_STALE_ENQUEUED_SECONDS": 600.0,
    "SCHEDULER_INTERVAL": 0.5,
    "RELAY_PAGE_SIZE": 2000,
    "RELAY_INTERVAL": 0.5,
    "RELAY_CLAIM_SECONDS": 30.0,
    # Workers: messages per dequeue, batches taken at once per process (each lane's
    # database work has a thread and a connection of its own), requests in flight, the
    # idle wait, the stop grace (keep it under the process manager's stop timeout).
    "WORKER_BATCH_SIZE": 200,
    "WORKER_LANES": 2,
    "WORKER_CONCURRENCY": 512,
    "WORKER_IDLE_SLEEP": 0.05,
    "WORKER_SHUTDOWN_GRACE": 25.0,
    # The host's background jobs (deliveries.jobs.background): modules that register
    # @job functions, imported at start; jobs run at once per run_jobs process; running
    # jobs per tenant at most (0: no cap); seconds a lease outlasts a job's timeout; the
    # wait before a job whose entity lock is held is tried again.
    "JOBS_MODULES": (),
    "JOBS_CONCURRENCY": 16,
    "JOBS_TENANT_CONCURRENCY": 8,
    "JOBS_LEASE_MARGIN": 30.0,
    "JOBS_LOCK_RETRY": 1.0,
    # A connection pooler between the processes and PostgreSQL (docs/deployment.md, "More
    # than one machine"): "" (none, or one in session mode), "transaction" (transaction
    # pooling without prepared statements: PgBouncer before 1.21) or "transaction-prepared"
    # (PgBouncer 1.21+ with max_prepared_statements). A libpq URL of a direct connection,
    # past the pooler, on which the loops LISTEN for wake-ups; without one, behind
    # transaction pooling they poll.
    "DATABASE_POOLER": "",
    "DATABASE_LISTEN_URL": "",
    # The connection budget (deliveries.W010): hosts, and the processes each runs by kind
    # (web, web_threads, scheduler, relay, workers, worker_lanes, jobs, jobs_concurrency,
    # smtp, other; empty: no budget is checked); behind transaction pooling, the server
    # connections the pooler (all of them together) may open.
    "DEPLOY_HOSTS": 1,
    "DEPLOY_PROCESSES": {},
    "DEPLOY_POOLER_CONNECTIONS": 0,
    # Seconds between heartbeats of every long-running command; six missed: not running.
    "LOOP_HEARTBEAT_SECONDS": 10.0,
    # The pipeline's transport (relay to workers): a django-q2 broker class, its queue,
    # and the seconds before an unacknowledged message is handed out again.
    "QUEUE_BROKER_CLASS": "deliveries.jobs.brokers.database.DatabaseBroker",
    "QUEUE_NAME": "webhooks",
    "QUEUE_VISIBILITY_TIMEOUT": 90,
    # Tests and the soak only: the crash point (deliveries/jobs/faults.py) and its count.
    "FAULT_INJECT_AT": "",
    "FAULT_INJECT_AFTER": 1,
    # The event catalogue: seconds a process trusts its cached copy of a type's schemas
    # (0: read them at every publish; changes made in the same process apply at once).
    "EVENT_SCHEMA_CACHE_SECONDS": 5.0,
    # The most an endpoint may ask for, whoever sets it (the API, the portal, the
    # services): a start rate (requests a second) and a concurrency.
    "DELIVERY_ENDPOINT_RATE_CEILING": 1000.0,
    "DELIVERY_ENDPOINT_CONCURRENCY_CEILING": 10_000,
    # The customer portal (deliveries/portal/): a link's default and longest life, the
    # portal session's length, the public base URL of portal_url() without a request,
    # the look (title, logo, colours, an extra stylesheet) and who may frame it.
    "PORTAL_LINK_TTL": 300,
    "PORTAL_LINK_MAX_TTL": 86400,
    "PORTAL_SESSION_SECONDS": 3600,
    "PORTAL_BASE_URL": "",
    "PORTAL_TITLE": "Webhooks",
    "PORTAL_LOGO_URL": "",
    "PORTAL_COLORS": {},
    "PORTAL_CSS_URL": "",
    "PORTAL_FRAME_ANCESTORS": (),
    # Requests per API key (DRF rate syntax), counted in the shared cache.
    "API_THROTTLE_RATE": "50/s",
    # Fernet keys, newest first; empty: one derived from SECRET_KEY (development only).
    "SECRETS_ENCRYPTION_KEYS": (),
    # /metrics: a Bearer token, unproxied addresses admitted, the gauges' cache and
    # statement budget, the endpoint label's fixed ids and top-K.
    "METRICS_TOKEN": "",
    "METRICS_ALLOW_IPS": (),
    "METRICS_CACHE_SECONDS": 10.0,
    "METRICS_DB_BUDGET_MS": 500,
    "METRICS_ENDPOINTS": (),
    "METRICS_ENDPOINT_TOP_K": 10,
    # Alerts: the tenant that gets an operations.alert event, the mail's recipients and
    # sender ("": DEFAULT_FROM_EMAIL), the thresholds, the quiet time that resolves one.
    "ALERTS_TENANT": "",
    "ALERTS_EMAIL_TO": (),
    "ALERTS_EMAIL_FROM": "",
    "ALERTS_DEAD_LETTER_THRESHOLD": 1,
    "ALERTS_RESOLVE_AFTER": 3600.0,
    # Tenants are told when an endpoint has been failing this many seconds (it is
    # disabled after DELIVERY_DISABLE_AFTER); 0: never for failing, only when disabled.
    "TENANT_NOTIFY_FAILING_AFTER": 3600.0,
    # Retention: days of terminal deliveries, outbox rows and events; seconds an event with
    # an Idempotency-Key is kept at least; days of loop runs and operational events.
    "RETENTION_DELIVERIES_DAYS": 30.0,
    "IDEMPOTENCY_KEY_RETENTION": 86400.0,
    "RETENTION_OPERATIONS_DAYS": 30.0,
    "PRUNE_BATCH_SIZE": 1000,
    # OpenTelemetry tracing (requirements/otel.txt): off by default.
    "OTEL_TRACING": False,
    "OTEL_SERVICE_NAME": "trusty-webhooks",
    "OTEL_TRACES_EXPORTER": "otlp",
}


# DATABASE_POOLER's values: none (or a pooler in session mode), transaction pooling
# without prepared statements, transaction pooling that keeps them (PgBouncer 1.21+).
POOLERS = ("", "transaction", "transaction-prepared")
TRANSACTION_POOLERS = ("transaction", "transaction-prepared")

SECOND = timedelta(seconds=1)
# The unit of each setting that is a duration, which a host may also write as a
# ``timedelta`` (a list's unit is its items'). A number setting not named here is no
# duration: a timedelta for it is refused, not guessed at.
UNITS: dict[str, timedelta] = {
    "EGRESS_CONNECT_TIMEOUT": SECOND,
    "DELIVERY_RETRY_SCHEDULE": SECOND,
    "DELIVERY_RETRY_AFTER_MAX": SECOND,
    "DELIVERY_TIMEOUT": SECOND,
    "DELIVERY_MAX_TIMEOUT": SECOND,
    "DELIVERY_LEASE_SECONDS": SECOND,
    "DELIVERY_DISABLE_AFTER": SECOND,
    "SCHEDULER_STALE_ENQUEUED_SECONDS": SECOND,
    "SCHEDULER_INTERVAL": SECOND,
    "RELAY_INTERVAL": SECOND,
    "RELAY_CLAIM_SECONDS": SECOND,
    "WORKER_IDLE_SLEEP": SECOND,
    "WORKER_SHUTDOWN_GRACE": SECOND,
    "JOBS_LEASE_MARGIN": SECOND,
    "JOBS_LOCK_RETRY": SECOND,
    "LOOP_HEARTBEAT_SECONDS": SECOND,
    "QUEUE_VISIBILITY_TIMEOUT": SECOND,
    "METRICS_CACHE_SECONDS": SECOND,
    "METRICS_DB_BUDGET_MS": timedelta(milliseconds=1),
    "ALERTS_RESOLVE_AFTER": SECOND,
    "RETENTION_DELIVERIES_DAYS": timedelta(days=1),
    "IDEMPOTENCY_KEY_RETENTION": SECOND,
    "RETENTION_OPERATIONS_DAYS": timedelta(days=1),
    "EVENT_SCHEMA_CACHE_SECONDS": SECOND,
    "PORTAL_LINK_TTL": SECOND,
    "PORTAL_LINK_MAX_TTL": SECOND,
    "PORTAL_SESSION_SECONDS": SECOND,
    "TENANT_NOTIFY_FAILING_AFTER": SECOND,
}

MISTYPED = "deliveries.E040"
UNKNOWN_IN_NAMESPACE = "deliveries.E041"
# django-environ's spellings of a flag in the environment, which a host may paste.
_TRUE = frozenset({"true", "on", "ok", "y", "yes", "1"})
_FALSE = frozenset({"false", "off", "n", "no", "0", ""})


class SettingTypeError(ImproperlyConfigured):
    """A setting of the apps holds a value of no type it takes (``deliveries.E040``)."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"{name}: {problem} ({MISTYPED})")
        self.name, self.problem = name, problem


def _kind(value: object) -> str:
    # The type a value is, never the value itself: the setting may be a secret.
    return "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"


def _number(value: object, unit: timedelta | None, whole: bool) -> float | int:
    """A number setting's (or list item's) value; ``ValueError`` says what it takes."""
    takes = "a whole number" if whole else "a number"
    takes += f" (of {_unit_name(unit)}) or a datetime.timedelta" if unit else ""
    if isinstance(value, timedelta) and unit:
        number = value / unit
    elif isinstance(value, numbers.Real | Decimal) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(f"takes {takes}; got a number out of range") from None
    elif isinstance(value, str):
        try:
            number = float(value.strip().replace("_", ""))
        except ValueError:
            raise ValueError(f"takes {takes}; got a string that is no number") from None
    else:
        raise ValueError(f"takes {takes}; got {_kind(value)}")
    if not math.isfinite(number):
        raise ValueError(f"takes {takes}; got {number}")
    if whole:
        if not number.is_integer():
            raise ValueError(f"takes {takes}; got a fraction")
        return int(number)
    return number


def _unit_name(unit: timedelta) -> str:
    names = {SECOND: "seconds", timedelta(days=1): "days", timedelta(milliseconds=1): "ms"}
    return names.get(unit, str(unit))


def _item(default: object, value: object, unit: timedelta | None):
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"takes a bool (True or False); got {_kind(value)}")
    if isinstance(default, int):
        return _number(value, unit, whole=True)
    if isinstance(default, float):
        return _number(value, unit, whole=False)
    if isinstance(default, Mapping):
        if isinstance(value, Mapping):
            return dict(value)
        raise ValueError(f"takes a dict; got {_kind(value)}")
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise ValueError("takes a string; got bytes that are not ASCII") from None
    if isinstance(value, str):
        return value.strip()
    raise ValueError(f"takes a string; got {_kind(value)}")


def read_setting(name: str, value: object, default: object, unit: timedelta | None = None):
    """``value``, as a host wrote setting ``name``, in the type of its ``default``:
    ``SettingTypeError`` (``deliveries.E040``) when it is no form of that type."""
    if value is None:
        return default
    try:
        if not isinstance(default, tuple):
            return _item(default, value, unit)
        example = default[0] if default else ""
        if isinstance(value, str | bytes):
            items = [part for part in _item("", value, None).split(",") if part.strip()]
        elif isinstance(value, list | tuple):
            items = list(value)
        else:
            raise ValueError(
                f"takes a list or tuple (or one comma-separated string); got {_kind(value)}"
            )
        read = []
        for position, item in enumerate(items, start=1):
            try:
                read.append(_item(example, item, unit))
            except ValueError as exc:
                raise ValueError(f"item {position} {exc}") from None
        return tuple(item for item in read if item != "")  # "a,,b", "a,", [" "]: no item
    except ValueError as exc:
        raise SettingTypeError(name, str(exc)) from None


_UNSET = object()


class AppSettings:
    """``django.conf.settings`` with the apps' defaults: for a name in ``defaults``, the
    ``TRUSTY_WEBHOOKS`` entry, else the host's flat setting, else the default, read in
    the default's type (``read_setting``); any other name is Django's setting as it is.
    Read at every access, so a changed setting (a test's ``settings`` fixture,
    ``override_settings``) applies at once; what a value reads as is kept while the
    setting holds that same object."""

    # Every instance, so that the system check reads every installed app's settings.
    instances: list["AppSettings"] = []

    def __init__(self, *defaults: Mapping[str, object], units: Mapping[str, timedelta] = UNITS):
        self._defaults: dict[str, object] = {}
        for more in defaults:
            self._defaults.update(more)
        self._units = dict(units)
        self._read: dict[str, tuple[object, object]] = {}
        AppSettings.instances.append(self)

    def __getattr__(self, name: str):
        if name not in self._defaults:
            return getattr(django_settings, name)
        namespace = getattr(django_settings, NAMESPACE, None)
        if isinstance(namespace, dict) and name in namespace:
            value = namespace[name]
        else:
            value = getattr(django_settings, name, _UNSET)
        if value is _UNSET or value is None:
            return self._defaults[name]
        read = self._read.get(name)
        if read is not None and read[0] is value:
            return read[1]
        result = read_setting(name, value, self._defaults[name], self._units.get(name))
        self._read[name] = (value, result)
        return result

    def names(self) -> frozenset[str]:
        return frozenset(self._defaults)


def setting_problems() -> list[tuple[str, str]]:
    """(id, message) for every setting of the installed apps that cannot be read: a
    value of no type it takes, a ``TRUSTY_WEBHOOKS`` that is no dict or names no
    setting of theirs. One per setting."""
    problems: dict[str, tuple[str, str]] = {}
    known: set[str] = set()
    for app_settings in AppSettings.instances:
        known |= app_settings.names()
        for name in sorted(app_settings.names() - set(problems)):
            try:
                getattr(app_settings, name)
            except SettingTypeError as exc:
                problems[name] = (MISTYPED, f"{name} {exc.problem}.")
    namespace = getattr(django_settings, NAMESPACE, None) or {}
    if not isinstance(namespace, dict):
        problems[NAMESPACE] = (
            UNKNOWN_IN_NAMESPACE,
            f"{NAMESPACE} takes a dict of the apps' setting names; got {_kind(namespace)}.",
        )
    else:
        for name in sorted(set(namespace) - known):
            problems[f"{NAMESPACE}[{name!r}]"] = (
                UNKNOWN_IN_NAMESPACE,
                f"{NAMESPACE}[{name!r}] is no setting of the installed apps.",
            )
    return list(problems.values())


settings = AppSettings(DEFAULTS)


def app_setting(name: str, absent: object = None):
    """Setting ``name`` of whichever installed app defines it (``absent`` when none does):
    for what one app reads of another's settings without importing it."""
    for app_settings in AppSettings.instances:
        if name in app_settings.names():
            return getattr(app_settings, name)
    return absent


def q_cluster(
    *,
    name: str = f"{DEFAULTS['QUEUE_NAME']}-tasks",
    broker_class: str = DEFAULTS["QUEUE_BROKER_CLASS"],
    redis: str = REDIS_URL,
    visibility_timeout: int = DEFAULTS["QUEUE_VISIBILITY_TIMEOUT"],
    bulk: int = DEFAULTS["WORKER_BATCH_SIZE"],
) -> dict:
    """A ``Q_CLUSTER`` for django-q2's own cluster (a ``qcluster`` running the maintenance
    schedules) on the pipeline's broker class, under a queue name of its own: a
    qcluster on the pipeline's queue would take delivery messages it cannot read
    (deliveries.E007). For a host's settings module; a host
    without ``Q_CLUSTER`` gets django-q2's defaults for its cluster, and the pipeline
    uses ``QUEUE_BROKER_CLASS`` either way."""
    return {
        "name": name,
        "broker_class": broker_class,
        "redis": redis,
        # The broker's visibility timeout: a message not acknowledged within it is handed
        # out again. It must exceed the longest request plus recording time.
        "retry": visibility_timeout,
        "timeout": int(visibility_timeout * 0.8),
        "bulk": bulk,
        "workers": 2,
        "save_limit": 250,
        "catch_up": False,
    }


def on_readable_settings(check):
    """The checks of what the settings mean run once every setting reads as its type:
    before, ``check_setting_types`` has said what is wrong, once."""

    @functools.wraps(check)
    def checked(app_configs, **kwargs):
        return [] if setting_problems() else check(app_configs, **kwargs)

    return checked
