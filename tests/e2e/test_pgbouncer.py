"""Everything through a real PgBouncer in transaction mode (Debian's 1.18: no prepared
statements across transactions): the real commands as processes, publish to receiver,
background jobs, inbound receipt and processing, the wake-ups on the direct
``DATABASE_LISTEN_URL`` or polling without it, and what breaks when the settings do not
say a pooler is there."""

import json
import time

import psycopg
import pytest
import requests
from django.db import connection

from deliveries import services
from deliveries.jobs.background import enqueue
from deliveries.jobs.models import Job, JobState
from deliveries.models import Delivery
from ingest.schemes import get_scheme
from ingest.sources import source_create
from tests.chaos import handlers as soak_handlers
from tests.conftest import gunicorn_server, manage, subprocess_env
from tests.deliveries.jobs import sample_jobs
from tests.pgbouncer import APPLICATION_NAME, running_pgbouncer

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def pgbouncer():
    with running_pgbouncer() as bouncer:
        yield bouncer


def through(bouncer, **extra: str) -> dict[str, str]:
    """A child's environment on the test database through PgBouncer, as the settings
    for transaction pooling say (prepared statements off, no server-side cursors)."""
    env = subprocess_env(DATABASE_POOLER="transaction", **extra)
    env["DATABASE_URL"] = bouncer.url(connection.settings_dict["NAME"])
    return env


def direct_url() -> str:
    return subprocess_env()["DATABASE_URL"]


def poll(predicate, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def backends() -> list[tuple[str, str]]:
    """(application name, last query) of the other sessions on the test database."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT application_name, query FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchall()


def listening() -> list[str]:
    return [name for name, query in backends() if query.startswith("LISTEN")]


def publish(env: dict[str, str], tenant, events: int) -> None:
    """``events`` events published by a process of their own, through ``env``'s database."""
    code = (
        "from deliveries.services import publish_event\n"
        "from deliveries.models import Tenant\n"
        f"tenant = Tenant.objects.get(id={str(tenant.id)!r})\n"
        f"for i in range({events}):\n"
        "    publish_event(tenant=tenant, event_type='order.paid', payload={'n': i})\n"
    )
    result = manage("shell", "-c", code, env=env)
    assert result.returncode == 0, result.stderr


def succeeded() -> int:
    return Delivery.objects.filter(state="succeeded").count()


def test_the_pipeline_delivers_through_pgbouncer_and_wakes_on_the_direct_url(
    pgbouncer, receiver, make_endpoint, tenant, commands
):
    endpoint = make_endpoint(receiver.url("/ok"), event_types=["order.paid"])
    # Idle loops that only polled would look again 15 s later; a wake-up ends the wait.
    env = through(
        pgbouncer,
        DATABASE_LISTEN_URL=direct_url(),
        SCHEDULER_INTERVAL="15",
        RELAY_INTERVAL="15",
    )
    started = [
        commands("run_scheduler", env=env),
        commands("run_relay", env=env),
        commands("run_workers", "--lanes", "2", env=env),
    ]
    # Published through PgBouncer too, in 60 transactions on one connection, and each
    # statement of the hot path run many times: psycopg would have prepared them after 5.
    publish(env, tenant, 60)
    poll(lambda: succeeded() == 60, timeout=60, what="60 deliveries through PgBouncer")
    assert len({r.webhook_id for r in receiver.requests_to("/ok")}) == 60
    # Each loop listens on a direct connection; the rest of the work came through the pooler.
    poll(lambda: len(listening()) == 3, timeout=10, what="three listeners")
    assert APPLICATION_NAME not in listening()
    assert any(name == APPLICATION_NAME for name, _ in backends())
    time.sleep(2)  # every loop idle, each in its whole 15 s wait
    # The NOTIFY goes through PgBouncer in the publishing transaction.
    publish(env, tenant, 1)
    begun = time.monotonic()  # the publish committed before its process exited
    poll(lambda: succeeded() == 61, timeout=20, what="the wake-up")
    assert time.monotonic() - begun < 6, "delivered by polling, not by a wake-up"
    for command in started:
        assert command.stop() == 0, command.output()
    assert Delivery.objects.filter(endpoint=endpoint).exclude(state="succeeded").count() == 0


def test_without_a_listen_url_the_loops_poll_and_deliver_through_pgbouncer(
    pgbouncer, receiver, make_endpoint, tenant, commands
):
    make_endpoint(receiver.url("/ok"), event_types=["order.paid"])
    env = through(pgbouncer)
    started = [
        commands("run_scheduler", env=env),
        commands("run_relay", env=env),
        commands("run_workers", "--lanes", "2", env=env),
    ]
    for round_ in range(3):  # at intervals, as work arrives to idle loops
        for i in range(10):
            services.publish_event(tenant=tenant, event_type="order.paid", payload={"n": i})
        poll(lambda r=round_: succeeded() == 10 * (r + 1), timeout=30, what="polled delivery")
        time.sleep(1)
    assert listening() == []  # nobody LISTENs through the pooler
    for command in started:
        assert command.stop() == 0, command.output()


def test_background_jobs_run_through_pgbouncer(pgbouncer, commands):
    sample_jobs.ensure_marks()
    env = through(pgbouncer, JOBS_MODULES="tests.deliveries.jobs.sample_jobs")
    worker = commands("run_jobs", "--concurrency", "4", env=env)
    jobs = [enqueue("test.mark", {"label": f"job-{i}", "key": f"k:{i % 3}"}) for i in range(30)]
    poll(
        lambda: Job.objects.filter(state=JobState.DONE).count() == len(jobs),
        timeout=60,
        what="every job done",
    )
    assert worker.stop() == 0, worker.output()
    assert sorted(m[2] for m in sample_jobs.marks()) == sorted(f"job-{i}" for i in range(30))


def test_inbound_is_received_and_processed_through_pgbouncer(pgbouncer, commands):
    secret = "whsec_pgbouncer"
    source_create(slug=soak_handlers.SOURCE, scheme="stripe", secrets=[secret])
    with connection.cursor() as cursor:
        cursor.execute(soak_handlers.EFFECT_TABLE_SQL)
    env = through(pgbouncer, INGEST_HANDLER_MODULES="tests.chaos.handlers")
    started = [commands(name, env=env) for name in ("run_scheduler", "run_relay", "run_workers")]
    with gunicorn_server(env, workers=1) as (base, _server):
        for i in range(20):
            body = json.dumps(
                {"id": f"evt_{i}", "type": "invoice.paid", "created": int(time.time()),
                 "data": {"object": {"id": f"in_{i % 4}"}}}
            ).encode()  # fmt: skip
            headers = get_scheme("stripe").sign(body=body, secret=secret, timestamp=None)
            answer = requests.post(
                f"{base}/ingest/{soak_handlers.SOURCE}/", data=body, headers=headers, timeout=30
            )
            assert answer.status_code == 200, answer.text

    def applied() -> set[str]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT event_id FROM chaos_effect")
            return {row[0] for row in cursor.fetchall()}

    poll(lambda: len(applied()) == 20, timeout=60, what="20 inbound events processed")
    assert applied() == {f"evt_{i}" for i in range(20)}
    for command in started:
        assert command.stop() == 0, command.output()


def test_check_names_transaction_pooling_the_settings_do_not_declare(pgbouncer):
    undeclared = subprocess_env(DATABASE_URL=pgbouncer.url(connection.settings_dict["NAME"]))
    result = manage("check", "--database", "default", env=undeclared)
    assert result.returncode != 0
    assert "deliveries.E014" in result.stderr
    declared = through(pgbouncer)
    result = manage("check", "--database", "default", env=declared)
    assert result.returncode == 0, result.stderr
    assert "deliveries.E014" not in result.stdout + result.stderr
    # Directly, the same settings are no pooler's.
    result = manage("check", "--database", "default", env=subprocess_env())
    assert "deliveries.E014" not in result.stdout + result.stderr


def test_prepared_statements_do_not_survive_transaction_pooling(pgbouncer):
    """What deliveries.E011 prevents: psycopg names its prepared statements per client
    connection, and PgBouncer 1.18 hands two clients one server connection in turn."""
    url = pgbouncer.url(connection.settings_dict["NAME"])
    with (
        psycopg.connect(url, autocommit=True, prepare_threshold=0) as first,
        psycopg.connect(url, autocommit=True, prepare_threshold=0) as second,
    ):
        assert first.execute("SELECT %s::int", [1]).fetchone() == (1,)
        with pytest.raises(psycopg.errors.DuplicatePreparedStatement):
            second.execute("SELECT %s::int", [2])


def test_check_refuses_a_listen_url_through_the_pooler(pgbouncer):
    env = through(pgbouncer)
    env["DATABASE_LISTEN_URL"] = env["DATABASE_URL"]
    result = manage("check", "--database", "default", env=env)
    assert result.returncode != 0
    assert "deliveries.E016" in result.stderr
    env["DATABASE_LISTEN_URL"] = direct_url()
    result = manage("check", "--database", "default", env=env)
    assert result.returncode == 0, result.stderr
    assert "deliveries.E016" not in result.stdout + result.stderr
