"""gunicorn's threaded worker with two bounds on slow clients (docs/deployment.md).

gunicorn's ``gthread`` worker reads each request in a thread of its pool, so a client
trickling its request holds a thread rather than the whole process. Two things keep a
few slow clients from taking the threads of valid ones:

1. **Deadlines on reading a request, not just on each wait.** The request line and
   headers must arrive within ``GUNICORN_HEADER_TIMEOUT`` seconds of the thread taking
   the connection (the connection is then closed), and the body within
   ``GUNICORN_BODY_TIMEOUT`` seconds of the headers (the read fails, the view answers
   408); each wait for bytes is bounded by ``GUNICORN_READ_TIMEOUT`` as well. Without
   them a client sending a byte a second holds its thread for as long as it likes:
   unlike a sync worker, a thread is never killed by gunicorn's ``timeout``.
2. **A worker whose threads are all busy stops accepting.** Stock ``gthread`` accepts
   while it has connection slots (``worker_connections``, 1000) and queues the request
   behind its busy threads, so a valid request can wait behind slow clients in one
   process while another process idles. Here it stays in the listen backlog for a
   worker with a free thread to take.

Reading stops at a deadline by the socket's own timeout, set before every ``recv``, so
nothing else (no timer thread) is involved.
"""

import math
import os
import socket
import time
from dataclasses import dataclass

from gunicorn.http.unreader import SocketUnreader
from gunicorn.workers import gthread


@dataclass(frozen=True)
class ReadLimits:
    """Seconds: each wait for bytes, the request line and headers, the body."""

    wait: float
    headers: float
    body: float

    @classmethod
    def from_environ(cls, environ=os.environ) -> "ReadLimits":
        return cls(
            wait=float(environ.get("GUNICORN_READ_TIMEOUT", "10")),
            headers=float(environ.get("GUNICORN_HEADER_TIMEOUT", "10")),
            body=float(environ.get("GUNICORN_BODY_TIMEOUT", "30")),
        )


LIMITS = ReadLimits.from_environ()


class ReadDeadline:
    """The deadline of the read under way on one connection, enforced in its unreader."""

    def __init__(self, limits: ReadLimits) -> None:
        self.limits = limits
        self.until = math.inf
        self.in_body = False

    def start_headers(self) -> None:
        self.until, self.in_body = time.monotonic() + self.limits.headers, False

    def start_body(self) -> None:
        self.until, self.in_body = time.monotonic() + self.limits.body, True

    def bind(self, unreader: SocketUnreader) -> None:
        """Route ``unreader``'s reads through :meth:`_read` (once per connection)."""
        if getattr(unreader, "read_deadline", None) is self:
            return
        recv = unreader.chunk
        sock = unreader.sock

        def chunk(size_hint=None):
            return self._read(sock, recv, size_hint)

        unreader.chunk = chunk
        unreader.read_deadline = self

    def _read(self, sock, recv, size_hint):
        remaining = self.until - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError("request read deadline passed")
            sock.settimeout(min(self.limits.wait, remaining))
            return recv(size_hint)
        except TimeoutError:
            if self.in_body:
                raise  # an OSError: Django turns it into UnreadablePostError, the view 408
            # Headers that did not arrive: the connection ends quietly, as if closed.
            return b""


def start_body(req) -> None:
    """gunicorn's ``pre_request``: the body's deadline starts now. Under another worker
    class (no deadline on the connection) each wait is still bounded."""
    deadline = getattr(req.unreader, "read_deadline", None)
    if deadline is not None:
        deadline.start_body()
    elif isinstance(getattr(req.unreader, "sock", None), socket.socket):
        req.unreader.sock.settimeout(LIMITS.wait)


class ThreadWorker(gthread.ThreadWorker):
    """``gthread`` with read deadlines, accepting only while it has a free thread."""

    def init_process(self):
        self.busy = 0  # connections handed to the pool and not finished (main thread only)
        super().init_process()

    def set_accept_enabled(self, enabled):
        super().set_accept_enabled(enabled and self.busy < self.cfg.threads)

    def enqueue_req(self, conn):
        self.busy += 1
        if getattr(conn, "read_deadline", None) is None:
            conn.read_deadline = ReadDeadline(LIMITS)
            conn.init = _bound_init(conn, conn.init)
        super().enqueue_req(conn)
        self.set_accept_enabled(self.nr_conns < self.worker_connections)

    def finish_request(self, conn, fs):
        self.busy -= 1
        super().finish_request(conn, fs)

    def handle(self, conn):
        conn.read_deadline.start_headers()
        return super().handle(conn)


def _bound_init(conn, init):
    """``conn.init`` that, once the connection's HTTP/1 parser exists, binds the
    connection's deadline to its unreader."""

    def bound():
        init()
        unreader = getattr(conn.parser, "unreader", None)
        if isinstance(unreader, SocketUnreader):
            conn.read_deadline.bind(unreader)

    return bound
