import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from deliveries import services
from deliveries.jobs.relay import relay_tick
from deliveries.models import Tenant
from deliveries.scheduler import scheduler_tick
from deliveries.worker import Worker
from tests.receiver import Receiver

SQLITE = "django.db.backends.sqlite3"


def pytest_report_header(config):
    if connection.vendor == "sqlite":
        return f"database: SQLite ({connection.settings_dict['NAME']}): only tests marked sqlite"
    return None


def pytest_collection_modifyitems(config, items):
    """On SQLite only the tests marked ``sqlite`` run (the pipeline's modules, whose every
    statement has a SQLite spelling); the rest rely on what only PostgreSQL has."""
    if connection.vendor != "sqlite":
        return
    marked, unmarked = [], []
    for item in items:
        (marked if item.get_closest_marker("sqlite") else unmarked).append(item)
    config.hook.pytest_deselected(items=unmarked)
    items[:] = marked


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    """On SQLite the test database is a file beside the configured one, not Django's
    default in-memory database: the commands a test starts as processes must open it."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    test = db.setdefault("TEST", {})
    if db["ENGINE"] == SQLITE and not test.get("NAME"):
        path = Path(db["NAME"])
        # Under pytest-xdist each worker has a file of its own (pytest-django suffixes
        # only the databases it names itself).
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        stem = f"test_{path.stem}_{worker}" if worker else f"test_{path.stem}"
        test["NAME"] = str(path.with_name(stem + path.suffix))


@pytest.fixture(autouse=True)
def _egress_allows_loopback(settings):
    # The tests' receivers listen on loopback, which the egress guard refuses by default.
    settings.EGRESS_ALLOW_NETWORKS = ["127.0.0.0/8"]


@pytest.fixture(autouse=True)
def _fresh_source_cache():
    # Each test's rows vanish with its rolled-back transaction, which sends no signal:
    # start every test with the web process's source cache empty.
    from ingest.sources import forget_sources

    forget_sources()


@pytest.fixture(autouse=True)
def _fresh_schema_cache():
    # The same for the event catalogue's schemas (deliveries.catalogue).
    from deliveries.schemas import forget_schemas

    forget_schemas()


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def tenant(db):
    return Tenant.objects.create(name="acme")


@pytest.fixture
def make_endpoint(tenant):
    def make(url, **options):
        endpoint, _secret = services.endpoint_create(tenant=tenant, url=url, **options)
        return endpoint

    return make


def queue_for_slow_endpoint(tenant, receiver, *, deliveries: int, seconds: float) -> None:
    """An endpoint whose receiver answers after ``seconds``, and ``deliveries`` of it
    admitted and on the broker, ready for a worker."""
    receiver.delays["/slow"] = seconds
    services.endpoint_create(tenant=tenant, url=receiver.url("/slow"))
    for i in range(deliveries):
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
    scheduler_tick()
    relay_tick()


def run_workers(**options) -> dict:
    """Run the real worker until the broker is empty."""
    worker = Worker(lanes=options.pop("lanes", 2), **options)
    return asyncio.run(worker.run(stop=asyncio.Event(), until_idle=True, idle_sleep=0))


def drain(rounds: int = 20) -> None:
    """Scheduler, relay and workers in turn until nothing is due or in flight now."""
    for _ in range(rounds):
        scheduler_tick()
        relay_tick()
        run_workers()
        if scheduler_tick().idle:
            return
    raise AssertionError("the pipeline did not drain")


def make_due(**filters) -> int:
    """Skip the backoff wait: make waiting pending deliveries due now (the test's clock)."""
    from deliveries.models import Delivery

    return Delivery.objects.filter(state="pending", **filters).update(
        next_attempt_at=timezone.now()
    )


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child process that uses the test database."""
    from django.db import connection

    s = connection.settings_dict
    if s["ENGINE"] == SQLITE:
        # NAME is absolute, so the URL has four slashes.
        url = f"sqlite:///{Path(s['NAME']).resolve()}"
    else:
        user = s.get("USER") or ""
        auth = f"{user}:{s['PASSWORD']}@" if s.get("PASSWORD") else (f"{user}@" if user else "")
        url = f"postgres://{auth}{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"
    env = {**os.environ, "DATABASE_URL": url, "EGRESS_ALLOW_NETWORKS": "127.0.0.0/8"}
    env.update(extra)
    return env


def manage(*args: str, env: dict[str, str], timeout: float = 60):
    """Run a management command as a real process; returns the CompletedProcess."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, str(root / "manage.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
    )


def in_thread(fn, errors: list[BaseException]) -> threading.Thread:
    """Start ``fn`` in a thread of its own; what it raises lands in ``errors``. The
    thread's database connection is closed at its end: an open one would block the flush
    of the test database at teardown."""

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


class Command:
    """A management command running as a real process, its output going to files."""

    def __init__(self, args: tuple[str, ...], env: dict[str, str], logs) -> None:
        import subprocess
        import sys

        root = Path(__file__).resolve().parent.parent
        self.args = args
        self.stdout = logs / f"{args[0]}.{id(self)}.out"
        self.stderr = logs / f"{args[0]}.{id(self)}.err"
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(root / "manage.py"), *args],
                env=env,
                cwd=root,
                stdout=out,
                stderr=err,
                # Its own process group, so that what it forks (a qcluster's sentinel,
                # workers and pusher) is killed with it.
                start_new_session=True,
            )

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then wait for it to exit; returns its exit code."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL to its whole process group (children it left behind included)."""
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def commands(tmp_path):
    """Start management commands as processes: ``commands("run_relay", env=...)``. What a
    failed assertion leaves running is killed, so it cannot go on writing to the test
    database."""
    started: list[Command] = []

    def start(*args: str, env: dict[str, str]) -> Command:
        command = Command(args, env, tmp_path)
        started.append(command)
        return command

    yield start
    for command in started:
        command.kill()


def scrape(*, fresh: bool = True, **client) -> dict:
    """{(sample name, sorted label items): value} from the real /metrics view; ``fresh``
    recomputes the database gauges instead of reading the cached ones."""
    from django.test import Client, override_settings
    from prometheus_client.parser import text_string_to_metric_families

    from deliveries.core import prometheus as metrics

    if fresh:
        metrics.DATABASE_COLLECTOR.clear()
    # As an allow-listed Prometheus on the same host: no address is allowed by default.
    with override_settings(METRICS_ALLOW_IPS=["127.0.0.1"]):
        response = Client(**client).get("/metrics")
    assert response.status_code == 200, response.content
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@contextlib.contextmanager
def gunicorn_server(env: dict[str, str], *, workers: int, config: str = "project/gunicorn.conf.py"):
    """The real gunicorn with ``config`` (the shipped one by default) and ``workers``
    processes on a free port, every worker up; yields (base URL, the master's Popen)."""
    import socket
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import requests

    from bench.outbound import child_pids

    root = Path(__file__).resolve().parent.parent
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    # A file, not a pipe: nobody reads a pipe while the test runs, and a full one would
    # block gunicorn's logging.
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", config, "--bind", f"fd://{listener.fileno()}"],
        cwd=root,
        env={**env, "GUNICORN_WORKERS": str(workers)},
        pass_fds=(listener.fileno(),),
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    listener.close()
    base = f"http://127.0.0.1:{port}"
    try:
        # Against a hang: each worker imports Django, about 10 s apiece on a machine whose
        # Python ran ten times slower.
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "gunicorn did not start"
            if server.poll() is not None:
                log.seek(0)
                raise AssertionError(log.read().decode(errors="replace")[-3000:])
            try:
                if requests.get(f"{base}/healthz", timeout=60).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        while len(found := child_pids(server.pid)) < workers:  # the last may still be booting
            assert time.monotonic() < deadline, f"gunicorn has workers {found}"
            time.sleep(0.1)
        yield base, server
    finally:
        server.terminate()
        server.wait(30)
        log.close()
