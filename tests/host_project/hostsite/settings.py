"""The settings of a team's own Django project with the product installed from its wheel.

Of the apps' settings it sets only what it changes (deliveries/conf.py has the rest):
its loopback receiver needs the egress guard open for 127.0.0.1.
"""

import os

SECRET_KEY = "host-project-key-" + "x" * 40
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
    "billing",
    "rest_framework",
    "django_filters",
    "django_q",
    "drf_spectacular",
    "deliveries",
    "deliveries.jobs",
    "ingest",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
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

# The host's own API conventions, which the product's API must neither take nor change.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.BasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 1,
    "EXCEPTION_HANDLER": "billing.api.host_errors",
}

# The one app setting it changes: the test's receiver listens on loopback.
EGRESS_ALLOW_NETWORKS = ["127.0.0.1/32"]
