"""A private PostgreSQL cluster for chaos runs: initdb into a temporary directory, served
on a free loopback port, restarted at will, removed at the end.

The shared server on 5432 is never touched: other suites run against it at the same
time, and restarting it would be chaos for them rather than for us. initdb refuses to
run as root, so as root the cluster belongs to the ``postgres`` system user.
"""

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PG_BIN = Path(os.environ.get("SOAK_PG_BIN", "/usr/lib/postgresql/15/bin"))
# Tuned for a throwaway cluster on a small shared machine. fsync=off survives what the
# soak does (the server process dies, the kernel keeps its page cache); it would not
# survive a power cut, which is not under test here. synchronous_commit stays on: with
# it off, an immediate restart forgets the last transactions that were reported
# committed, and the harness would be testing a database that loses data.
SERVER_OPTIONS = {
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "200",
    "shared_buffers": "64MB",
    "fsync": "off",
    "full_page_writes": "off",
    "log_min_messages": "warning",
    "logging_collector": "off",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateCluster:
    def __init__(self, *, database: str = "webhooks") -> None:
        self.database = database
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="soak-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.restarts = 0
        self._user = None
        if os.geteuid() == 0:
            self._user = "postgres"
            pw = pwd.getpwnam(self._user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.role = self._user or pwd.getpwuid(os.geteuid()).pw_name

    @property
    def url(self) -> str:
        return f"postgres://{self.role}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *args: str, check: bool = True, timeout: float = 120):
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        if self._user:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        return subprocess.run(
            cmd, check=check, capture_output=True, text=True, timeout=timeout, cwd=self.dir
        )

    def start(self) -> "PrivateCluster":
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", self.role, "-E", "UTF8")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"port = {self.port}\nunix_socket_directories = '{self.dir}'\n")
            for key, value in SERVER_OPTIONS.items():
                conf.write(f"{key} = {value}\n")
        self._ctl("start")
        self.psql(f"CREATE DATABASE {self.database}", database="postgres")
        return self

    def _ctl(self, action: str, *extra: str) -> None:
        self._run("pg_ctl", action, "-D", str(self.data), "-l", str(self.log), "-w", *extra)

    def restart(self, mode: str = "fast") -> float:
        """Restart the server (``fast``: roll back and disconnect; ``immediate``: die and
        recover from the WAL on start). Returns the seconds it was away."""
        t0 = time.monotonic()
        self._ctl("restart", "-m", mode)
        self.restarts += 1
        return time.monotonic() - t0

    def psql(self, sql: str, *, database: str | None = None) -> str:
        return self._run(
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            self.role,
            "-d",
            database or self.database,
            "-Atqc",
            sql,
        ).stdout

    def terminate_backends(self, application_name: str | None = None) -> int:
        """pg_terminate_backend for every client backend but our own (or only those of one
        application_name); returns how many were dropped."""
        where = "backend_type = 'client backend' AND pid <> pg_backend_pid()"
        where += f" AND datname = '{self.database}'"
        if application_name:
            where += f" AND application_name = '{application_name}'"
        out = self.psql(
            f"SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE {where}"
        )
        return int(out.strip() or 0)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._ctl("stop", "-m", "immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "PrivateCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
