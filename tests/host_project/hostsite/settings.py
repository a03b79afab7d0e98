"""The settings of a team's own Django project with the product installed from its wheel.

Django's settings as a production project writes them, its own app and API, then the
apps' block copied from docs/install.md as it is (tests/e2e/test_host_project_wheel.py
checks that it is that block and that ``check --deploy --fail-level WARNING`` passes),
and the one line the README gives for a receiver on this machine.
"""
# ruff: noqa: E402  (the copied block has its imports, below the project's own settings)

import os

SECRET_KEY = "host-project-key-3f8a1c9e7b2d4e6f0a5c8b1d3e7f9a2c4b6d8e0f1a3c5e7"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["HOST_DB_NAME"],
        "HOST": os.environ.get("HOST_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("HOST_DB_PORT", "5432"),
        "USER": os.environ.get("HOST_DB_USER", ""),
        "PASSWORD": os.environ.get("HOST_DB_PASSWORD", ""),
    }
}
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",  # its own API, before the product's apps
    "billing",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "hostsite.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
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
STATIC_URL = "static/"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

# Production: cookies and HSTS over HTTPS. The proxy in front redirects plain HTTP (the
# test's client speaks it, as a developer's would).
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
SECURE_HSTS_SECONDS = 31536000
SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_PRELOAD = True
SILENCED_SYSTEM_CHECKS = ["security.W008"]  # SECURE_SSL_REDIRECT: the proxy's job

# The host's own API conventions, which the product's API must neither take nor change,
# on DRF's own schema class (drf-spectacular's deploy check would refuse its views).
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.BasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 1,
    "EXCEPTION_HANDLER": "billing.api.host_errors",
    "DEFAULT_SCHEMA_CLASS": "rest_framework.schemas.openapi.AutoSchema",
}

# settings.py: the apps, what they need, and what a deployment sets
import os

from deliveries.apps import TRUSTY_APPS
from deliveries.core.conf import q_cluster

# The three apps and the apps they use (rest_framework, django_filters, django_q, …);
# a name you already list stays where it is.
INSTALLED_APPS += [app for app in TRUSTY_APPS if app not in INSTALLED_APPS]
# Admin input the database refuses (a NUL byte in a filter) is answered 400, not 500.
MIDDLEWARE += ["deliveries.core.admin_input.AdminInputMiddleware"]

# The API's and the receiver's rate limits count in the default cache: every process
# must share it. The apps' migrations create this table (or point it at Redis). Past
# MAX_ENTRIES the cache culls live counters, which would reset the limits.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.db.DatabaseCache",
        "LOCATION": "webhooks_cache",
        "OPTIONS": {"MAX_ENTRIES": 100_000},
    }
}

# django-q2's own cluster (a qcluster running the maintenance schedules), on a queue of
# its own; without it django-q2 warns at every start.
Q_CLUSTER = q_cluster()

# The apps' log lines, one JSON object a line on stderr (below, "Logs").
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "deliveries.core.logs.JsonFormatter"}},
    "handlers": {"json": {"class": "logging.StreamHandler", "formatter": "json"}},
    "loggers": {
        "deliveries": {"handlers": ["json"], "level": "INFO", "propagate": False},
        "ingest": {"handlers": ["json"], "level": "INFO", "propagate": False},
    },
}

# Fernet keys that encrypt the stored secrets, newest first: one key, or several
# comma-separated during a rotation (python -c "from cryptography.fernet import Fernet;
# print(Fernet.generate_key().decode())").
SECRETS_ENCRYPTION_KEYS = os.environ.get("SECRETS_ENCRYPTION_KEYS")
# The token Prometheus sends to /metrics (Authorization: Bearer …).
METRICS_TOKEN = os.environ.get("METRICS_TOKEN")

# settings.py, on a development machine: deliveries to a receiver on this machine
EGRESS_ALLOW_NETWORKS = ["127.0.0.0/8"]
