"""A minimal Django project for the django-q2 peer: only ``django_q``, the peer database,
and ``Q_CLUSTER`` as django-q2's documentation describes it (see README.md for each
value). ``DJQ_BROKER`` is ``orm`` or ``redis``."""

import os

import environ

SECRET_KEY = "bench-peers-not-a-secret"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["django_q"]
DATABASES = {"default": environ.Env.db_url_config(os.environ["PEER_DB_URL"])}
DATABASES["default"]["CONN_MAX_AGE"] = None
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_broker = os.environ.get("DJQ_BROKER", "orm")
_workers = int(os.environ.get("PEER_WORKERS", os.cpu_count() or 1))
Q_CLUSTER = {
    "name": f"bench_{_broker}",
    "workers": _workers,
    # Tasks pulled per broker round trip, and tasks prefetched into the cluster's
    # in-memory queue (the default queue_limit is workers ** 2).
    "bulk": int(os.environ.get("DJQ_BULK", "50")),
    "queue_limit": int(os.environ.get("DJQ_QUEUE_LIMIT", "500")),
    # No result rows: the workload has no result (result saving off, as in the reference figure).
    "save_limit": -1,
    "timeout": 30,
    "retry": 60,
    "max_attempts": 1,
    "catch_up": False,
    "log_level": "WARNING",
}
if _broker == "orm":
    Q_CLUSTER["orm"] = "default"
    Q_CLUSTER["poll"] = float(os.environ.get("DJQ_POLL", "0.05"))
else:
    Q_CLUSTER["redis"] = os.environ.get("PEER_REDIS_URL", "redis://127.0.0.1:6379/7")
