"""The pooler settings and their checks, the direct listen connection, and the connection
budget (deliveries/jobs/connections.py, deliveries.E010-E015, I010, W010). The same
through a real PgBouncer: tests/e2e/test_pgbouncer.py."""

import threading
import time

import pytest
from django.db import connection

from deliveries.checks import check_connection_budget, check_pooler
from deliveries.jobs import connections as pooling
from deliveries.jobs import wakeup
from tests.conftest import manage, subprocess_env
from tests.deliveries.jobs import sample_jobs

POSTGRES = "django.db.backends.postgresql"


def ids(messages) -> list[str]:
    return sorted(m.id for m in messages)


# --- What transaction pooling breaks ------------------------------------------------------


def test_transaction_pooling_refuses_prepared_statements_and_server_side_cursors(settings):
    settings.DATABASE_POOLER = "transaction"
    # No prepare_threshold: psycopg's default, 5, prepares.
    problems = pooling.pooling_problems("default", {"ENGINE": POSTGRES})
    assert [p[0] for p in problems] == ["deliveries.E011", "deliveries.E012"]
    assert "prepare_threshold" in problems[0][1] and "5" in problems[0][1]
    safe = {"ENGINE": POSTGRES, "OPTIONS": {"prepare_threshold": None}}
    assert [p[0] for p in pooling.pooling_problems("default", safe)] == ["deliveries.E012"]
    safe["DISABLE_SERVER_SIDE_CURSORS"] = True
    assert pooling.pooling_problems("default", safe) == []


def test_a_pooler_that_keeps_prepared_statements_still_refuses_server_side_cursors(settings):
    settings.DATABASE_POOLER = "transaction-prepared"
    prepared = {"ENGINE": POSTGRES, "OPTIONS": {"prepare_threshold": 5}}
    assert [p[0] for p in pooling.pooling_problems("default", prepared)] == ["deliveries.E012"]


def test_without_a_pooler_or_on_sqlite_nothing_is_refused(settings):
    assert pooling.pooling_problems("default", {"ENGINE": POSTGRES}) == []
    settings.DATABASE_POOLER = "transaction"
    assert pooling.pooling_problems("x", {"ENGINE": "django.db.backends.sqlite3"}) == []


def test_an_unknown_pooler_is_one_error(settings):
    settings.DATABASE_POOLER = "pgbouncer"
    assert ids(check_pooler(None)) == ["deliveries.E010"]


def test_a_listen_url_that_is_no_connection_string_is_refused_without_showing_it(settings):
    settings.DATABASE_LISTEN_URL = "host=db password=s3cret =broken"
    (error,) = check_pooler(None)
    assert error.id == "deliveries.E013"
    assert "s3cret" not in error.msg


def test_transaction_pooling_without_a_listen_url_polls_and_says_so(settings):
    settings.DATABASE_POOLER = "transaction"
    messages = [m for m in check_pooler(None) if m.id.startswith("deliveries.I")]
    assert ids(messages) == ["deliveries.I010"]
    assert pooling.listen_conninfo() is None
    settings.DATABASE_LISTEN_URL = "postgresql://webhooks@127.0.0.1:5432/db"
    assert [m for m in check_pooler(None) if m.id == "deliveries.I010"] == []
    assert pooling.listen_conninfo() == settings.DATABASE_LISTEN_URL


@pytest.mark.django_db(transaction=True)
def test_a_direct_connection_is_no_transaction_pooling(settings):
    # The suite's own server, reached directly: two connections, two server processes.
    assert not connection.in_atomic_block  # so the probe asks
    assert pooling.pooled_per_transaction("default") is False
    assert ids(check_pooler(None, databases=["default"])) == []


@pytest.mark.django_db(transaction=True)
def test_a_direct_listen_url_is_no_pooler_and_an_unreachable_one_is_a_warning(settings):
    settings.DATABASE_LISTEN_URL = subprocess_env()["DATABASE_URL"]
    assert pooling.listen_url_pooled() is False
    assert ids(check_pooler(None, databases=["default"])) == []
    settings.DATABASE_LISTEN_URL = "postgresql://webhooks:s3cret@127.0.0.1:9/none"
    (warning,) = check_pooler(None, databases=["default"])
    assert warning.id == "deliveries.W011"
    assert "s3cret" not in warning.msg
    assert check_pooler(None) == []  # only a database check connects


# --- The listener -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_listener_hears_a_notify_on_the_direct_listen_url(settings):
    settings.DATABASE_POOLER = "transaction"
    settings.DATABASE_LISTEN_URL = subprocess_env()["DATABASE_URL"]
    assert wakeup.available()
    listener = wakeup.Listener(wakeup.JOBS)
    stop = threading.Event()
    try:
        assert listener.wait(0.05, stop) is False  # now listening
        wakeup.notify(wakeup.JOBS)
        assert listener.wait(10, stop) is True
    finally:
        listener.close()


@pytest.mark.django_db
def test_behind_transaction_pooling_without_a_listen_url_the_listener_only_sleeps(settings):
    settings.DATABASE_POOLER = "transaction"
    assert not wakeup.available()
    listener = wakeup.Listener(wakeup.JOBS)
    begun = time.monotonic()
    assert listener.wait(0.2, threading.Event()) is False
    assert time.monotonic() - begun >= 0.2
    assert listener._conn is None  # never connected: nothing to LISTEN on


# --- The connection budget ---------------------------------------------------------------


def max_connections() -> int:
    return pooling.server_connections_available("default")


@pytest.mark.django_db
def test_a_deployment_past_max_connections_is_a_warning_that_counts_it(settings):
    available = max_connections()
    settings.DEPLOY_HOSTS = 2
    settings.DEPLOY_PROCESSES = {"web": str(available), "web_threads": "1", "workers": "1"}
    (warning,) = check_connection_budget(None, databases=["default"])
    assert warning.id == "deliveries.W010"
    # web: available processes of 1 thread, workers: WORKER_LANES lanes + 3, per host; one
    # listener per worker.
    need = 2 * (available + settings.WORKER_LANES + 3) + 2
    assert f"up to {need} connections" in warning.msg
    assert f"it allows {available}" in warning.msg


@pytest.mark.django_db
def test_a_deployment_within_max_connections_is_silent(settings):
    settings.DEPLOY_HOSTS = 2
    settings.DEPLOY_PROCESSES = {"web": 3, "web_threads": 8, "scheduler": 1, "relay": 1}
    assert check_connection_budget(None, databases=["default"]) == []


@pytest.mark.django_db
def test_the_budget_asks_the_server_only_when_a_database_check_is_asked_for(settings):
    settings.DEPLOY_PROCESSES = {"web": 100_000}
    assert check_connection_budget(None) == []
    assert ids(check_connection_budget(None, databases=["default"])) == ["deliveries.W010"]


@pytest.mark.django_db
def test_behind_transaction_pooling_the_budget_is_the_pooler_s_and_the_listeners(settings):
    settings.DATABASE_POOLER = "transaction"
    settings.DEPLOY_PROCESSES = {"web": 100_000, "workers": 2}  # clients of the pooler
    settings.DEPLOY_POOLER_CONNECTIONS = 20
    assert check_connection_budget(None, databases=["default"]) == []
    settings.DEPLOY_POOLER_CONNECTIONS = max_connections()
    settings.DATABASE_LISTEN_URL = "postgresql://webhooks@127.0.0.1/db"
    (warning,) = check_connection_budget(None, databases=["default"])
    assert warning.id == "deliveries.W010"
    assert "and 2 direct LISTEN connections" in warning.msg


@pytest.mark.parametrize(
    "processes",
    [{"webs": 1}, {"web": "three"}, {"web": -1}, {"workers": True}, {"web": 1.5}],
)
def test_a_deployment_that_reads_as_no_counts_is_an_error(settings, processes):
    settings.DEPLOY_PROCESSES = processes
    assert ids(check_connection_budget(None)) == ["deliveries.E015"]


def test_no_hosts_is_an_error(settings):
    settings.DEPLOY_HOSTS = 0
    assert ids(check_connection_budget(None)) == ["deliveries.E015"]


def test_no_database_to_ask_is_no_crash():
    env = subprocess_env(
        DATABASE_URL="postgres://nobody@127.0.0.1:9/none", DEPLOY_PROCESSES="web=1000"
    )
    result = manage(
        "shell",
        "-c",
        "from deliveries.checks import check_connection_budget as c, check_pooler as p;"
        "print('budget', c(None, databases=['default']), 'pooler', p(None, databases=['default']))",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "budget [] pooler []" in result.stdout


@pytest.mark.django_db(transaction=True)
def test_the_budget_covers_what_the_real_processes_open(commands, tenant, make_endpoint, receiver):
    """The counts per process kind are what the commands open, at most: a scheduler, a
    relay, a worker with two lanes and run_jobs with two threads, busy and idle."""
    from deliveries import services
    from deliveries.jobs.background import enqueue

    make_endpoint(receiver.url("/ok"), event_types=["order.paid"])
    sample_jobs.ensure_marks()
    # Heartbeats every second, so that each heartbeat's connection shows in the window.
    env = subprocess_env(
        JOBS_MODULES="tests.deliveries.jobs.sample_jobs", LOOP_HEARTBEAT_SECONDS="1"
    )
    started = [
        commands("run_scheduler", env=env),
        commands("run_relay", env=env),
        commands("run_workers", "--lanes", "2", env=env),
        commands("run_jobs", "--concurrency", "2", env=env),
    ]
    counts = {"scheduler": 1, "relay": 1, "workers": 1, "worker_lanes": 2, "jobs": 1}
    counts["jobs_concurrency"] = 2
    budget = pooling.pooled_per_host(counts) + pooling.listeners_per_host(counts)

    def opened() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return cursor.fetchone()[0]

    seen = []
    deadline = time.monotonic() + 15
    for i in range(40):
        services.publish_event(tenant=tenant, event_type="order.paid", payload={"n": i})
        enqueue("test.mark", {"label": f"job-{i}"})
    while time.monotonic() < deadline:
        seen.append(opened())
        time.sleep(0.1)
    for command in started:
        assert command.stop() == 0, command.output()
    assert len(receiver.requests_to("/ok")) >= 40
    assert max(seen) <= budget, (max(seen), budget)
    # Not counted too generously either: what stays unused here is the worker's spare
    # executor thread and run_jobs' thread for async jobs (18 counted, 16 seen).
    assert max(seen) >= budget - 3


def test_each_process_kind_counts_what_sizes_it(settings):
    settings.SMTP_STORE_THREADS = 6
    settings.JOBS_CONCURRENCY = 10
    assert pooling.pooled_per_host({"smtp": 2}) == 2 * (6 + 2)
    assert pooling.pooled_per_host({"jobs": 1}) == 10 + 3
    assert pooling.pooled_per_host({"jobs": 1, "jobs_concurrency": 2}) == 2 + 3
    assert pooling.pooled_per_host({"workers": 2, "worker_lanes": 8}) == 2 * (8 + 3)
    assert pooling.pooled_per_host({"web": 3, "web_threads": 8, "other": 4}) == 24 + 4
    assert pooling.listeners_per_host({"scheduler": 1, "relay": 1, "workers": 2, "web": 3}) == 4
    settings.DATABASE_POOLER = "transaction"  # and no listen URL: nobody listens
    assert pooling.listeners_per_host({"scheduler": 1, "workers": 2}) == 0
