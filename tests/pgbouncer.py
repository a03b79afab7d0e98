"""A private PgBouncer for the tests: Debian's ``pgbouncer`` (``make test`` installs it),
started with a configuration of its own in a temporary directory, listening on a free
loopback port in front of the test database's server, and stopped by its pid.

Every database name is passed through (``* =``), so the URL of the test database behind
it is the test database's own with PgBouncer's port. Its server connections carry the
application name ``pgbouncer``, so a test can tell them from direct connections in
``pg_stat_activity``."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

APPLICATION_NAME = "pgbouncer"


def binary() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )


class PgBouncer:
    """One pgbouncer process; ``url(database)`` reaches ``database`` through it."""

    def __init__(
        self, *, server_host: str, server_port: int, user: str, password: str, pool_mode: str
    ):
        self.server_host, self.server_port, self.user = server_host, server_port, user
        self.password = password  # PgBouncer logs in to the server with it
        self.pool_mode = pool_mode
        self.port = 0
        self.proc: subprocess.Popen | None = None
        # Readable by the unprivileged user it runs as under root (it refuses root).
        self.dir = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        self.dir.chmod(0o755)

    def url(self, database: str) -> str:
        # Trust: PgBouncer asks the client for no password.
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{database}"

    def start(self) -> "PgBouncer":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        users = self.dir / "users.txt"
        users.write_text(f'"{self.user}" "{self.password}"\n')
        config = self.dir / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host={self.server_host} port={self.server_port}"
            f" application_name={APPLICATION_NAME}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            "unix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {users}\n"
            f"pool_mode = {self.pool_mode}\n"
            "default_pool_size = 20\nmax_client_conn = 500\n"
            # Keep the application name the server connection was opened with.
            "ignore_startup_parameters = extra_float_digits,options\n"
        )
        for path in (users, config):
            path.chmod(0o644)
        command = [binary(), str(config)]
        if os.geteuid() == 0:
            command[1:1] = ["-u", "nobody"]
        self.log = open(self.dir / "pgbouncer.log", "w")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"pgbouncer exited: {self.output()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 1),
            ):
                return self
            assert time.monotonic() < deadline, f"pgbouncer did not listen: {self.output()}"
            time.sleep(0.05)

    def output(self) -> str:
        return (self.dir / "pgbouncer.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # 1.18: immediate shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running_pgbouncer(*, pool_mode: str = "transaction"):
    """A PgBouncer in front of the test database's server; skips the test, saying why,
    only when no ``pgbouncer`` is installed (``make test`` installs Debian's)."""
    from django.db import connection

    if binary() is None:
        pytest.skip("pgbouncer is not installed (make test installs Debian's pgbouncer)")
    s = connection.settings_dict
    bouncer = PgBouncer(
        server_host=s.get("HOST") or "127.0.0.1",
        server_port=int(s.get("PORT") or 5432),
        user=s.get("USER") or "postgres",
        password=s.get("PASSWORD") or "",
        pool_mode=pool_mode,
    )
    try:
        yield bouncer.start()
    finally:
        bouncer.stop()
