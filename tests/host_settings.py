"""A host project's settings, as small as Django allows: no setting of the apps' own.

tests/project/test_host.py runs ``check`` and ``migrate`` under it, to prove the apps
carry their defaults. The database is a SQLite file named by ``HOST_SQLITE_PATH``.
"""

import os

from deliveries.apps import TRUSTY_APPS

SECRET_KEY = "host-test-key-" + "x" * 40
DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["HOST_SQLITE_PATH"]}
}
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    *TRUSTY_APPS,
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ALLOWED_HOSTS = ["testserver"]
ROOT_URLCONF = "tests.host_urls"
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
