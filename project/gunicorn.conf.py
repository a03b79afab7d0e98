"""gunicorn settings; every value can be overridden with GUNICORN_* environment variables."""

import multiprocessing
import os

bind = os.environ.get("GUNICORN_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("GUNICORN_WORKERS", multiprocessing.cpu_count() * 2 + 1))
threads = int(os.environ.get("GUNICORN_THREADS", "1"))
timeout = int(os.environ.get("GUNICORN_TIMEOUT", "30"))
graceful_timeout = int(os.environ.get("GUNICORN_GRACEFUL_TIMEOUT", "30"))
keepalive = int(os.environ.get("GUNICORN_KEEPALIVE", "5"))
# Seconds a request body may stall between two reads (nginx's client_body_timeout). A
# client that stops sending mid-body gets 408 from the receive view instead of holding a
# worker until ``timeout`` kills it. It bounds each wait, not the whole body; a client
# trickling under it is stopped by ``timeout``; a buffering proxy in front stops both.
body_read_timeout = float(os.environ.get("GUNICORN_READ_TIMEOUT", "10"))
accesslog = os.environ.get("GUNICORN_ACCESSLOG") or None
wsgi_app = "project.wsgi:application"


def pre_request(worker, req):
    """Bound every read of this request's body (see ``body_read_timeout``)."""
    sock = getattr(req.unreader, "sock", None)
    if sock is not None:
        sock.settimeout(body_read_timeout)


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
