"""gunicorn settings; every value can be overridden with GUNICORN_* environment variables.

The worker is gunicorn's threaded worker with read deadlines (project/gunicorn_worker.py):
a slow client holds one thread for a bounded time, never a whole process, and a process
whose threads are all busy leaves new connections to the others. docs/deployment.md
("Serving") has the numbers and the proxy to put in front.
"""

import multiprocessing
import os

from project.gunicorn_worker import start_body

bind = os.environ.get("GUNICORN_BIND", "127.0.0.1:8000")
worker_class = os.environ.get("GUNICORN_WORKER_CLASS", "project.gunicorn_worker.ThreadWorker")
# Processes: one per core for the CPU, one more for the GIL's pauses. Threads: what a
# process can have waiting at once (on the database, or on a slow client's bytes). Each
# thread keeps its own database connection: workers x threads per host.
workers = int(os.environ.get("GUNICORN_WORKERS", multiprocessing.cpu_count() + 1))
threads = int(os.environ.get("GUNICORN_THREADS", "8"))
# With threads this is the heartbeat: a process whose main loop stalls this long is
# replaced. Slow requests are bounded by the read deadlines instead (GUNICORN_READ_TIMEOUT
# each wait, GUNICORN_HEADER_TIMEOUT the headers, GUNICORN_BODY_TIMEOUT the body).
timeout = int(os.environ.get("GUNICORN_TIMEOUT", "30"))
graceful_timeout = int(os.environ.get("GUNICORN_GRACEFUL_TIMEOUT", "30"))
keepalive = int(os.environ.get("GUNICORN_KEEPALIVE", "5"))
accesslog = os.environ.get("GUNICORN_ACCESSLOG") or None
wsgi_app = "project.wsgi:application"


def pre_request(worker, req):
    """The body's read deadline starts once the headers are in."""
    start_body(req)


def post_worker_init(worker):
    """Import the URL conf, and with it every view, before the first request.

    Django imports them lazily, inside a worker's first request, and that request then
    pays for the imports within ``timeout``: seconds on a slow host, where a worker
    killed by the timeout was replaced by one that paid again, so that it could never
    answer. ``notify`` restarts the timeout once the application has loaded and again
    once the imports are done, so that each step gets the whole of it."""
    from django.urls import get_resolver

    worker.notify()
    get_resolver().url_patterns  # noqa: B018 (imports every urls module and its views)
    worker.notify()
