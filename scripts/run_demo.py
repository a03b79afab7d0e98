"""`make run`: the whole service on one machine, with a demo tenant and receiver.

Migrates the database (the embedded SQLite file unless DATABASE_URL is set), seeds a
demo tenant, an endpoint and an admin login, then runs as child processes:

    receiver   scripts/demo_receiver.py, a webhook receiver that checks signatures
    web        the admin, the REST API and the health endpoints
    scheduler  run_scheduler
    workers    run_workers
    jobs       run_jobs (background jobs: the polls and backfills started in the admin)

and publishes an ``invoice.paid`` event every few seconds, so deliveries (and, now and
then, a retry) show up in the receiver's output and in the admin. Ctrl-C stops it all.

Environment: DEMO_WEB_PORT (8000), DEMO_RECEIVER_PORT (8001), DEMO_PUBLISH_EVERY
(seconds, 3), DEMO_SECRET_FILE (where the receiver reads the endpoint's signing secret;
beside the SQLite file by default). EGRESS_ALLOW_NETWORKS and DEBUG are set for the
children unless already set; everything else is read as usual (README, "Settings").
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
MANAGE = [PYTHON, str(ROOT / "manage.py")]
STOP_TIMEOUT = 10.0
READY_TIMEOUT = 60.0
DEMO_TENANT = "demo"

_print_lock = threading.Lock()


def say(line: str, name: str = "demo") -> None:
    with _print_lock:
        for part in line.split("\n"):
            print(f"{name:<9} | {part}", flush=True)


class Children:
    """The child processes, each in its own process group so that a Ctrl-C reaches only
    this script, which then stops them in order: the receiver last, so that the workers'
    last requests still get an answer."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self._pumps: list[threading.Thread] = []

    def start(self, name: str, argv: list[str]) -> None:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            process_group=0,
        )
        self.procs[name] = proc
        pump = threading.Thread(target=self._pump, args=(name, proc), daemon=True)
        pump.start()
        self._pumps.append(pump)

    @staticmethod
    def _pump(name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            say(compact_log_line(line.rstrip()), name)

    def first_exited(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def stop(self) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT
        others = [n for n in self.procs if n != "receiver"]
        for group in (others, ["receiver"]):
            group = [n for n in group if n in self.procs]
            for name in group:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            for name in group:
                proc = self.procs[name]
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    say(f"{name} did not stop within {STOP_TIMEOUT:.0f} s; killing it")
                    proc.kill()
                    proc.wait()
        for pump in self._pumps:
            pump.join(1)


# Log fields left out of the console view: known from the prefix or only noise here.
_QUIET_FIELDS = {"time", "level", "logger", "message", "action", "run_id", "exc"}


def compact_log_line(line: str) -> str:
    """The service logs JSON lines (for machines); show them to a person as
    ``12:00:01 scheduler.tick enqueued=1``, zero counters left out."""
    if not line.startswith("{"):
        return line
    try:
        record = json.loads(line)
        at = datetime.fromisoformat(record["time"]).astimezone().strftime("%H:%M:%S")
    except (ValueError, KeyError, TypeError):
        return line
    parts = [at]
    if record.get("level") != "INFO":
        parts.append(str(record.get("level")))
    parts.append(str(record.get("action") or record.get("logger")))
    if record.get("message") != "tick":
        parts.append(str(record.get("message")))
    parts += [f"{k}={v}" for k, v in record.items() if k not in _QUIET_FIELDS and v != 0]
    text = " ".join(parts)
    return text + ("\n" + record["exc"] if record.get("exc") else "")


def run_step(name: str, argv: list[str]) -> str:
    """Run a set-up command to completion, echoing its output; exit if it fails."""
    result = subprocess.run(
        argv, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    for line in (result.stdout + result.stderr).splitlines():
        say(line, name)
    if result.returncode != 0:
        say(f"{name} failed with exit code {result.returncode}")
        sys.exit(1)
    return result.stdout


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until_ready(children: Children, stop: threading.Event, checks: dict) -> bool:
    """Poll each check until it passes; False if a child exits, a stop is asked for, or
    the deadline passes first."""
    deadline = time.monotonic() + READY_TIMEOUT
    pending = dict(checks)
    while pending and not stop.is_set():
        if children.first_exited() or time.monotonic() > deadline:
            return False
        for name, check in list(pending.items()):
            if check():
                del pending[name]
        stop.wait(0.2)
    return not pending


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our URL
            return response.status == 200
    except OSError:
        return False


def secret_file_path() -> Path:
    """Beside the SQLite file, so that two demos on two databases do not share it."""
    if os.environ.get("DEMO_SECRET_FILE"):
        return Path(os.environ["DEMO_SECRET_FILE"]).resolve()
    if os.environ.get("DATABASE_URL"):
        return ROOT / "var" / "demo_secret"
    sqlite_path = Path(os.environ.get("SQLITE_PATH", ROOT / "var" / "webhooks.sqlite3"))
    return sqlite_path.resolve().parent / "demo_secret"


def parse_seed_output(output: str) -> dict[str, str]:
    found = {}
    for line in output.splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            found[key] = value
    return found


class Publisher:
    """Publishes a demo event in this process, the way an application would."""

    def __init__(self) -> None:
        import django

        django.setup()
        from deliveries.models import Event, Tenant

        self.tenant = Tenant.objects.get(name=DEMO_TENANT)
        self.count = Event.objects.filter(tenant=self.tenant).count()

    def publish_one(self) -> None:
        from django.db import DatabaseError, close_old_connections

        from deliveries.services import publish_event

        self.count += 1
        invoice = f"inv_{self.count:05d}"
        payload = {
            "type": "invoice.paid",
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
            "data": {"invoice_id": invoice, "amount_cents": 1000 + self.count, "currency": "EUR"},
        }
        try:
            event = publish_event(
                tenant=self.tenant, event_type="invoice.paid", payload=payload, entity_id=invoice
            )
        except DatabaseError as exc:
            say(f"publishing failed, will try again: {exc}")
            close_old_connections()
            return
        say(f"published invoice.paid {invoice} (event {event.id})")


def banner(web_port: int, receiver_url: str, seed: dict[str, str], publish_every: float) -> None:
    web = f"http://127.0.0.1:{web_port}"
    database = "DATABASE_URL" if os.environ.get("DATABASE_URL") else "SQLite"
    lines = [
        "",
        "=" * 72,
        f"  Admin:       {web}/admin/   login {seed.get('Admin login', '?')}",
        f"  API:         {web}/api/v1/   Authorization: Bearer {seed.get('API key', '?')}",
        f"  API docs:    {web}/api/docs/",
        f"  API schema:  {web}/api/schema/",
        f"  Health:      {web}/healthz   {web}/readyz",
        f"  Receiver:    {receiver_url}",
        f"  Database:    {database}",
        f"  An invoice.paid event is published every {publish_every:g} s; every 7th new",
        "  delivery gets a 503 from the receiver and is retried about 5 s later.",
        "  Ctrl-C to stop.",
        "=" * 72,
        "",
    ]
    with _print_lock:
        print("\n".join(lines), flush=True)


def main() -> int:
    os.chdir(ROOT)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("EGRESS_ALLOW_NETWORKS", "127.0.0.0/8")  # the demo receiver
    os.environ.setdefault("DEBUG", "1")  # runserver serves the admin's static files
    os.environ["PYTHONUNBUFFERED"] = "1"  # child output arrives line by line
    sys.path.insert(0, str(ROOT))
    web_port = int(os.environ.get("DEMO_WEB_PORT", "8000"))
    receiver_port = int(os.environ.get("DEMO_RECEIVER_PORT", "8001"))
    publish_every = float(os.environ.get("DEMO_PUBLISH_EVERY", "3"))
    receiver_url = f"http://127.0.0.1:{receiver_port}/webhooks"
    secret_file = secret_file_path()

    for port, var in ((web_port, "DEMO_WEB_PORT"), (receiver_port, "DEMO_RECEIVER_PORT")):
        if port_in_use(port):
            say(f"port {port} is in use; stop what runs there or set {var}")
            return 1

    run_step("migrate", [*MANAGE, "migrate", "--noinput"])
    seed = parse_seed_output(
        run_step(
            "seed",
            [
                *MANAGE,
                "seed_demo",
                "--receiver-url",
                receiver_url,
                "--secret-file",
                str(secret_file),
                "--tenant",
                DEMO_TENANT,
            ],
        )
    )
    publisher = Publisher()

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())

    children = Children()
    exit_code = 0
    try:
        children.start(
            "receiver",
            [
                PYTHON,
                str(ROOT / "scripts" / "demo_receiver.py"),
                "--port",
                str(receiver_port),
                "--secret-file",
                str(secret_file),
            ],
        )
        # runserver, not gunicorn: under DEBUG it serves the admin's static files, which
        # gunicorn would need collectstatic plus a static file app for. Fine for a demo on
        # loopback; production runs gunicorn (project/gunicorn.conf.py).
        children.start("web", [*MANAGE, "runserver", f"127.0.0.1:{web_port}", "--noreload"])
        children.start("scheduler", [*MANAGE, "run_scheduler"])
        children.start("workers", [*MANAGE, "run_workers"])
        children.start("jobs", [*MANAGE, "run_jobs"])

        ready = wait_until_ready(
            children,
            stop,
            {
                "web": lambda: http_ok(f"http://127.0.0.1:{web_port}/healthz"),
                "receiver": lambda: port_in_use(receiver_port),
            },
        )
        if ready:
            banner(web_port, receiver_url, seed, publish_every)
        elif not stop.is_set() and not children.first_exited():
            say(f"the web server or the receiver did not start within {READY_TIMEOUT:.0f} s")
            exit_code = 1
            stop.set()

        next_publish = time.monotonic()
        while not stop.is_set():
            exited = children.first_exited()
            if exited:
                name, code = exited
                say(f"{name} exited unexpectedly (exit code {code}); stopping everything")
                exit_code = 1
                break
            if time.monotonic() >= next_publish:
                publisher.publish_one()
                next_publish = time.monotonic() + publish_every
            stop.wait(0.2)
    finally:
        say("stopping…")
        children.stop()
    say("stopped")
    return exit_code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        # Ctrl-C during set-up, before any long-running child was started.
        sys.exit(130)
