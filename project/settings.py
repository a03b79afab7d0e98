"""Settings for the webhook service.

Every value comes from the environment through one ``environ.Env`` object, read with a
type. The README's "Settings" table documents each one; ``deliveries/checks.py`` turns a
misconfiguration into a system-check error with a stable id instead of a surprise later.
"""

import importlib.util
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

env = environ.Env()

DEBUG = env.bool("DEBUG", default=False)
# The fallback key only exists so that a fresh clone starts; `check --deploy` flags it.
SECRET_KEY = env.str("SECRET_KEY", default="insecure-development-key-change-me-" + "x" * 20)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_q",
    "deliveries",
    "ingest",
]
# Development only (requirements/dev.txt): `manage.py lintmigrations`, run by `make test`,
# refuses backward-incompatible migrations (docs/compatibility.md).
if importlib.util.find_spec("django_migration_linter") is not None:
    INSTALLED_APPS.append("django_migration_linter")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Admin pages: input the database refuses gets 400, not 500 (deliveries/admin_input.py).
    "deliveries.admin_input.AdminInputMiddleware",
]

ROOT_URLCONF = "project.urls"
WSGI_APPLICATION = "project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------
# PostgreSQL in production and in the test suite (DATABASE_URL). Without it, an embedded
# SQLite file under var/ so that `make run` needs nothing installed. Several processes
# (web, scheduler, relay, workers) share that file, so: WAL (readers never block the
# writer), a busy timeout (a writer waits instead of failing with "database is locked"),
# and IMMEDIATE transactions (take the write lock at BEGIN, so two read-then-write
# transactions cannot deadlock on the lock upgrade).
SQLITE_PATH = str(env.path("SQLITE_PATH", default=str(VAR_DIR / "webhooks.sqlite3")))
if env.str("DATABASE_URL", default=""):
    DATABASES = {"default": env.db("DATABASE_URL")}
    DATABASES["default"].setdefault("CONN_MAX_AGE", env.int("DATABASE_CONN_MAX_AGE", default=60))
    # Before reusing a persistent connection, a request checks it (one round trip) so a
    # database restart costs no failed request; off, the first request on a dead
    # connection fails and the connection is replaced.
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = env.bool(
        "DATABASE_CONN_HEALTH_CHECKS", default=True
    )
else:
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": SQLITE_PATH}}
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # The hot path's statements (deliveries.sql.bound_cursor: claim, lease, record,
    # publish, the inbound insert) are prepared on a connection after this many runs, so
    # PostgreSQL stops parsing and planning them every time. The ORM's client-side-binding
    # cursors never prepare. 0 turns it off (a pooler in transaction mode, like PgBouncer
    # before 1.21, cannot keep prepared statements).
    _prepare = env.int("DATABASE_PREPARE_THRESHOLD", default=5)
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
        "prepare_threshold", _prepare if _prepare > 0 else None
    )
elif DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded default, or a DATABASE_URL of sqlite:///path: the same settings.
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": (
                "PRAGMA journal_mode=WAL;"
                "PRAGMA synchronous=NORMAL;"
                "PRAGMA busy_timeout=30000;"
                "PRAGMA foreign_keys=ON;"
            ),
        }
    )

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Cache ------------------------------------------------------------------------------
# The throttles count here (deliveries/ratelimit.py), so every web process and host must
# share it: a per-process cache (locmem) lets each gunicorn process have the whole rate.
# CACHE_URL in django-environ's form (rediscache://127.0.0.1:6379/1, Django's Redis
# backend); unset, the database cache, whose table deliveries' migrations create.
# deliveries.W002 warns about a cache that is not shared.
CACHE_URL = env.str("CACHE_URL", default="")
if CACHE_URL:
    CACHES = {"default": env.cache("CACHE_URL")}
else:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.db.DatabaseCache",
            "LOCATION": "webhooks_cache",
            # Culling past MAX_ENTRIES (300 by Django's default) would delete live
            # counters and so reset rates; expired rows are deleted on the way anyway.
            "OPTIONS": {"MAX_ENTRIES": 100_000},
        }
    }

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = env.path("STATIC_ROOT", default=str(VAR_DIR / "static"))

SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=not DEBUG)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=not DEBUG)
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=False)
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False)
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# --- Secrets at rest (deliveries/encryption.py, docs/operations.md) -------------------
# Fernet keys, newest first: the first encrypts the secrets the service stores (endpoint
# signing secrets, inbound source secrets, poll sources' auth secrets), any of them
# decrypts. Empty: one key derived from SECRET_KEY, for development only (`check
# --deploy` says so, deliveries.W030). Rotate by putting a new key first, running
# `manage.py rotate_encryption_keys`, then removing the old one.
SECRETS_ENCRYPTION_KEYS = env.list("SECRETS_ENCRYPTION_KEYS", default=[])

# --- REST -----------------------------------------------------------------------------
# The product's API configures its own views (deliveries/api/base.py): a host's
# REST_FRAMEWORK, the standalone service's included, changes nothing there.
API_THROTTLE_RATE = env.str("API_THROTTLE_RATE", default="50/s")

# --- Egress ---------------------------------------------------------------------------
# CIDRs the egress guard admits although they are private or loopback. Empty by default.
# Cloud metadata addresses stay refused whatever this says.
EGRESS_ALLOW_NETWORKS = env.list("EGRESS_ALLOW_NETWORKS", default=[])
# Bytes of a receiver's response that are read at most; the rest is cut off unread.
EGRESS_MAX_RESPONSE_BYTES = env.int("EGRESS_MAX_RESPONSE_BYTES", default=64 * 1024)
EGRESS_CONNECT_TIMEOUT = env.float("EGRESS_CONNECT_TIMEOUT", default=5.0)

# --- Delivery policy ------------------------------------------------------------------
# Seconds between attempts; its length is the number of retries. Default: Standard
# Webhooks' example schedule, about three days in all.
DELIVERY_RETRY_SCHEDULE = env.list(
    "DELIVERY_RETRY_SCHEDULE",
    cast=float,
    default=[5, 300, 1800, 7200, 18000, 36000, 50400, 72000, 86400],
)
DELIVERY_RETRY_JITTER = env.float("DELIVERY_RETRY_JITTER", default=0.2)
DELIVERY_RETRY_AFTER_MAX = env.float("DELIVERY_RETRY_AFTER_MAX", default=6 * 3600)
DELIVERY_TIMEOUT = env.float("DELIVERY_TIMEOUT", default=15.0)
DELIVERY_MAX_TIMEOUT = env.float("DELIVERY_MAX_TIMEOUT", default=30.0)
DELIVERY_LEASE_SECONDS = env.float("DELIVERY_LEASE_SECONDS", default=60.0)
DELIVERY_DISABLE_AFTER = env.float("DELIVERY_DISABLE_AFTER", default=5 * 86400)
DELIVERY_RESPONSE_BODY_LIMIT = env.int("DELIVERY_RESPONSE_BODY_LIMIT", default=20_000)
DELIVERY_MAX_PAYLOAD_BYTES = env.int("DELIVERY_MAX_PAYLOAD_BYTES", default=256 * 1024)
DELIVERY_MAX_IN_FLIGHT = env.int("DELIVERY_MAX_IN_FLIGHT", default=5000)
DELIVERY_TENANT_MAX_IN_FLIGHT = env.int("DELIVERY_TENANT_MAX_IN_FLIGHT", default=2000)
DELIVERY_ENDPOINT_MAX_CONCURRENCY = env.int("DELIVERY_ENDPOINT_MAX_CONCURRENCY", default=500)

SCHEDULER_PAGE_SIZE = env.int("SCHEDULER_PAGE_SIZE", default=1000)
SCHEDULER_STALE_ENQUEUED_SECONDS = env.float("SCHEDULER_STALE_ENQUEUED_SECONDS", default=600.0)
# The longest wait between passes of an idle loop (a busy one goes on at once).
SCHEDULER_INTERVAL = env.float("SCHEDULER_INTERVAL", default=0.5)
RELAY_PAGE_SIZE = env.int("RELAY_PAGE_SIZE", default=1000)
RELAY_INTERVAL = env.float("RELAY_INTERVAL", default=0.5)
# How long a relay holds the outbox rows it is publishing; a relay that dies leaves them
# to another after this.
RELAY_CLAIM_SECONDS = env.float("RELAY_CLAIM_SECONDS", default=30.0)
WORKER_BATCH_SIZE = env.int("WORKER_BATCH_SIZE", default=200)
WORKER_CONCURRENCY = env.int("WORKER_CONCURRENCY", default=512)
WORKER_IDLE_SLEEP = env.float("WORKER_IDLE_SLEEP", default=0.05)
# Seconds a stopping worker lets its requests in flight run before it cuts them off and
# gives their leases back. Keep it under the process manager's stop timeout.
WORKER_SHUTDOWN_GRACE = env.float("WORKER_SHUTDOWN_GRACE", default=25.0)
# Seconds between heartbeats of every long-running command (scheduler, relay, workers,
# poll loop, backfill), busy or idle. A loop silent for six of them is taken as not
# running (deliveries.selectors.loop_stale_after, which delivery_status uses).
LOOP_HEARTBEAT_SECONDS = env.float("LOOP_HEARTBEAT_SECONDS", default=10.0)

# Crash-boundary fault injection for tests and the soak: the name of a point in
# deliveries/faults.py at which the process kills itself. Empty in production.
FAULT_INJECT_AT = env.str("FAULT_INJECT_AT", default="")
FAULT_INJECT_AFTER = env.int("FAULT_INJECT_AFTER", default=1)

# --- Metrics ------------------------------------------------------------------------
# /metrics answers a Bearer METRICS_TOKEN, or requests from these addresses that no proxy
# relayed (deliveries/prometheus.py). None by default: a proxy on the same host relays the
# internet from loopback. With DEBUG (make run), loopback.
METRICS_TOKEN = env.str("METRICS_TOKEN", default="")
METRICS_ALLOW_IPS = env.list("METRICS_ALLOW_IPS", default=["127.0.0.1", "::1"] if DEBUG else [])
# Database gauges are recomputed at most this often per process, each provider under a
# statement timeout (milliseconds).
METRICS_CACHE_SECONDS = env.float("METRICS_CACHE_SECONDS", default=10.0)
METRICS_DB_BUDGET_MS = env.int("METRICS_DB_BUDGET_MS", default=500)
# The endpoint label of the dispatch metrics: these endpoint ids always, plus up to K of
# the busiest endpoints a process sees; every other endpoint is "other".
METRICS_ENDPOINTS = env.list("METRICS_ENDPOINTS", default=[])
METRICS_ENDPOINT_TOP_K = env.int("METRICS_ENDPOINT_TOP_K", default=10)

# --- Alerts (deliveries/alerts.py, docs/operations.md) ------------------------------
# The tenant whose endpoints receive an "operations.alert" event per incident ("" : no
# webhook), and the addresses that get an email per incident (empty: no email).
ALERTS_TENANT = env.str("ALERTS_TENANT", default="")
ALERTS_EMAIL_TO = env.list("ALERTS_EMAIL_TO", default=[])
ALERTS_EMAIL_FROM = env.str("ALERTS_EMAIL_FROM", default="")
# New dead letters between two checks that open an incident.
ALERTS_DEAD_LETTER_THRESHOLD = env.int("ALERTS_DEAD_LETTER_THRESHOLD", default=1)
# Signature verification failures of one source between two checks that open one.
ALERTS_VERIFICATION_FAILURE_THRESHOLD = env.int("ALERTS_VERIFICATION_FAILURE_THRESHOLD", default=20)
# An incident not seen again for this many seconds is resolved; seen after that, it is a
# new incident with a new message.
ALERTS_RESOLVE_AFTER = env.float("ALERTS_RESOLVE_AFTER", default=3600.0)

# --- Mail (Django's; used by the alert emails) ------------------------------------
# EMAIL_URL: smtp://user:password@host:587 (+tls: submission), consolemail://, …
if env.str("EMAIL_URL", default=""):
    globals().update(env.email_url("EMAIL_URL"))
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="webhooks@localhost")
SERVER_EMAIL = env.str("SERVER_EMAIL", default=DEFAULT_FROM_EMAIL)

# --- Retention (deliveries/retention.py, docs/operations.md) --------------------------
# Terminal deliveries (with their attempts), published outbox rows and events older than
# this are pruned; events that carry an Idempotency-Key are kept for at least
# IDEMPOTENCY_KEY_RETENTION so that a retried request is still recognised.
RETENTION_DELIVERIES_DAYS = env.float("RETENTION_DELIVERIES_DAYS", default=30.0)
IDEMPOTENCY_KEY_RETENTION = env.float("IDEMPOTENCY_KEY_RETENTION", default=86400.0)
# Finished inbound events (with their handler runs) are pruned after this, but never
# before INBOUND_DEDUPE_WINDOW: the row is the (source, event_id) identity that turns a
# provider's late retry into a counted duplicate instead of a second processing.
RETENTION_INBOUND_DAYS = env.float("RETENTION_INBOUND_DAYS", default=30.0)
INBOUND_DEDUPE_WINDOW = env.float("INBOUND_DEDUPE_WINDOW", default=7 * 86400.0)
# Finished loop runs and resolved operational events.
RETENTION_OPERATIONS_DAYS = env.float("RETENTION_OPERATIONS_DAYS", default=30.0)
PRUNE_BATCH_SIZE = env.int("PRUNE_BATCH_SIZE", default=1000)

# --- Tracing (optional: requirements/otel.txt) ----------------------------------------
# Off by default; deliveries/tracing.py. A tracer provider the host set up already
# (opentelemetry-instrument) is used as it is; else one with OTEL_TRACES_EXPORTER
# ("otlp", which needs opentelemetry-exporter-otlp-proto-http, or "console").
OTEL_TRACING = env.bool("OTEL_TRACING", default=False)
OTEL_SERVICE_NAME = env.str("OTEL_SERVICE_NAME", default="trusty-webhooks")
OTEL_TRACES_EXPORTER = env.str("OTEL_TRACES_EXPORTER", default="otlp")

# --- Inbound ------------------------------------------------------------------------
# Modules that register inbound handlers with @ingest.handlers.handler (imported at start).
INGEST_HANDLER_MODULES = env.list("INGEST_HANDLER_MODULES", default=[])
# How long a web process trusts its cached copy of a source and its secrets (0: no cache).
INGEST_SOURCE_CACHE_SECONDS = env.float("INGEST_SOURCE_CACHE_SECONDS", default=5.0)

# --- Queue transport (django-q2's broker interface) -----------------------------------
QUEUE_VISIBILITY_TIMEOUT = env.int("QUEUE_VISIBILITY_TIMEOUT", default=90)
REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
QUEUE_BROKER_CLASS = env.str("QUEUE_BROKER_CLASS", default="deliveries.broker.DatabaseBroker")
# Two queues on the one broker, never shared: QUEUE_NAME carries the pipeline's messages
# (relay to workers), TASKS_QUEUE_NAME is django-q2's cluster (a `qcluster` running the
# maintenance schedules). A qcluster on the pipeline's queue would take delivery messages
# it cannot unpickle and delete them; the workers would hide its tasks. deliveries.E007
# refuses one name for both.
QUEUE_NAME = env.str("QUEUE_NAME", default="webhooks")
TASKS_QUEUE_NAME = env.str("TASKS_QUEUE_NAME", default=f"{QUEUE_NAME}-tasks")
Q_CLUSTER = {
    "name": TASKS_QUEUE_NAME,
    "broker_class": QUEUE_BROKER_CLASS,
    "redis": REDIS_URL,
    # The broker's visibility timeout: a message not acknowledged within it is handed out
    # again. It must exceed the longest request plus recording time.
    "retry": QUEUE_VISIBILITY_TIMEOUT,
    "timeout": int(QUEUE_VISIBILITY_TIMEOUT * 0.8),
    "bulk": WORKER_BATCH_SIZE,
    "workers": 2,
    "save_limit": 250,
    "catch_up": False,
}

# --- Logging --------------------------------------------------------------------------
LOG_LEVEL = env.str("LOG_LEVEL", default="INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "project.logging.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "aiohttp.access": {"level": "WARNING"},
    },
}

# --- Polling and backfill (docs/polling.md) ---------------------------------------------
# Seconds a poll run or a backfill holds its source's (run's) lease without renewing it;
# renewed with every page, so it must exceed the slowest page (request plus storing).
POLL_LEASE_SECONDS = env.float("POLL_LEASE_SECONDS", default=300.0)
BACKFILL_LEASE_SECONDS = env.float("BACKFILL_LEASE_SECONDS", default=300.0)
# Pages one poll run reads at most; the next run goes on from the cursor.
POLL_MAX_PAGES = env.int("POLL_MAX_PAGES", default=1000)
# Bytes of one page read at most; a longer page is an error (ask for smaller pages).
POLL_MAX_RESPONSE_BYTES = env.int("POLL_MAX_RESPONSE_BYTES", default=16 * 1024 * 1024)
# Times a backfill retries a request that got no answer, a 429 or a 5xx.
BACKFILL_RETRIES = env.int("BACKFILL_RETRIES", default=5)
