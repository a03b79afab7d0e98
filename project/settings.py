"""Settings of the standalone service: a thin host of the apps.

Every value comes from the environment through one ``environ.Env`` object, read with a
type. The apps' own settings take their defaults from the apps (deliveries/core/conf.py,
ingest/conf.py), so each default is written once; what is set here is the host's:
database, cache, security, REST, mail, logging, django-q2's cluster. docs/settings.md
documents each one; ``deliveries/checks.py`` turns a misconfiguration into a
system-check error with a stable id instead of a surprise later.
"""

import importlib.util
from pathlib import Path

import environ

from deliveries.apps import TRUSTY_APPS
from deliveries.core import conf as deliveries_conf
from ingest import conf as ingest_conf

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
    *TRUSTY_APPS,
    # `manage.py spectacular`, which `make test` runs to validate the API's schema. This
    # service has no DRF view of its own for drf-spectacular's deploy check to refuse.
    "drf_spectacular",
    # The standalone service's own admin module (project/admin.py): its users' and
    # groups' admins, audited. Last, so that it replaces Django's.
    "project",
]
# Django's Tasks API: `@task` functions run as background jobs (docs/jobs.md). Django 6.0
# has it built in; before it, the django-tasks backport is an app of its own.
if importlib.util.find_spec("django.tasks") is None:
    INSTALLED_APPS.append("django_tasks")
TASKS = {"default": {"BACKEND": "deliveries.jobs.tasks.JobsBackend"}}
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
    # Admin pages: input the database refuses gets 400, not 500 (deliveries/core/admin_input.py).
    "deliveries.core.admin_input.AdminInputMiddleware",
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
    # DATABASE_POOLER: a pooler in transaction mode before the server (PgBouncer), whose
    # server connections change between transactions (deliveries/jobs/connections.py).
    _pooler = env.str("DATABASE_POOLER", default=deliveries_conf.DEFAULTS["DATABASE_POOLER"])
    # The hot path's statements (deliveries.core.sql.bound_cursor: claim, lease, record,
    # publish, the inbound insert) are prepared on a connection after this many runs, so
    # PostgreSQL stops parsing and planning them every time. The ORM's client-side-binding
    # cursors never prepare. 0 turns it off, the default behind DATABASE_POOLER=transaction
    # (PgBouncer before 1.21 cannot keep prepared statements; deliveries.E011 refuses both).
    _prepare = env.int("DATABASE_PREPARE_THRESHOLD", default=0 if _pooler == "transaction" else 5)
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
        "prepare_threshold", _prepare if _prepare > 0 else None
    )
    # QuerySet.iterator() reads through a named cursor, which lives in one server session.
    if _pooler in deliveries_conf.TRANSACTION_POOLERS:
        DATABASES["default"].setdefault("DISABLE_SERVER_SIDE_CURSORS", True)
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
# The throttles count here (deliveries/core/ratelimit.py), so every web process and host must
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

# --- REST -----------------------------------------------------------------------------
# The product's API configures its own views (deliveries/api/base.py): a host's
# REST_FRAMEWORK, the standalone service's included, changes nothing there.

# --- The apps' settings (docs/settings.md) --------------------------------------------
# Every setting the apps read, from the environment variable of the same name, with the
# default the app carries (deliveries/core/conf.py, ingest/conf.py): written once, there. The
# default's type is the type read; a tuple is a comma-separated list of its items' type.


def _from_env(name: str, default):
    if isinstance(default, bool):
        return env.bool(name, default=default)
    if isinstance(default, int):
        return env.int(name, default=default)
    if isinstance(default, float):
        return env.float(name, default=default)
    if isinstance(default, dict):  # NAME=value,NAME=value
        return env.dict(name, default=dict(default))
    if isinstance(default, tuple):
        cast = type(default[0]) if default else str
        return env.list(name, cast=cast, default=list(default))
    return env.str(name, default=default)


_app_defaults = {**deliveries_conf.DEFAULTS, **ingest_conf.DEFAULTS}
# /metrics answers loopback too under DEBUG (make run); in production a proxy on the same
# host relays the internet from loopback, so no address by default.
_app_defaults["METRICS_ALLOW_IPS"] = ("127.0.0.1", "::1") if DEBUG else ()
_app_settings = {name: _from_env(name, default) for name, default in _app_defaults.items()}
globals().update(_app_settings)

# --- Mail (Django's; used by the alert emails) ------------------------------------
# EMAIL_URL: smtp://user:password@host:587 (+tls: submission), consolemail://, …
if env.str("EMAIL_URL", default=""):
    globals().update(env.email_url("EMAIL_URL"))
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="webhooks@localhost")
SERVER_EMAIL = env.str("SERVER_EMAIL", default=DEFAULT_FROM_EMAIL)

# --- django-q2's cluster (a qcluster running the maintenance schedules) ---------------
# On the pipeline's broker class under a queue of its own, never QUEUE_NAME: a qcluster
# on the pipeline's queue would take delivery messages it cannot unpickle and delete
# them; the workers would hide its tasks (deliveries.E007 refuses one name for both).
TASKS_QUEUE_NAME = env.str("TASKS_QUEUE_NAME", default=f"{_app_settings['QUEUE_NAME']}-tasks")
REDIS_URL = env.str("REDIS_URL", default=deliveries_conf.REDIS_URL)
Q_CLUSTER = deliveries_conf.q_cluster(
    name=TASKS_QUEUE_NAME,
    broker_class=_app_settings["QUEUE_BROKER_CLASS"],
    redis=REDIS_URL,
    visibility_timeout=_app_settings["QUEUE_VISIBILITY_TIMEOUT"],
    bulk=_app_settings["WORKER_BATCH_SIZE"],
)

# --- Logging --------------------------------------------------------------------------
LOG_LEVEL = env.str("LOG_LEVEL", default="INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "deliveries.core.logs.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "aiohttp.access": {"level": "WARNING"},
    },
}
